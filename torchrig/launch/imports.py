"""Where a user project's own packages import from on the nodes.

The project's top folder is always first on the job's PYTHONPATH. A project packaged with
its code in a subfolder (PyPA's src layout: src/mypkg/__init__.py) gets that folder too,
right after it: the job imports the project as `pip install -e .` makes it importable on the
user's laptop, without installing it (the release is read-only to the job, and the code
changes with every launch while the job environment is built once).

The folder comes from the packaging metadata, every folder it names:
  pyproject.toml  [tool.setuptools] package-dir "", [tool.setuptools.packages.find] where,
                  [tool.poetry] packages' `from`, [tool.hatch.build.targets.wheel] packages'
                  parents, [tool.pdm.build] package-dir, [tool.uv.build-backend] module-root
  setup.cfg       [options] package_dir "=", [options.packages.find] where
else the src layout that setuptools, Hatch, PDM, Flit and uv_build find by themselves: a
`src/` without an __init__.py of its own that holds a package or a module, in a project with
pyproject.toml, setup.cfg or setup.py. A project without packaging metadata gets nothing
more: a research repository's `src/` imports as `src.x` from the top, and putting it on the
path would let its folders shadow installed packages (a src/datasets/ before Hugging Face's
`datasets`)."""

from __future__ import annotations

import configparser
import re
from collections.abc import Iterable

from ..errors import TorchrigError

SRC = "src"
PACKAGING = ("pyproject.toml", "setup.cfg", "setup.py")
# one folder name of a PYTHONPATH entry: no ':' (its separator), nothing the env file or a
# shell would read differently
PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def _at(doc, *keys):
    """doc[k1][k2]..., or None where a level is missing or not a table."""
    for k in keys:
        doc = doc.get(k) if isinstance(doc, dict) else None
    return doc


def _strs(v) -> list[str]:
    """A string or a list's strings (metadata written either way)."""
    return [v] if isinstance(v, str) else [x for x in v if isinstance(x, str)] if isinstance(v, list) else []


def declared(pyproject: dict | None, setup_cfg: str | None) -> list[tuple[str, str]]:
    """(folder as written, where) for each folder the packaging metadata names for the
    project's packages."""
    tool = _at(pyproject, "tool")
    named = [(_at(tool, "setuptools", "package-dir", ""), "[tool.setuptools] package-dir"),
             *((w, "[tool.setuptools.packages.find] where")
               for w in _strs(_at(tool, "setuptools", "packages", "find", "where"))),
             *((_at(p, "from"), "[tool.poetry] packages")
               for p in (_at(tool, "poetry", "packages") or []) if isinstance(p, dict)),
             *((p.rstrip("/").rpartition("/")[0], "[tool.hatch.build.targets.wheel] packages")
               for p in _strs(_at(tool, "hatch", "build", "targets", "wheel", "packages"))),
             (_at(tool, "pdm", "build", "package-dir"), "[tool.pdm.build] package-dir"),
             (_at(tool, "uv", "build-backend", "module-root"), "[tool.uv.build-backend] module-root")]
    out = [(f, f"pyproject.toml {w}") for f, w in named if isinstance(f, str)]
    if setup_cfg is not None:
        cfg = configparser.ConfigParser(interpolation=None)
        try:
            cfg.read_string(setup_cfg)
        except configparser.Error:
            return out  # setuptools refuses it too: the project's own build says why
        for line in cfg.get("options", "package_dir", fallback="").splitlines():
            key, eq, folder = line.partition("=")
            if eq and not key.strip():
                out.append((folder.strip(), "setup.cfg [options] package_dir"))
        out += [(w, "setup.cfg [options.packages.find] where")
                for w in cfg.get("options.packages.find", "where", fallback="").split()]
    return out


def import_roots(files: Iterable[str], pyproject: dict | None = None,
                 setup_cfg: str | None = None) -> tuple[tuple[str, ...], str]:
    """(the folders, relative to the project's top, that go on PYTHONPATH after it; where
    that was read). files: the project's files as sent (relative POSIX paths)."""
    files = set(files)
    named = declared(pyproject, setup_cfg)
    if not named and any(f in files for f in PACKAGING) and f"{SRC}/__init__.py" not in files \
            and any(re.fullmatch(rf"{SRC}/({IDENT}/__init__|{IDENT})\.py", f) for f in files):
        named = [(SRC, "the src layout")]
    out: list[str] = []
    for folder, where in named:
        rel = folder.strip().removeprefix("./").rstrip("/")
        if rel in ("", "."):
            continue  # the top: already first
        parts = rel.split("/")
        if ".." in parts or not all(PART.fullmatch(p) for p in parts):  # '/abs' too
            raise TorchrigError(f"{where}: package folder {folder!r} cannot go on the job's "
                                "PYTHONPATH (a folder inside the project, letters, digits, "
                                "'_', '.', '-')")
        if rel not in out and any(f.startswith(rel + "/") for f in files):
            out.append(rel)
    return tuple(out), ", ".join(dict.fromkeys(w for _, w in named))


def check_module(module: str, files: Iterable[str], roots: tuple[str, ...]) -> None:
    """`launch --module pkg.train` of the project's own package (a `pkg/__init__.py` at its
    top or in one of its package folders, the first as Python would find it): refused by name
    where that package has no such module, before anything is sent. A module of no package
    of the project's is an installed one's: the node's Python looks for it."""
    files, parts = set(files), module.split(".")
    if len(parts) < 2:
        return
    for root in ("", *roots):
        pre = f"{root}/" if root else ""
        if f"{pre}{parts[0]}/__init__.py" in files:
            path = pre + "/".join(parts)
            if f"{path}.py" not in files and f"{path}/__main__.py" not in files:
                raise TorchrigError(f"--module {module}: the project's package {pre}{parts[0]}/ "
                                    f"has no {path}.py (or {path}/__main__.py)")
            return
