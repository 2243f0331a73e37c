"""A user project's dependencies: read on the operator's machine, installed on every node into a
job environment keyed by their content hash, and checked equal everywhere before a job starts.

Where they come from (the first that exists): `launch --requirements FILE`, the project's
requirements.txt, then its pyproject.toml's [project] dependencies (the project itself is not
installed: its folder, and its package folders, are on the job's PYTHONPATH: imports.py; a
`-e .` line stands for its dependencies). A lock file (uv.lock, poetry.lock) is read through
its export to a requirements file (`uv export --format requirements-txt`): pip reads that
format, `==` pins and `--hash` included, so the nodes resolve exactly it.

The environment (onhost/deps/ensure.sh) is a venv at {prefix}/envs/<hash> that sees the
provisioned torch venv's packages: torch, its CUDA wheels and NCCL are never reinstalled. A
requirement that would replace them is refused: here where a line names torch with a version
the provisioned one does not satisfy (naming the line), on the node where pip's dry run would
install any of them (a dependency's dependency), unless --allow-torch-change.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import TorchrigError
from ..facts.python_env import normalize
from ..onhost import Shell, script
from ..quoting import sh

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REQUIREMENTS_TXT = "requirements.txt"
PYPROJECT = "pyproject.toml"
LOCK_FILES = ("uv.lock", "poetry.lock", "pdm.lock")
# pip options that would reach outside the one file, or carry an index: refused (the index is
# var deps_index_url, whose credentials go to a 0600 netrc)
REFUSED_OPTIONS = ("-r", "--requirement", "-c", "--constraint", "-e", "--editable", "-i",
                   "--index-url", "--extra-index-url", "-f", "--find-links")


def envs_dir(prefix: str) -> str:
    return f"{prefix}/envs"


@dataclass(frozen=True)
class Requirements:
    source: str          # where they were read, for messages (e.g. "requirements.txt")
    lines: tuple[str, ...]

    def text(self) -> str:
        return "".join(f"{ln}\n" for ln in self.lines)


def find(root: Path, requirements: str | None, pyproject: dict | None) -> Requirements | None:
    """The project's requirements, or None where it declares none. pyproject: its
    pyproject.toml (read_pyproject), read once for everything the launch takes from it."""
    if requirements is not None:
        p = Path(requirements)
        if p.is_absolute() or ".." in p.parts:
            raise TorchrigError(f"--requirements {requirements!r}: a file inside the project")
        if not (root / p).is_file():
            raise TorchrigError(f"--requirements {requirements!r}: no such file in {root}")
        return from_requirements_file(root / p, p.as_posix(), root, pyproject)
    if (root / REQUIREMENTS_TXT).is_file():
        return from_requirements_file(root / REQUIREMENTS_TXT, REQUIREMENTS_TXT, root, pyproject)
    if pyproject is not None:
        return from_pyproject(pyproject)
    locks = [f for f in LOCK_FILES if (root / f).is_file()]
    if locks:
        raise TorchrigError(f"{root}: {locks[0]} but no requirements.txt or pyproject.toml; "
                            "export the lock (e.g. `uv export --format requirements-txt -o "
                            "requirements.txt`) and launch again")
    return None


# a line that installs the project itself (`-e .`, `.[train]`): pip would build it and install
# it with its dependencies. The job imports the project from its folder (imports.py), so the
# line stands for those dependencies, read from pyproject.toml
SELF_LINE = re.compile(r"(?:(?:-e|--editable)(?:\s+|=)?)?\./?(?:\[([^\]]*)\])?")


def from_requirements_file(path: Path, name: str, root: Path,
                           pyproject: dict | None) -> Requirements | None:
    """root: the project's top, what a `.` line means; pyproject: its pyproject.toml."""
    lines = []
    joined = path.read_text(errors="replace").replace("\\\n", " ")
    for no, raw in enumerate(joined.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*", "", raw).strip()
        if not line:
            continue
        own = SELF_LINE.fullmatch(line)
        if own:
            extras = [e.strip() for e in (own.group(1) or "").split(",") if e.strip()]
            lines += own_dependencies(pyproject, root, extras, f"{name} line {no}: {line!r}")
            continue
        opt = line.split()[0].split("=")[0]
        if opt in REFUSED_OPTIONS:
            raise TorchrigError(f"{name} line {no}: {opt!r} is not supported in a job's "
                                "requirements (list every requirement in this one file; the "
                                "index is var deps_index_url)")
        lines.append(" ".join(line.split()))
    return Requirements(name, tuple(dict.fromkeys(lines))) if lines else None


def own_dependencies(pyproject: dict | None, root: Path, extras: list[str], where: str) -> list[str]:
    """The project's own dependencies, with those of `extras` (and of extras that name the
    project itself: `all = ["mypkg[train,eval]"]`), from its pyproject.toml's [project]."""
    project = pyproject.get("project") if isinstance(pyproject, dict) else None
    hint = ("list its dependencies in this file instead (the project itself needs no install: "
            "its folder is on the job's PYTHONPATH)")
    if not isinstance(project, dict):
        raise TorchrigError(f"{where} installs the project itself; torchrig reads its "
                            f"dependencies from {PYPROJECT}'s [project] table, which {root} "
                            f"lacks: {hint}")
    if "dependencies" in project.get("dynamic", []):
        raise TorchrigError(f"{where} installs the project itself, whose dependencies its "
                            f"build sets ({PYPROJECT}: dynamic = [\"dependencies\"]): {hint}")
    me = normalize(str(project.get("name", "")))
    optional = project.get("optional-dependencies", {})
    out, todo, seen = [], [None, *extras], set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        if extra is None:
            got = project.get("dependencies", [])
        elif isinstance(optional, dict) and extra in optional:
            got = optional[extra]
        else:
            raise TorchrigError(f"{where}: {PYPROJECT} has no optional dependencies {extra!r} "
                                f"(it has: {', '.join(optional) if isinstance(optional, dict) else 'none'})")
        for d in _declared(got):
            # the name and extras as written (packaging's Requirement keeps extras as a set:
            # their order, and with it the lines' and the environment's hash, would be lost)
            m = re.match(r"\s*([A-Za-z0-9._-]+)\s*(?:\[([^\]]*)\])?", d)
            if m and me and normalize(m.group(1)) == me:  # the project's own extras
                todo += [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]
            else:
                out.append(d)
    return out


def requires_python(pyproject: dict | None) -> str | None:
    """The project's `requires-python` ([project]), checked to be a version specifier."""
    project = pyproject.get("project") if isinstance(pyproject, dict) else None
    spec = project.get("requires-python") if isinstance(project, dict) else None
    if spec is None:
        return None
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    try:
        SpecifierSet(str(spec))
    except InvalidSpecifier:
        raise TorchrigError(f"{PYPROJECT}: requires-python {spec!r} is not a version specifier "
                            "(e.g. '>=3.10')") from None
    return str(spec)


def check_python(requires: str | None, pythons: dict[str, str | None]) -> None:
    """The project's requires-python against each node's torch venv Python (the venv a job
    environment extends): a project the nodes' Python cannot run is refused before anything
    is sent, where pip would have refused to install it."""
    if not requires:
        return
    from packaging.specifiers import SpecifierSet
    spec = SpecifierSet(requires)
    bad = {h: v for h, v in pythons.items() if v and not spec.contains(v, prereleases=True)}
    if bad:
        raise TorchrigError(
            f"nothing started: {PYPROJECT} says requires-python {requires!r}, and the torch venv "
            f"runs Python {', '.join(sorted(set(bad.values())))} on {', '.join(sorted(bad))} (the "
            "distribution's python3: Ubuntu 22.04 has 3.10, Debian 12 3.11, Ubuntu 24.04 "
            "3.12); relax requires-python, or launch on nodes whose distribution has it")


def read_pyproject(root: Path) -> dict | None:
    """The project's pyproject.toml, parsed; None where it has none."""
    path = root / PYPROJECT
    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TorchrigError(f"{PYPROJECT}: not valid TOML: {e}") from None


def from_pyproject(doc: dict) -> Requirements | None:
    deps = _declared(doc.get("project", {}).get("dependencies", []))
    return Requirements(f"{PYPROJECT} [project] dependencies", tuple(deps)) if deps else None


def _declared(deps) -> list[str]:
    """pyproject.toml's dependency strings, each one requirement (they become lines of pip's
    requirements file, where a line starting with '-' would be an option: the index's among
    them, which is var deps_index_url's alone)."""
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise TorchrigError(f"{PYPROJECT}: [project] dependencies must be lists of strings")
    for d in deps:
        if d.strip().startswith("-"):  # named by its option alone: its value may hold a password
            raise TorchrigError(f"{PYPROJECT}: dependency {d.split()[0].split('=')[0]!r} is a "
                                "pip option, not a requirement")
    return [" ".join(d.split()) for d in deps]


def check_torch(reqs: Requirements, torch_version: str, allow: bool) -> None:
    """A line that names torch with a version the provisioned one does not satisfy would
    replace it: refused, naming the line, unless the operator allows it."""
    # imported here: a payload launch reads no requirements, and packaging is not free to import
    from packaging.requirements import InvalidRequirement, Requirement
    for line in reqs.lines:
        if line.startswith("-"):
            continue
        try:
            req = Requirement(line.split(" --hash")[0].split(";")[0].strip())
        except InvalidRequirement as e:
            raise TorchrigError(f"{reqs.source}: {line!r}: {e}") from None
        if req.name.lower() != "torch" or allow:
            continue
        if req.url or not req.specifier.contains(torch_version, prereleases=True):
            raise TorchrigError(f"{reqs.source}: {line!r} would replace the provisioned torch "
                                f"{torch_version} (and its CUDA wheels); drop the version, or "
                                "pass --allow-torch-change to install it into the job "
                                "environment anyway")


def env_hash(reqs: Requirements, torch_version: str, venv: str, index: str | None,
             allow: bool) -> str:
    """What the environment is built from: the requirements and what they are resolved
    against (the provisioned torch, the venv it extends, the index without credentials)."""
    key = "\n".join([*reqs.lines, "--", torch_version, venv, index or "", str(allow)])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def ensure_script(reqs: Requirements, prefix: str, h: str, venv: str, index_url: str | None,
                  trusted_host: str | None, allow: bool) -> str:
    """The root script that makes the environment on a node."""
    from ..provision.desired import split_credentials
    from ..provision.steps import netrc
    args: list[str] = []
    secret = ""
    if index_url:
        index = split_credentials(index_url)
        args += ["--index-url", index.url]
        if index.login is not None:
            secret = base64.b64encode(netrc(index, "deps_index_url").encode()).decode()
    if trusted_host:
        args += ["--trusted-host", trusted_host]
    return script("deps/ensure.sh", envs=envs_dir(prefix), h=h, venv=venv,
                  requirements=base64.b64encode(reqs.text().encode()).decode(),
                  netrc=secret, pip_args=Shell(sh(*args) if args else ""),
                  protected_check=script("deps/protected.py"),
                  list_packages=script("deps/packages.py"), allow_torch_change=int(allow))


@dataclass(frozen=True)
class Built:
    state: str                 # "built" or "cached"
    packages: dict[str, str]   # name -> version, as the environment resolves them now
    recorded: dict[str, str]   # as recorded when it was built
    seconds: float


def parse_ensure(out: str) -> tuple[str, dict[str, str], dict[str, str]]:
    state, _, rest = out.partition("\n")
    now, _, recorded = rest.partition("--- recorded\n")
    if state.strip() not in ("built", "cached"):
        raise TorchrigError(f"building the job environment: unexpected output {out[:200]!r}")
    return state.strip(), _packages(now), _packages(recorded)


def _packages(text: str) -> dict[str, str]:
    out = {}
    for ln in text.splitlines():
        name, sep, ver = ln.strip().partition("==")
        if sep:
            out[name] = ver
    return out


def ensure(run, reqs: Requirements, h: str, timeout: int, script_text: str) -> Built:
    """One node's environment: `run(command, data, timeout)` runs the root script there."""
    t0 = time.monotonic()
    r = run("bash -s", script_text, timeout)
    if r.exited != 0:
        err = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        mine = [ln for ln in err if ln.startswith("error: ")]
        raise TorchrigError((mine[-1][len("error: "):] if mine else
                             "pip failed: " + " | ".join(err[-4:])) + f" ({reqs.source})")
    state, now, recorded = parse_ensure(r.stdout)
    return Built(state, now, recorded, round(time.monotonic() - t0, 1))


def differences(built: dict[str, Built]) -> list[str]:
    """Why the nodes' environments are not the same resolved package set (name==version, read
    from each environment itself): changed by hand since built, or different across nodes."""
    out = []
    for host, b in sorted(built.items()):
        changed = sorted(set(b.packages.items()) ^ set(b.recorded.items()))
        names = sorted({n for n, _ in changed})
        if names:
            out.append(f"{host}: changed since it was built: " + ", ".join(
                f"{n} {b.recorded.get(n, 'absent')} -> {b.packages.get(n, 'absent')}"
                for n in names))
    names = sorted({n for b in built.values() for n in b.packages})
    for n in names:
        vers = {host: b.packages.get(n, "absent") for host, b in sorted(built.items())}
        if len(set(vers.values())) > 1:
            out.append(f"{n}: " + ", ".join(f"{host} {v}" for host, v in vers.items()))
    return out
