set -e
base={{ base }}
{% include "push/lock.sh" %}
# missing: removed since it was found (another launch's sweep, rare): a new launch pushes it
[ -f "$base/releases/{{ h }}/.complete" ] || { echo "error: release {{ h }} is missing on this node (removed since it was found); launch again" >&2; exit 1; }
# newest now: the launch that pushed it writes its unit next, and the sweep below keeps it
touch "$base/releases/{{ h }}"
ln -sfn "releases/{{ h }}" "$base/.current.new" && mv -T "$base/.current.new" "$base/current"
# keep the 5 newest releases, any pushed or reused in the last hour (a launch may be between
# its push and writing its unit) and any a unit points at (a job that runs, or may run again)
cd "$base/releases" && ls -1t | tail -n +6 | while read -r old; do
  [ -z "$(find "$old" -maxdepth 0 -mmin -60)" ] || continue
  grep -qsF -- "releases/$old" /etc/systemd/system/torchrig-*.service || rm -rf -- "$old"
done
