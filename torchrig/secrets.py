"""The one redactor for every output (tables, plans, --dry-run, --json, logs, error lines).

Masked as ***: values of vars whose names look secret, the env entries the inventory names in
`secret_env`, and credentials in URLs: `user:password@`, `:token@` and a token used as the
user name (`https://ghp_x@host`). A Redactor built from the inventory also masks those same
values wherever else they turn up (a tool echoing a URL it decoded, an error message)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, unquote

from .errors import TorchrigError

SECRET_NAME = re.compile(r"(pass(word)?|secret|token|api[_-]?key|credential|auth)", re.I)
MASK = "***"
# scheme://userinfo@ : userinfo runs to the LAST '@' before the authority ends, so a raw '@'
# in a password cannot leave its tail visible.
URL_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^/?#\s]*)@")
MIN_VALUE = 4  # shorter known values are masked only where their form shows them (URL, key)


def is_secret(name: str) -> bool:
    """A secret-looking name (`secret_env` itself lists names, which are not secret)."""
    return bool(SECRET_NAME.search(name)) and name != "secret_env"


def secret_env_names(value: Any, where: str = "var 'secret_env'") -> set[str]:
    """The env names a host's `secret_env` var lists: a list of names, or one name."""
    if value is None:
        return set()
    if isinstance(value, str):
        return {value}
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return set(value)
    raise TorchrigError(f"{where}: expected a list of environment variable names, "
                        f"got {type(value).__name__} {value!r}")


def _mask_userinfo(m: re.Match) -> str:
    user, colon, _ = m.group(2).partition(":")
    # user:password -> user:***; ':token' or a bare user name (a token) -> ***
    return f"{m.group(1)}{user}:{MASK}@" if colon and user else f"{m.group(1)}{MASK}@"


def url_credentials(text: str) -> list[str]:
    """Every credential in URLs in `text` (passwords, and user names that stand alone), in
    the forms they may appear in: as written and percent-decoded."""
    out = []
    for m in URL_USERINFO.finditer(text):
        user, colon, pw = m.group(2).partition(":")
        for v in ([pw] if colon and user else [user, pw]):
            out += [v, unquote(v)] if v else []
    return out


class Redactor:
    """Masks by form (secret-named keys, URL credentials) and by value (known secrets)."""

    def __init__(self, values: Iterable[str] = ()):
        vals = {str(v) for v in values if v is not None and len(str(v)) >= MIN_VALUE}
        vals |= {quote(v, safe="") for v in vals}
        self.values = sorted(vals, key=len, reverse=True)

    @classmethod
    def for_hosts(cls, hosts: Iterable[Any]) -> Redactor:
        """Every secret the hosts' settings hold; a name in any host's secret_env is secret in
        every host's env (a job's env is the same on all its nodes)."""
        hosts = list(hosts)
        settings = [h.settings for h in hosts]
        names = {k for s in settings for k in s.secret_env}
        values: list[str] = []
        for s in settings:
            values += _secrets_in(s.model_dump())
            values += [v for k, v in s.job_env.items() if k in names]
        # a BMC's password (inline, or read from the operator's environment)
        values += [b.secret() for h in hosts if (b := getattr(h, "bmc", None)) is not None]
        return cls(values)

    def text(self, s: str) -> str:
        s = URL_USERINFO.sub(_mask_userinfo, s)
        for v in self.values:
            s = s.replace(v, MASK)
        return s

    def data(self, value: Any, key: str = "") -> Any:
        """A copy of `value` (dicts, lists, dataclasses, strings) with secrets masked."""
        if key and is_secret(key) and not isinstance(value, bool) \
                and value not in (None, "", [], {}):
            return MASK
        if isinstance(value, dict):
            names = secret_env_names(value.get("secret_env")) if "secret_env" in value else set()
            out = {k: self.data(v, str(k)) for k, v in value.items()}
            if names and isinstance(out.get("env"), dict):
                out["env"] = {k: MASK if k in names else v for k, v in out["env"].items()}
            return out
        if isinstance(value, (list, tuple)):
            return [self.data(v) for v in value]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: self.data(getattr(value, f.name), f.name)
                                                 for f in dataclasses.fields(value) if f.init})
        if isinstance(value, str):
            return self.text(value)
        return value


def _secrets_in(value: Any, secret: bool = False) -> list[str]:
    """Secret strings inside a vars tree: under a secret-looking key, or credentials in a URL."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _secrets_in(v, secret or is_secret(str(k)))]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _secrets_in(v, secret)]
    if not isinstance(value, str):
        return []  # numbers and flags under a secret-looking name are masked by name only
    return ([value] if secret else []) + url_credentials(value)


_plain = Redactor()


def redact(value: Any, key: str = "") -> Any:
    """Mask by form only (no inventory at hand): secret-named keys and URL credentials."""
    return _plain.data(value, key)


def redact_text(text: str) -> str:
    return _plain.text(text)
