set -euo pipefail
install -d -m 0755 {{ jobs }}
{% include "launch/lock.sh" %}
{% include "launch/own_busy.sh" %}
{% if switch %}
# the release made current (push/switch.sh: under the push's lock, in a folder of its own,
# with the shell options it runs with alone)
( set +o nounset +o pipefail
{{ switch }}
)
{% endif %}
{% include "launch/jobdirs.sh" %}
{{ files }}
# a new launch of the job: the last run's stop record (stop.sh) no longer says anything
rm -f {{ stop_record }} {{ health_record }}
# systemd reads a unit it does not hold from its file when the unit is started; only a unit it
# holds (an earlier run of this job's name, still loaded) needs a reload to see its new file.
# A daemon-reload re-reads every unit on the node (0.2 s with 180 units), so only then. Which
# it holds: list-units (4 ms); `show` of them all loads each new file only to say "no" (30 ms)
held=$(systemctl list-units --all --plain --no-legend {{ units }} | awk '{print $1}')
if [ -n "$held" ] && systemctl show -p NeedDaemonReload --value $held | grep -qx yes; then
  systemctl daemon-reload
fi
systemctl reset-failed {{ name }} 2>/dev/null || true
