"""dpkg and apt-mark output (pure)."""

from __future__ import annotations

import re

# Status-Abbrev: desired action (i=install, h=hold, ...), then state (i=installed), then error
QUERY_FORMAT = "-f=${Package}\t${Version}\t${db:Status-Abbrev}\n"


def query_argv(packages: list[str]) -> list[str]:
    """dpkg-query for these packages (glob patterns allowed): one line each it knows."""
    return ["dpkg-query", "-W", QUERY_FORMAT, *packages]


def parse_query(text: str) -> dict[str, str]:
    """{package: version} of the packages dpkg has installed (state 'i'); a package that is
    only known (removed, config-files left, half-installed) is not installed."""
    out = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[2][1:2] == "i":
            out[parts[0]] = parts[1]
    return out


def parse_holds(text: str) -> list[str]:
    """`apt-mark showhold`: one held package per line."""
    return sorted(text.split())


def parse_apt_cache_show(text: str) -> set[str]:
    """`apt-cache show --no-all-versions pkg=ver ...`: the "pkg=ver" the archive has (those it
    lacks are only named on stderr)."""
    shown = set()
    for para in re.split(r"\n\s*\n", text):
        n = re.search(r"^Package: (\S+)$", para, re.M)
        v = re.search(r"^Version: (\S+)$", para, re.M)
        if n and v:
            shown.add(n.group(1) + "=" + v.group(1))
    return shown
