{# Tied to its SSH channel: when the channel is gone, the heartbeat's write fails (SIGPIPE) and
   the unit is stopped. Ends by itself once the unit is no longer active. #}
u={{ unit }}
trap 'systemctl stop "$u" 2>/dev/null || true' EXIT
trap 'exit 0' HUP INT TERM PIPE
while systemctl is-active --quiet "$u"; do
  echo alive || exit 0
  sleep {{ beat }}
done
