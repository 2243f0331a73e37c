"""What a step may change on a host, as data: a root shell snippet or a whole file.
Planners return these; the applier turns them into one root script per step."""

from __future__ import annotations

import base64
import difflib
import hashlib
import posixpath
from dataclasses import dataclass

from ..onhost import script
from ..quoting import sh


@dataclass(frozen=True)
class Cmd:
    summary: str   # what an operator reads in the plan
    script: str    # bash, run as root after a preamble (provision: apply.preamble)

    def describe(self) -> str:
        return self.summary


@dataclass(frozen=True)
class AptInstall(Cmd):
    """An apt-get install of `specs` (name or name=version): provision/aptshare.py may have
    the .debs they need downloaded once for the fleet and put in apt's cache before it runs."""
    specs: tuple[str, ...] = ()


@dataclass(frozen=True)
class FileChange:
    path: str
    content: str | None  # None: the file must not exist
    mode: int = 0o644
    owner: str = "root"
    group: str = "root"
    current: str | None = None  # what is there now (for the diff); None if absent or secret
    secret: bool = False
    shown: str | None = None    # a secret file's new contents with the secrets masked (launch's env)

    def describe(self) -> str:
        if self.content is None:
            return f"remove {self.path}"
        return f"write {self.path} (mode {self.mode:04o}, {self.owner}:{self.group})"

    def diff(self) -> str:
        if self.secret:
            head = f"--- {self.path}\n+++ {self.path}\n"
            if self.shown is None:
                return head + "(secret file: contents not shown)\n"
            return (head + "(secret file: its contents now are not read back; new contents, "
                    "secrets masked:)\n" + "".join("+" + ln for ln in self.shown.splitlines(True)))
        old = (self.current or "").splitlines(keepends=True)
        new = (self.content or "").splitlines(keepends=True)
        return "".join(difflib.unified_diff(old, new, f"a{self.path}", f"b{self.path}"))

    @property
    def script(self) -> str:
        if self.content is None:
            return sh("rm", "-f", "--", self.path)
        return script("changes/write_file.sh", path=self.path, folder=posixpath.dirname(self.path),
                      data=b64(self.content), mode=f"{self.mode:04o}",
                      owner=f"{self.owner}:{self.group}").rstrip("\n")


def b64(text: str | bytes) -> str:
    """Base64 of text or bytes: a script carries file contents as `printf %s B64 | base64 -d`
    (printf is a shell builtin: the contents never show in a command line)."""
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def file_change(cur: dict | None, path: str, content: str | None, mode: int = 0o644,
                owner: str = "root", group: str = "root", secret: bool = False,
                shown: str | None = None) -> list[FileChange]:
    """[] when the file on the host (`cur`: its facts, None when absent) already matches
    (content hash, mode, owner), else one change."""
    if content is None:
        return [FileChange(path, None)] if cur else []
    want = hashlib.sha256(content.encode()).hexdigest()
    if cur and cur.get("sha256") == want and cur.get("mode") == mode \
            and cur.get("owner") == owner and cur.get("group") == group:
        return []
    return [FileChange(path, content, mode, owner, group,
                       current=None if secret or not cur else cur.get("content"), secret=secret,
                       shown=shown)]
