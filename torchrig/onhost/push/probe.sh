set -e
base={{ base }}
mkdir -p "$base"
{% include "push/lock.sh" %}
# found: touched under the lock, so no sweep deletes it before this launch writes its unit
if [ -f "$base/releases/{{ h }}/.complete" ]; then touch "$base/releases/{{ h }}"; echo HAVE; exit 0; fi
# the release current points at: the delta is computed against it, and built from it by name
cur=$(readlink "$base/current" 2>/dev/null || true)
echo "${cur##*/}"
if [ -f "$base/current/.manifest.json" ]; then cat "$base/current/.manifest.json"; else echo '{}'; fi
