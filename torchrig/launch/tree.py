"""What launch pushes: a folder on the operator's machine read into a Tree (relative path ->
content hash, size, link target), once per launch, before any host is touched.

torchrig's own payload/ is pushed whole (no caches). A user's project (`launch --workdir`) is
pushed as git would see it: `.gitignore` files (at any depth) and a `.torchrigignore` at its
top, with git's own pattern semantics (pathspec's GitIgnoreSpec: a well-kept implementation of
gitwildmatch, negation and directory rules included, rather than a hand-written matcher), over a
built-in list of what is never worth sending (IGNORED). `.git/` is never sent, nor any folder
holding a virtualenv. A symlink is sent as a link when its target stays inside the tree and is
refused by name otherwise; a tree over the size bound is refused, naming its largest files,
before any byte is sent. torchrig's support files (the sampler, the progress module, the
bounded torchrun) go into SUPPORT_DIR of a project's release, where a script can
`import progress`.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import TorchrigError

if TYPE_CHECKING:  # imported where a project's patterns are read: not on a payload launch's path
    import pathspec

# never sent from a user's project (a `.torchrigignore` line `!pattern` brings one back,
# except .git/ and virtualenvs: see _walk)
IGNORED = ("__pycache__/", "*.py[cod]", ".pytest_cache/", ".mypy_cache/", ".ruff_cache/",
           ".tox/", ".nox/", ".ipynb_checkpoints/", "*.egg-info/", ".eggs/", "build/", "dist/",
           "node_modules/", ".DS_Store", "wandb/", "mlruns/", "lightning_logs/", "outputs/",
           "checkpoints/", "*.ckpt", "*.pt", "*.pth", "*.safetensors", ".torchrig/")
NEVER_DIRS = {".git", ".hg", ".svn"}
IGNORE_FILE = ".torchrigignore"
SUPPORT_DIR = ".torchrig"   # torchrig's files in a project's release
# payload files a project's release carries: the sampler, the health watcher and what they import, the bounded
# torchrun the unit runs, and the progress module a user script may use
SUPPORT_FILES = ("gpumon.py", "metrics.py", "progress.py", "torchrig_torchrun.py", "healthwatch.py",
                 "smi_xml.py")
LARGEST_SHOWN = 5


@dataclass(frozen=True)
class Entry:
    digest: str          # sha256 of the content, or "link:<target>" for a symlink
    size: int
    source: Path         # where it is read from on the operator's machine
    link: str | None = None


@dataclass
class Tree:
    root: Path
    files: dict[str, Entry] = field(default_factory=dict)

    def manifest(self) -> dict[str, str]:
        return {rel: e.digest for rel, e in sorted(self.files.items())}

    @property
    def hash(self) -> str:
        return tree_hash(self.manifest())

    @property
    def size(self) -> int:
        return sum(e.size for e in self.files.values())


def tree_hash(m: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in sorted(m.items())).encode()).hexdigest()[:16]


def _digest(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def payload_tree(root: Path) -> Tree:
    """torchrig's payload/: every file but caches."""
    if not root.is_dir():
        raise TorchrigError(f"payload directory {root} not found")
    t = Tree(root)
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and not {"__pycache__", ".pytest_cache"} & set(rel.parts) \
                and p.suffix != ".pyc":
            t.files[rel.as_posix()] = Entry(_digest(p), p.stat().st_size, p)
    return t


def _patterns(root: Path) -> pathspec.GitIgnoreSpec:
    """IGNORED, then every .gitignore (a nested one's patterns made relative to the top, as git
    applies them to its own folder), then .torchrigignore: the last match decides."""
    import pathspec  # imported here: only a project (--workdir) has patterns to read
    lines = list(IGNORED)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in NEVER_DIRS)
        if ".gitignore" in filenames:
            lines += _rebase(Path(dirpath).relative_to(root).as_posix(),
                             (Path(dirpath) / ".gitignore").read_text(errors="replace"))
    top = root / IGNORE_FILE
    if top.is_file():
        lines += top.read_text(errors="replace").splitlines()
    return pathspec.GitIgnoreSpec.from_lines(lines)


