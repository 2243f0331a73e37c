set -eu
{% include "launch/lock.sh" %}
grep -qxF {{ marker }} {{ unit_file }} || {
  echo "error: another launch of job {{ job }} replaced its unit on this node meanwhile" >&2; exit 3; }
{% include "launch/own_busy.sh" %}
busy=$({{ busy_units }} | awk '{print $1}' | grep -xE {{ unit_re }} | grep -vxF {{ name }} || true)
if [ {{ exclusive }} = 1 ] && [ -n "$busy" ]; then
  echo "error: another job started on this node's GPUs meanwhile: $(echo $busy)" >&2; exit 3
fi
# the job ports' firewall: its table can be gone while its unit reads active (the operator's
# `nft flush ruleset`); loaded again here, and no job starts without it
if [ {{ firewall }} = 1 ] && ! nft list table {{ table }} >/dev/null 2>&1; then
  systemctl restart {{ firewall_unit }} && nft list table {{ table }} >/dev/null 2>&1 || {
    echo "error: torchrig's firewall table ({{ table }}) does not load on this node: the job's ports would be open to anyone; see journalctl -u {{ firewall_unit }}, or run torchrig provision" >&2; exit 3; }
fi
# an elastic job's unit is enabled: a node that boots again rejoins it (stop disables it).
# --no-reload: the link is read at boot; the running manager needs no reload of every unit
if [ {{ enable }} = 1 ]; then systemctl enable --quiet --no-reload {{ name }}; fi
systemctl start {{ name }}
{% if look %}
# launch's first look at the start, in this same round trip: the probe (facts/probe_host.py)
# answers once the node's state changed from what it first saw (the workers spawned, the unit
# failed), or after launch's wait
python3 -I - <<'TORCHRIG_PROBE'
{{ look }}
TORCHRIG_PROBE
{% endif %}
