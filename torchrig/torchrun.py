"""torchrun's command line, built in one place: launch's units and verify's benchmark."""

from __future__ import annotations

STANDALONE = ("--standalone",)  # one node: a local rendezvous, no port
# The rendezvous run id goes to torchrun in its environment (torchrun reads --rdzv-id from
# PET_RDZV_ID), never in argv: every local user's `ps` shows argv.
RUN_ID_ENV = "PET_RDZV_ID"


def rendezvous(nnodes: int | str, endpoint: str, is_host: bool, local_addr: str,
               join_timeout: int | None = None, conf_extra: dict | None = None) -> list[str]:
    """--standalone for one node; else c10d on `endpoint` (host:port of the first node), the
    run id in the environment (RUN_ID_ENV). nnodes: N, or "MIN:MAX" (an elastic job, whose
    further c10d settings come in `conf_extra`)."""
    if nnodes == 1:
        return list(STANDALONE)
    # torchrun decides who hosts the c10d store by resolving its own hostname, which on
    # Debian/Ubuntu is 127.0.1.1: say it explicitly instead.
    conf = f"is_host={'true' if is_host else 'false'}"
    if join_timeout is not None:
        conf += f",join_timeout={join_timeout}"
    conf += "".join(f",{k}={v}" for k, v in (conf_extra or {}).items())
    return ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-conf", conf,
            "--local-addr", local_addr]  # what the peers dial (the inventory address)


TORCHRUN = "torch.distributed.run"
# launch's units: torchrun with its exit barrier bounded (payload/torchrig_torchrun.py)
BOUNDED_TORCHRUN = "torchrig_torchrun"


def command(venv: str, rdzv: list[str], nproc: int, module: str = TORCHRUN,
            python: str | None = None) -> list[str]:
    """torchrun from the venv (`python -m`: no reliance on the venv's bin/ scripts), or from
    `python` (a job environment that sees the venv's packages)."""
    return [python or f"{venv}/bin/python", "-m", module, *rdzv, "--nproc-per-node", str(nproc)]