def _rebase(folder: str, text: str) -> list[str]:
    """A nested .gitignore's lines, as lines of the top one: a pattern with a slash (other than
    a trailing one) is anchored to its folder, one without matches at any depth below it."""
    if folder == ".":
        return text.splitlines()
    out = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        neg = "!" if s.startswith("!") else ""
        pat = s[1:] if neg else s
        anchored = "/" in pat.rstrip("/")
        out.append(f"{neg}{folder}/{pat.lstrip('/')}" if anchored else f"{neg}{folder}/**/{pat}")
    return out


def project_tree(root: Path, max_bytes: int, what: str = "--workdir") -> Tree:
    """The user's project at `root`, as it will be pushed; refused (one line, nothing sent)
    where it cannot be pushed as is."""
    root = root.expanduser()
    if not root.is_dir():
        raise TorchrigError(f"{what} {str(root)!r}: no such folder on this machine")
    root = root.resolve()
    spec = _patterns(root)
    t = Tree(root)
    refused = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        keep = []
        for d in sorted(dirnames):
            rel = (here / d).relative_to(root).as_posix()
            p = here / d
            if d in NEVER_DIRS or (p / "pyvenv.cfg").is_file():
                continue  # version control, and virtualenvs: never sent, whatever the patterns
            if p.is_symlink():
                filenames.append(d)   # a link to a folder: sent (or refused) as a link
            elif not spec.match_file(rel + "/"):
                keep.append(d)
        dirnames[:] = keep
        for f in sorted(filenames):
            p = here / f
            rel = p.relative_to(root).as_posix()
            st = os.lstat(p)
            if spec.match_file(rel + ("/" if p.is_symlink() and p.is_dir() else "")):
                continue
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(p)
                dest = (p.parent / target).resolve()
                if os.path.isabs(target) or not dest.is_relative_to(root):
                    refused.append(f"{rel} -> {target} (points outside the project)")
                    continue
                t.files[rel] = Entry(f"link:{target}", 0, p, link=target)
            elif stat.S_ISREG(st.st_mode):
                t.files[rel] = Entry("", st.st_size, p)
            else:
                refused.append(f"{rel} (not a regular file)")
    if refused:
        raise TorchrigError(f"{what} {str(root)!r}: cannot push {', '.join(refused[:LARGEST_SHOWN])}"
                            f"{' and more' if len(refused) > LARGEST_SHOWN else ''}; add them to "
                            f"{IGNORE_FILE} (gitignore syntax) or replace the links by files")
    if t.size > max_bytes:
        largest = sorted(t.files.items(), key=lambda kv: -kv[1].size)[:LARGEST_SHOWN]
        raise TorchrigError(
            f"{what} {str(root)!r}: {_mib(t.size)} to send, over the {_mib(max_bytes)} bound "
            f"(var workdir_max_mb); largest: "
            + ", ".join(f"{rel} ({_mib(e.size)})" for rel, e in largest)
            + f"; exclude what the job does not need in {IGNORE_FILE} or .gitignore "
            "(gitignore syntax), stage data with `torchrig data`, or raise workdir_max_mb")
    # hashed only once the tree is known to be sendable
    t.files = {rel: (e if e.link is not None else Entry(_digest(e.source), e.size, e.source))
               for rel, e in t.files.items()}
    return t


def with_support(t: Tree, payload: Path) -> Tree:
    """The project's tree plus torchrig's support files under SUPPORT_DIR."""
    out = Tree(t.root, dict(t.files))
    for name in SUPPORT_FILES:
        p = payload / name
        out.files[f"{SUPPORT_DIR}/{name}"] = Entry(_digest(p), p.stat().st_size, p)
    return out


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"
