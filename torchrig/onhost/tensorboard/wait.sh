u={{ unit }}
echo "state=$(systemctl show -p ActiveState --value "$u")"
journalctl -u "$u" -o cat --no-pager -n 200 2>/dev/null || true
