set -euo pipefail
base={{ base }}
mkdir -p "$base/releases"
{% include "push/lock.sh" %}
if [ -f "$base/releases/{{ h }}/.complete" ]; then cat > /dev/null; exit 0; fi  # a concurrent push made it
tmp=$(mktemp -d "$base/releases/.incoming-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
src={{ src }}
if [ -n "$src" ]; then
  [ -f "$base/releases/$src/.complete" ] || { echo "error: release $src, which the delta is based on, is gone" >&2; exit 1; }
  cp -a "$base/releases/$src/." "$tmp/"
fi
rm -f "$tmp/.complete" "$tmp/.manifest.json"
# stdin: the files to remove (NUL-separated), the manifest, the tar: each a base64 line (the
# last one the rest). Lists travel here, not in argv: 1,500 files overflow one argument.
IFS= read -r removed; IFS= read -r manifest
printf %s "$removed" | base64 -d | while IFS= read -r -d '' f; do rm -f -- "$tmp/$f"; done
printf %s "$manifest" | base64 -d > "$tmp/.manifest.json"
base64 -d | tar -xz --no-same-owner -C "$tmp"
chown -R root:root "$tmp" && chmod -R go-w,a+rX "$tmp"
touch "$tmp/.complete"
rm -rf "$base/releases/{{ h }}"   # only an incomplete leftover (a complete one returned above)
mv -T "$tmp" "$base/releases/{{ h }}"
trap - EXIT
