[ -d {{ jobs }} ] || exit 0
{% include "launch/lock.sh" %}
grep -qxF {{ marker }} {{ unit_file }} 2>/dev/null || exit 0
systemctl disable --quiet {{ name }} 2>/dev/null || true
systemctl stop {{ name }}
{{ remove }}
