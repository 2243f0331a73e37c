"""The operator's side of the probe (probe_host.py): the text sent to `python3 -I -` and the
reply read back. Pure: the callers run it over their own connection (root or not)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from ..errors import TorchrigError

SCRIPT = Path(__file__).with_name("probe_host.py")
COMMAND = "python3 -I -"  # -I: nothing imported from the working directory or the environment


def stdin(request: dict, script: Path = SCRIPT) -> str:
    """The script and its request, both on stdin: nothing of the request in any command line.
    base64 keeps the request inert inside the Python string literal. Other node scripts with
    a `main(request_b64)` (fetch's) travel the same way."""
    b64 = base64.b64encode(json.dumps(request).encode()).decode()
    return script.read_text() + f'\nmain("{b64}")\n'


NAMED = ("run", "read", "stat", "glob", "tree")  # request keys whose value is {name: spec}


def merge(*requests: dict) -> dict:
    """One request asking for everything the given ones ask for (one round trip for several
    callers' facts): their named parts joined, path and user lists joined, `host` or-ed. A
    name (or another key) two requests give must ask for the same thing."""
    out: dict = {}
    for req in requests:
        for key, want in req.items():
            if key in NAMED:
                got = out.setdefault(key, {})
                clash = [k for k in want if k in got and got[k] != want[k]]
                if clash:
                    raise ValueError(f"probe request {key}: {clash} asked for twice, differently")
                got.update(want)
            elif key in ("exists", "users"):
                out[key] = out.get(key, []) + [x for x in want if x not in out.get(key, [])]
            elif key == "host":
                out[key] = bool(out.get(key)) or bool(want)
            elif key in out and out[key] != want:
                raise ValueError(f"probe request {key}: asked for twice, differently")
            else:
                out[key] = want
    return out


def reply(rc: int, stdout: str, stderr: str, what: str = "gathering facts") -> dict:
    """The probe's JSON reply, or one error naming what failed."""
    if rc != 0:
        err = (stderr or stdout).strip()
        if "password is required" in err or err.startswith("sudo:"):
            raise TorchrigError(f"cannot become root ({err.splitlines()[-1]}): log in as root "
                                "or give the user passwordless sudo")
        raise TorchrigError(f"{what} failed (exit {rc}): {err[-400:]}")
    try:
        return json.loads(stdout)
    except ValueError:
        raise TorchrigError(f"{what}: the probe's reply is not JSON: {stdout.strip()[-200:]!r}") from None


def cut_note(cut: dict | None, what: str) -> str | None:
    """The probe's record of what its caps cut (probe_host.py capped()) in words, or None."""
    if not cut:
        return None
    parts = []
    if cut.get("lines"):
        parts.append(f"{cut['lines']} line(s) longer than {cut['max_line']} bytes cut")
    if cut.get("dropped_bytes"):
        parts.append(f"{cut['dropped_bytes']} bytes past the first {cut['max_bytes']} left out")
    if cut.get("ranks_left_out"):
        parts.append(f"{cut['ranks_left_out']} line(s) of ranks past the first "
                     f"{cut['max_ranks']} left out")
    if cut.get("oldest_dropped"):
        parts.append(f"the oldest {cut['oldest_dropped']} line(s) left out (at most "
                     f"{cut['max_kept']} bytes kept)")
    if cut.get("files_left_out"):
        parts.append(f"{cut['files_left_out']} file(s) past the first {cut['most']} left out")
    return f"{what} was cut on the node: " + "; ".join(parts)
