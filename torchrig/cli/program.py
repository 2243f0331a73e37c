"""The `torchrig` command: Invoke's Program over torchrig's task collection, as Fabric's `fab`
is over its own, so `pipx install torchrig` gives one command that works from any folder.
In a checkout, `invoke <task>` reads the same collection through tasks.py."""

import os
import sys

from invoke import Config, Program

from .tasks import ns

# what --version names: torchrig, then the libraries a bug report needs (as `fab --version`)
VERSIONS_OF = ("torchrig", "invoke", "fabric", "paramiko")


def _version(dist: str) -> str:
    """An installed distribution's version, read when --version asks (reading package metadata
    costs tens of ms: not on every start)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown (not installed as a package)"


class TorchrigConfig(Config):
    """Invoke's config levels under torchrig's name: /etc/torchrig.yaml, ~/.torchrig.yaml and
    `torchrig -f FILE`. Their settings are the collection's `torchrig.*` keys, so one file's
    text works as a checkout's invoke.yaml too."""

    prefix = "torchrig"


class TorchrigProgram(Program):
    def print_version(self) -> None:
        for dist in VERSIONS_OF:
            print(f"{dist} {_version(dist)}")


program = TorchrigProgram(name="torchrig", namespace=ns, config_class=TorchrigConfig,
                          binary="torchrig", binary_names=["torchrig"])


def main() -> None:
    """The console script (pyproject's [project.scripts])."""
    try:
        program.run()
    except BrokenPipeError:  # `torchrig --list | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # 128 + SIGPIPE, as a shell reports it
