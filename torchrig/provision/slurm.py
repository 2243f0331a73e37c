"""The Slurm cluster provision sets up (inventory `slurm:`), planned from every node's facts at
once (pure): slurm.conf and gres.conf (the same on every host, as Slurm requires), cgroup.conf,
and whether the cluster needs a new shared munge key. Each host's steps (steps.py) then
write these through the managed-file table and start or reconfigure only what changed."""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from ..changes import managed
from ..inventory import Slurm
from ..job import STOP_GRACE_S

STATE_DIR = "/var/lib/slurm/slurmctld"   # StateSaveLocation: slurmctld's, on the controller
SPOOL_DIR = "/var/lib/slurm/slurmd"      # SlurmdSpoolDir
LOG_DIR = "/var/log/slurm"
USER = "slurm"  # SlurmUser: the distributions' packages create it and run slurmctld as it
# What makes a GPU model a GRES type name: the marketing prefixes dropped, the first word,
# its first dash-part, lowercased ("Tesla V100S-PCIE-32GB" -> v100s, "NVIDIA H100 80GB" -> h100).
_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro", "rtx"}


def gpu_type(name: str) -> str:
    words = [w for w in name.split() if w.lower() not in _VENDOR_WORDS] or name.split() or ["gpu"]
    t = re.sub(r"[^a-z0-9_]", "", words[0].split("-")[0].lower())
    return t or "gpu"


def device_files(indices: list[int]) -> str:
    """/dev/nvidia[0-3] for a run of indices, /dev/nvidia[0,2] otherwise."""
    idx = sorted(indices)
    if len(idx) == 1:
        return f"/dev/nvidia{idx[0]}"
    if idx == list(range(idx[0], idx[-1] + 1)):
        return f"/dev/nvidia[{idx[0]}-{idx[-1]}]"
    return "/dev/nvidia[" + ",".join(map(str, idx)) + "]"


def smi_gpus(smi: dict) -> list[tuple[int, str]] | None:
    """(index, name) of each GPU from the nvidia_smi fact (index,name,driver_version), or None
    when nvidia-smi did not answer (no driver loaded yet)."""
    if smi.get("rc") != 0:
        return None
    out = []
    for line in smi.get("output", "").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            out.append((int(parts[0]), parts[1]))
    return out


@dataclass(frozen=True)
class Node:
    name: str
    hostname: str
    cpus: int
    sockets: int
    cores: int
    threads: int
    mem_mib: int
    gpus: tuple[dict, ...]       # [{"type", "count", "files"}] by model
    gres_mode: str               # nvml | files

    @property
    def gres(self) -> str:
        return ",".join(f"gpu:{g['type']}:{g['count']}" for g in self.gpus)


def node_of(name: str, node: dict, smi: dict) -> Node | str:
    """A compute node's description from its facts, or why it cannot be described yet."""
    cpu, mem = node.get("cpu"), node.get("mem_mib")
    if not cpu or not mem:
        return f"{name}: its CPU topology or memory could not be read (lscpu -J, /proc/meminfo)"
    gpus = smi_gpus(smi)
    if gpus is None:
        return (f"{name}: nvidia-smi does not answer yet (driver not loaded), so its GPUs "
                "cannot go into slurm.conf; rerun provision once the driver is loaded")
    by_type: dict[str, list[int]] = {}
    for idx, model in gpus:
        by_type.setdefault(gpu_type(model), []).append(idx)
    have = set(node.get("dev-nvidia") or [])
    files = all(f"/dev/nvidia{i}" in have for i, _ in gpus)
    mode = "nvml" if node.get("libnvidia-ml") and node.get("slurm-gpu-nvml") else "files"
    if mode == "files" and not files:
        # slurmd counts no GPU without its device file (a Count-only line registers 0)
        return (f"{name}: its GPU device files (/dev/nvidia0..) are missing while nvidia-smi "
                "answers; rerun provision once the driver has created them")
    return Node(name, (node.get("hostname") or name).split(".")[0], cpu["cpus"], cpu["sockets"],
                cpu["cores"], cpu["threads"], mem,
                tuple({"type": t, "count": len(ix), "files": device_files(ix)}
                      for t, ix in by_type.items()), mode)


@dataclass(frozen=True)
class Cluster:
    """What every host of the cluster gets. `missing`: hosts whose facts are missing (every
    Slurm step waits); `blocked`: why the configs wait (a node not describable yet);
    `munge_key`: a new shared key when the hosts do not share one yet (it lives in memory
    only and travels inside the root scripts, on stdin)."""

    spec: Slurm
    files: dict[str, str] = field(default_factory=dict)  # managed-file template -> contents
    munge_key: str | None = None
    missing: str | None = None
    blocked: str | None = None

    def roles(self, host: str) -> set[str]:
        return ({"controller"} if host == self.spec.controller else set()) | \
               ({"compute"} if host in self.spec.compute else set())


def plan_cluster(spec: Slurm, facts: dict[str, object], new_key: Callable[[], str] =
                 lambda: secrets.token_hex(128)) -> Cluster:
    """facts: host name -> its provision Facts (each cluster host; a missing one blocks)."""
    missing = [h for h in spec.hosts if h not in facts]
    if missing:
        why = f"no facts from {', '.join(missing)} (not selected, or its gather failed)"
        return Cluster(spec, missing=why, blocked=why)
    keys = {(facts[h].file(managed.MUNGE_KEY.path()) or {}).get("sha256") for h in spec.hosts}
    key = None if len(keys) == 1 and None not in keys else new_key()
    nodes = []
    for h in spec.compute:
        n = node_of(h, facts[h].node(), facts[h]["nvidia_smi"])
        if isinstance(n, str):
            return Cluster(spec, munge_key=key, blocked=n)
        nodes.append(n)
    controller = facts[spec.controller].node().get("hostname") or spec.controller
    values = dict(cluster_name=spec.cluster_name, controller_hostname=controller.split(".")[0],
                  slurm_user=USER,
                  state_dir=STATE_DIR, spool_dir=SPOOL_DIR, cgroup=spec.cgroup,
                  partition=spec.partition, nodes=nodes, kill_wait=_kill_wait(),
                  node_timeout=spec.node_timeout,
                  def_mem_per_cpu=min(n.mem_mib // n.cpus for n in nodes))
    files = {f.template: f.render(**values) for f in (managed.SLURM_CONF, managed.GRES_CONF)}
    if spec.cgroup:
        files[managed.CGROUP_CONF.template] = managed.CGROUP_CONF.render()
    return Cluster(spec, files, munge_key=key)


def _kill_wait() -> int:
    """scancel's SIGTERM-to-SIGKILL wait: as long as the systemd launcher gives a job to
    checkpoint (its units' TimeoutStopSec), so `stop` through Slurm checkpoints too."""
    return STOP_GRACE_S


def reconfigure_only(old: str | None, new: str) -> bool:
    """True when slurm.conf changes only in partition lines, which `scontrol reconfigure`
    applies; anything else (nodes, plugins, hosts) needs the daemons restarted."""
    if old is None:
        return False
    def rest(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if not ln.startswith("PartitionName=")]
    return rest(old) == rest(new)
