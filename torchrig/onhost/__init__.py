"""Every script torchrig runs on a host, as a real file: bash (.sh) and Python (.py), in a
folder named for the part that sends it (launch/, push/, slurm/, tensorboard/, metrics/, logs/,
fetch/, provision/); lib/ holds pieces other scripts include. (The probe, facts/probe_host.py,
is still beside its parsers: facts/ imports it as a module.)

One way to render one: `script(name, **values)`.
- A .sh file is a Jinja2 template (StrictUndefined: a missing value is an error naming the
  file and line). Every `{{ value }}` is shell-quoted on output by the one quoting function
  (quoting.sh), so a script cannot forget to quote a value; a value that already is shell (a
  generated fragment, a command line built with sh()) is passed as Shell(text) and goes in
  as it is. `{% include "lib/lock.sh" %}` shares a piece.
- A .py file is sent as it is: its values travel as argv or on stdin, never by substitution.

tests/unit/test_onhost.py renders every .sh with representative values through `bash -n`
and compiles every .py.
"""

from __future__ import annotations

import functools
import traceback
from pathlib import Path

from ..errors import TorchrigError
from ..quoting import sh

HERE = Path(__file__).resolve().parent


class Shell(str):
    """Text that is already shell (a script fragment, a quoted command line): inserted into a
    script as it is, not quoted again."""


def _finalize(value) -> str:
    if value is None:  # never the word None in a root script
        raise TorchrigError("a value for a script on the host is None (not set)")
    return value if isinstance(value, Shell) else sh(value)


@functools.cache
def _env():
    """The .sh scripts' Jinja2 environment, made on first use: jinja2's import is ~0.1 s of
    start-up that a task sending only .py scripts (fetch, status) does not need."""
    import jinja2
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, autoescape=False,
                             finalize=_finalize)
    env.globals["shell"] = Shell
    env.filters["q"] = sh
    return env


def names() -> list[str]:
    """Every script's name (its path under onhost/), for the tests."""
    return sorted(str(p.relative_to(HERE)) for p in HERE.rglob("*")
                  if p.suffix in (".sh", ".py") and p.name != "__init__.py"
                  and "__pycache__" not in p.parts)


def script(name: str, /, **values) -> str:
    """The text of onhost/<name>: a .sh rendered with `values` (each quoted, see above), a .py
    as it is."""
    path = HERE / name
    if path.suffix == ".py":
        if values:
            raise TorchrigError(f"onhost/{name}: a Python script takes its values as argv or "
                                "on stdin, not by substitution")
        return path.read_text()
    import jinja2
    try:
        return _env().get_template(name).render(**values)
    except jinja2.TemplateNotFound:
        raise TorchrigError(f"onhost/{name}: no such script") from None
    except jinja2.TemplateError as e:
        line = getattr(e, "lineno", None)
        if line is None:  # an undefined value: the template frame's line
            for fs in reversed(traceback.extract_tb(e.__traceback__)):
                if fs.filename.startswith(str(HERE)):
                    line = fs.lineno
                    break
        raise TorchrigError(f"onhost/{name}:{line or '?'}: {e}") from None


def refusal(stderr: str) -> str | None:
    """The `error: ...` line a script here printed (their way to say why they refused), without
    the prefix; the last one."""
    lines = [ln[len("error: "):] for ln in stderr.splitlines() if ln.startswith("error: ")]
    return lines[-1] if lines else None
