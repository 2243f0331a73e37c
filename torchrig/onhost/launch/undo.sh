[ -d {{ jobs }} ] || exit 0
{% include "launch/lock.sh" %}
grep -qxF {{ marker }} {{ unit_file }} 2>/dev/null || exit 0
systemctl stop {{ name }}
{{ remove }}
