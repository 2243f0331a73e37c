u={{ unit }}
# a job never launched here has no unit: say so rather than "stopped"
if [ "$(systemctl show -p LoadState --value "$u")" = not-found ]; then echo "not-found 0"; exit 0; fi
was=$(systemctl show -p ActiveState --value "$u")
# recorded before the stop, so that `torchrig jobs` tells a stopped job from one that ended on
# its own (stop resets a stopped unit's failed state, and systemd forgets its timestamps): a
# root-owned 0644 record in root's jobs folder; nothing is written when the job had already
# ended by itself (a launch of the job clears the record)
case "$was" in active|activating|reloading|deactivating)
  umask 022
  printf '{"stopped_at": %s, "was": "%s", "by": "stop"}\n' "$(date +%s)" "$was" > {{ record }}.tmp
  mv -f {{ record }}.tmp {{ record }};;
esac
systemctl disable --quiet "$u" 2>/dev/null || true  # an elastic job's: no rejoin at boot
systemctl stop "$u"
# torchrun exits 1 when SIGTERM stops it (the workers checkpoint and exit 0): a job stopped
# here did not fail, so it should not read 'failed' afterwards. One that had failed before
# the stop keeps its state.
case "$was" in active|activating|reloading) systemctl reset-failed "$u" 2>/dev/null || true;; esac
# one last sample (as the service user, like every sample): node_exporter then serves the
# stopped job's state, not its last running one (the stop also stopped the sampler's timer)
systemctl start {{ sampler }} 2>/dev/null || true
cg=$(systemctl show -p ControlGroup --value "$u")
left=0
if [ -n "$cg" ] && [ -f "/sys/fs/cgroup$cg/cgroup.procs" ]; then left=$(wc -l < "/sys/fs/cgroup$cg/cgroup.procs"); fi
echo "$(systemctl show -p ActiveState --value "$u") $left"
