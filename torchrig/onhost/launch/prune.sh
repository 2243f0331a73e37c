{# `torchrig jobs --prune`: remove ended jobs' files on this node. Under the launch lock (the one
   install, start and undo hold), each job is checked again: a unit that runs (or stops, or
   waits to restart) is kept, and so is one that a new launch rewrote since the operator read
   it (its launch line differs). Prints per job `pruned JOB` or `kept JOB WHY`; the folder
   removals (jobdirs.py) print a line per folder. #}
set -u
[ -d {{ jobs }} ] || { echo "error: no {{ jobs }} on this node" >&2; exit 3; }
{% include "launch/lock.sh" %}
pruned=""
{% for p in prune %}
st=$(systemctl show -p ActiveState --value {{ p.unit }} 2>/dev/null || echo unknown)
if printf '%s\n' "$st" | grep -qxE {{ running_re }}; then
  echo "kept "{{ p.job }}" still $st"
elif [ -n {{ p.marker }} ] && [ -e {{ p.unit_file }} ] && ! grep -qxF {{ p.marker }} {{ p.unit_file }}; then
  echo "kept "{{ p.job }}" launched again meanwhile"
else
  systemctl stop {{ p.timer }} {{ p.sampler }} {{ p.ended }} 2>/dev/null || true
  rm -f {{ p.files }}
  pruned="$pruned "{{ p.job }}
{% if p.dirs %}
  python3 -I - {{ p.dirs }} <<'TORCHRIG_PY'
{{ dirs_script }}
TORCHRIG_PY
{% endif %}
  echo "pruned "{{ p.job }}
fi
{% endfor %}
systemctl daemon-reload
{% for p in prune %}
case " $pruned " in *" "{{ p.job }}" "*) systemctl reset-failed {{ p.unit }} {{ p.timer }} {{ p.sampler }} {{ p.ended }} 2>/dev/null || true;; esac
{% endfor %}
exit 0
