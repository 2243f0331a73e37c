"""Jinja2 over templates/ (mirroring target paths), StrictUndefined: a missing value is an
error naming the template file and line, never an empty string in a unit file."""

from __future__ import annotations

import re
import traceback

import jinja2

from .errors import TorchrigError

from .resources import TEMPLATES
_env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                          keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
                          autoescape=False)


def render(template: str, **values) -> str:
    try:
        return _env.get_template(template).render(**values)
    except jinja2.TemplateError as e:
        line = getattr(e, "lineno", None)
        if line is None:  # undefined variables: find the template frame's line
            for fs in reversed(traceback.extract_tb(e.__traceback__)):
                if fs.filename.endswith(template):
                    line = fs.lineno
                    break
        raise TorchrigError(f"templates/{template}:{line or '?'}: {e}") from None


def systemd_quote(arg: str) -> str:
    """One argument for ExecStart= (systemd.syntax): double-quoted with C escapes, `$$` for a
    literal dollar (no env expansion), `%%` for a literal percent (no specifier)."""
    if "\n" in arg or "\r" in arg or "\0" in arg:
        raise TorchrigError(f"argument {arg!r} contains a newline or NUL, which a unit file cannot hold")
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"').replace("$", "$$").replace("%", "%%") + '"'


CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def systemd_path(path: str) -> str:
    """A path for a path directive such as WorkingDirectory= (no quoting there: the rest of
    the line is the path, with specifiers expanded). `%%` for a literal percent; refused: what
    a unit line cannot hold (control characters, surrounding blanks, a trailing backslash,
    which continues the line) and a relative path."""
    if (not path.startswith("/") or CONTROL.search(path) or path != path.strip()
            or path.endswith("\\")):
        raise TorchrigError(f"path {path!r} cannot go into a unit file: it must be absolute, "
                            "without control characters, surrounding blanks or a trailing backslash")
    return path.replace("%", "%%")


def env_quote(value: str) -> str:
    """A value for an EnvironmentFile= line, read back verbatim by systemd."""
    if "\n" in value or "\r" in value or "\0" in value:
        raise TorchrigError("environment values cannot contain newlines")
    if "'" not in value:
        return "'" + value + "'"
    return '"' + re.sub(r'([\\"$`])', r"\\\1", value) + '"'
