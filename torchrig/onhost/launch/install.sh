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
systemctl daemon-reload
systemctl reset-failed {{ name }} 2>/dev/null || true
