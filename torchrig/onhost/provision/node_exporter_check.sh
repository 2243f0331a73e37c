{# After node_exporter's (re)start: it must answer on its address; a bind that fails (an
   address the host does not have) ends the process after systemctl has already returned. #}
answers=0
for i in $(seq 1 20); do
  if python3 -I -c 'import sys, urllib.request as u; u.build_opener(u.ProxyHandler({})).open(sys.argv[1], timeout=2).read(1)' {{ url }} 2>/dev/null; then
    answers=1; break
  fi
  sleep 0.5
done
if [ "$answers" = 0 ]; then
  echo "error: node_exporter does not answer on {{ url }}: $(journalctl -u {{ unit }} -n 3 -o cat --no-pager | tr '\n' ' ')" >&2
  exit 1
fi
