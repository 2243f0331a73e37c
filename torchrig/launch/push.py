"""Push the payload directory to a node: content-hashed releases, only changed files sent,
switched into place atomically, so an interrupted push leaves the previous payload in use.

Layout on the node:  {prefix}/payload/releases/<tree hash>/   (complete, read-only)
                     {prefix}/payload/current -> releases/<tree hash>
A job's unit points at its own release, so a later push never changes a running job's code.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

from ..errors import TorchrigError
from ..remote import flock_lines, login_user, privileged, sh

SKIP_DIRS = {"__pycache__", ".git", ".pytest_cache"}


def manifest(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every payload file (no caches)."""
    if not root.is_dir():
        raise TorchrigError(f"payload directory {root} not found")
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not SKIP_DIRS & set(rel.parts) and p.suffix != ".pyc":
            out[rel.as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def tree_hash(m: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in sorted(m.items())).encode()).hexdigest()[:16]


def _tar(root: Path, files: list[str]) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel in files:
            info = tar.gettarinfo(str(root / rel), arcname=rel)
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            with open(root / rel, "rb") as f:
                tar.addfile(info, f)
    return _b64(buf.getvalue())


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# Every step that changes {base} holds a lock, so two launches pushing to one node at once
# both succeed: the second finds the release complete, or builds its own in a private folder
# and renames it in. The lock is a 0600 file of root's: a folder (0755) can be opened, so
# flock'ed, by any local user or job, which then held off every push.
LOCK = flock_lines('"$base"', "another push to $base held its lock", 1)

PROBE = """set -e
base={base}
mkdir -p "$base"
""" + LOCK + """# found: touched under the lock, so no sweep deletes it before this launch writes its unit
if [ -f "$base/releases/{h}/.complete" ]; then touch "$base/releases/{h}"; echo HAVE; exit 0; fi
# the release current points at: the delta is computed against it, and built from it by name
cur=$(readlink "$base/current" 2>/dev/null || true)
echo "${{cur##*/}}"
if [ -f "$base/current/.manifest.json" ]; then cat "$base/current/.manifest.json"; else echo '{{}}'; fi
"""

INSTALL = """set -euo pipefail
base={base}
mkdir -p "$base/releases"
""" + LOCK + """if [ -f "$base/releases/{h}/.complete" ]; then cat > /dev/null; exit 0; fi  # a concurrent push made it
tmp=$(mktemp -d "$base/releases/.incoming-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
src={src}
if [ -n "$src" ]; then
  [ -f "$base/releases/$src/.complete" ] || {{ echo "error: release $src, which the delta is based on, is gone" >&2; exit 1; }}
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
rm -rf "$base/releases/{h}"   # only an incomplete leftover (a complete one returned above)
mv -T "$tmp" "$base/releases/{h}"
trap - EXIT
"""

SWITCH = """set -e
base={base}
""" + LOCK + """[ -f "$base/releases/{h}/.complete" ] || {{ echo "error: release {h} is missing" >&2; exit 1; }}
# newest now: the launch that pushed it writes its unit next, and the sweep below keeps it
touch "$base/releases/{h}"
ln -sfn "releases/{h}" "$base/.current.new" && mv -T "$base/.current.new" "$base/current"
# keep the 5 newest releases, any pushed or reused in the last hour (a launch may be between
# its push and writing its unit) and any a unit points at (a job that runs, or may run again)
cd "$base/releases" && ls -1t | tail -n +6 | while read -r old; do
  [ -z "$(find "$old" -maxdepth 0 -mmin -60)" ] || continue
  grep -qsF -- "releases/$old" /etc/systemd/system/torchrig-*.service || rm -rf -- "$old"
done
"""


def push(cxn, root: Path, prefix: str) -> tuple[str, int]:
    """Make `root` the node's current payload. Returns (release dir, files sent)."""
    m = manifest(root)
    h = tree_hash(m)
    base = f"{prefix}/payload"
    user = login_user(cxn)
    r = cxn.run(privileged(PROBE.format(base=sh(base), h=h), user), hide=True, warn=True)
    if r.exited != 0:
        raise TorchrigError(f"payload probe failed: {r.stderr.strip()[-300:]}")
    sent = 0
    if r.stdout.strip() != "HAVE":
        src, _, text = r.stdout.partition("\n")
        try:
            remote = json.loads(text)
        except ValueError:
            remote = {}
        if not re.fullmatch(r"[0-9a-f]{16}", src.strip()):
            src, remote = "", {}   # no usable release to build on: send everything
        changed = [f for f, digest in m.items() if remote.get(f) != digest]
        removed = [f for f in remote if f not in m]
        script = INSTALL.format(base=sh(base), h=h, src=sh(src.strip()))
        data = "\n".join([_b64("".join(f + "\0" for f in removed).encode()),
                          _b64(json.dumps(m, sort_keys=True).encode()), _tar(root, changed)])
        r = cxn.run_input(privileged(script, user), data, timeout=600)
        if r.exited != 0:
            raise TorchrigError(f"payload push failed: {r.stderr.strip()[-300:]}")
        sent = len(changed)
    r = cxn.run(privileged(SWITCH.format(base=sh(base), h=h), user), hide=True, warn=True)
    if r.exited != 0:
        raise TorchrigError(f"payload switch failed: {r.stderr.strip()[-300:]}")
    return f"{base}/releases/{h}", sent
