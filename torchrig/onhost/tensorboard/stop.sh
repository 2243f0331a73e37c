u={{ unit }}
systemctl stop "$u" 2>/dev/null || true
echo "$(systemctl show -p LoadState --value "$u") $(systemctl show -p ActiveState --value "$u")"
