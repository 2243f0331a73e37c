set -euo pipefail
install -d -m 0755 {{ jobs }}
{% include "launch/lock.sh" %}
{% include "launch/own_busy.sh" %}
{% include "launch/jobdirs.sh" %}
{{ files }}
systemctl daemon-reload
systemctl reset-failed {{ name }} 2>/dev/null || true
