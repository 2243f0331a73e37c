"""A PEP 503 simple index of the wheels the testbed hosts need (CPU torch and its deps, and
what the tests' user projects need),
fetched once on the operator side with `pip download` and served on the bridge."""

from __future__ import annotations

import hashlib
import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import TorchrigError
from ..settings import DEFAULTS
from .paths import CACHE, served

# The testbed hosts run Debian 12's Python 3.11; torch is the CPU build (no GPU here).
# TensorBoard and its dependencies too: provision installs it where var `tensorboard` is set.
# six: a small pure-Python package the tests' user projects depend on (launch --workdir).
REQUIREMENTS = [f"torch=={DEFAULTS.torch_version}", "numpy",  # the versions provision pins
                f"tensorboard=={DEFAULTS.tensorboard_version}", "six==1.16.0"]
PYTHON_VERSION = "3.11"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def ensure_wheels() -> Path:
    key = hashlib.sha256(repr((REQUIREMENTS, PYTHON_VERSION)).encode()).hexdigest()[:12]
    d = CACHE / f"wheels-{key}"
    if (d / ".complete").exists():
        return d
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(tmp),
         "--only-binary=:all:", "--python-version", PYTHON_VERSION,
         "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
         "--platform", "manylinux_2_17_x86_64", *REQUIREMENTS],
        capture_output=True, text=True)
    if r.returncode != 0:
        raise TorchrigError("pip download of the testbed's wheels failed:\n" + r.stderr[-1500:])
    (tmp / ".complete").write_text("\n".join(REQUIREMENTS) + "\n")
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    return d


def write_index(wheels: Path, root: Path) -> None:
    """root/simple/<project>/index.html linking to root/files/<wheel> (a symlink to the cache)."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "simple").mkdir(parents=True)
    (root / "files").symlink_to(wheels)
    projects: dict[str, list[str]] = {}
    for whl in sorted(wheels.glob("*.whl")):
        projects.setdefault(_normalize(whl.name.split("-")[0]), []).append(whl.name)
    for proj, files in projects.items():
        (root / "simple" / proj).mkdir()
        links = "\n".join(
            f'<a href="../../files/{html.escape(f.replace("+", "%2B"))}">{html.escape(f)}</a><br>'
            for f in files)
        (root / "simple" / proj / "index.html").write_text(
            f"<!DOCTYPE html><html><body>\n{links}\n</body></html>\n")
    (root / "simple/index.html").write_text(
        "<!DOCTYPE html><html><body>\n"
        + "\n".join(f'<a href="{p}/">{p}</a><br>' for p in sorted(projects))
        + "\n</body></html>\n")


FILES = "pypi/files/"   # where the index serves the wheel files


def wheels_served(log_text: str) -> list[tuple[str, str]]:
    """(client address, wheel file name) for each wheel the index served, in order, from the
    testbed server's request log."""
    return [(c, p[len(FILES):]) for c, p in served(log_text) if p.startswith(FILES)]
