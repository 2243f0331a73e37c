set -eu
install -d -m 0755 {{ jobs }}
tmp=$(mktemp {{ path }}.XXXXXX)
cat > "$tmp"
chmod 0644 "$tmp"
mv -f "$tmp" {{ path }}
