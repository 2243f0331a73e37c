"""Every file torchrig manages on a host, declared once: its template (under templates/,
mirroring the target path; JOB stands for a job's name), mode, owner and whether it holds
secrets. provision's planners (which name the files they read: steps.Step.reads, whence the
fact request; a test checks every file here is read back) and launch's install derive from
these tables."""

from __future__ import annotations

from dataclasses import dataclass

from ..facts.os_release import DISTROS
from ..render import render
from .model import FileChange, file_change


@dataclass(frozen=True)
class ManagedFile:
    template: str          # under templates/; the target path is "/" + this, less ".j2"
    mode: int = 0o644
    owner: str = "root"
    secret: bool = False   # read back as a hash only; never shown in a plan or diff

    def path(self, job: str = "") -> str:
        return "/" + self.template.removesuffix(".j2").replace("JOB", job)

    def render(self, **values) -> str:
        return render(self.template, **values)

    def change(self, facts, content: str | None = None, job: str = "", shown: str | None = None,
               **values) -> list[FileChange]:
        """[] when the host's file (facts.file) already matches, else the one write; with
        facts None, the write whatever is there. The body is this file's template rendered
        with `values` (or `content`, already rendered)."""
        body = self.render(**values) if content is None else content
        path = self.path(job)
        cur = None if facts is None else facts.file(path)
        return file_change(cur, path, body, mode=self.mode, owner=self.owner,
                           group=self.owner, secret=self.secret, shown=shown)


# --- provision --------------------------------------------------------------------------------
CUDA_SOURCES = ManagedFile("etc/apt/sources.list.d/torchrig-cuda.sources.j2")
CUDA_AUTH = ManagedFile("etc/apt/auth.conf.d/90-torchrig-cuda.conf.j2", mode=0o600, secret=True)
NOUVEAU_BLACKLIST = ManagedFile("etc/modprobe.d/blacklist-nouveau.conf.j2")
UNATTENDED_HOLD = ManagedFile("etc/apt/apt.conf.d/51torchrig-nvidia-hold.j2")
DRIVER_PIN = ManagedFile("etc/apt/preferences.d/torchrig-nvidia-driver.pref.j2")
CUDA_ENV = ManagedFile("etc/torchrig/cuda.env.j2")
NODE_EXPORTER_ARGS = ManagedFile("etc/default/prometheus-node-exporter.j2")
# Slurm (inventory `slurm:`): one munge key shared by the cluster (munge reads it as munge,
# refuses a key others can read), and Slurm's configs, the same on every host.
MUNGE_KEY = ManagedFile("etc/munge/munge.key.j2", mode=0o400, owner="munge", secret=True)
SLURM_CONF = ManagedFile("etc/slurm/slurm.conf.j2")
GRES_CONF = ManagedFile("etc/slurm/gres.conf.j2")
CGROUP_CONF = ManagedFile("etc/slurm/cgroup.conf.j2")
SLURM_FILES = (MUNGE_KEY, SLURM_CONF, GRES_CONF, CGROUP_CONF)
# the job ports' firewall (provision/firewall.py): torchrig's nftables table and its unit
FIREWALL_RULES = ManagedFile("etc/torchrig/firewall.nft.j2")
FIREWALL_UNIT = ManagedFile("etc/systemd/system/torchrig.firewall.service.j2")
PROVISION_FILES = (CUDA_SOURCES, CUDA_AUTH, NOUVEAU_BLACKLIST, UNATTENDED_HOLD, DRIVER_PIN,
                   CUDA_ENV, NODE_EXPORTER_ARGS, *SLURM_FILES, FIREWALL_RULES, FIREWALL_UNIT)

# Files that must not exist: cuda-keyring's own one-line source duplicates ours (apt then
# warns or refuses). One per distro and repo arch it may have been installed for.
REPO_ARCHES = ("x86_64", "sbsa")


def keyring_list(distro: str, arch: str) -> str:
    return f"/etc/apt/sources.list.d/cuda-{distro}-{arch}.list"


PROVISION_ABSENT = tuple(keyring_list(d, a) for d in sorted(DISTROS) for a in REPO_ARCHES)


def absent(facts, path: str) -> list[FileChange]:
    """[] when the file is not on the host, else its removal (facts.file refuses a path
    that is not declared above)."""
    return [FileChange(path, None)] if facts.file(path) else []


# --- launch (per job) -------------------------------------------------------------------------
JOB_ENV = ManagedFile("etc/torchrig/jobs/JOB.env.j2", mode=0o600, secret=True)
# the rendezvous run id (random per launch): root's 0600, read by systemd into the job's env
JOB_RUN_ID = ManagedFile("etc/torchrig/jobs/JOB.run.j2", mode=0o600, secret=True)
JOB_UNIT = ManagedFile("etc/systemd/system/torchrig-JOB.service.j2")
GPUMON_SERVICE = ManagedFile("etc/systemd/system/torchrig-gpumon@JOB.service.j2")
GPUMON_TIMER = ManagedFile("etc/systemd/system/torchrig-gpumon@JOB.timer.j2")
# started once the job ended: its last sample; it keeps the job's unit (and its times) loaded
JOB_ENDED = ManagedFile("etc/systemd/system/torchrig-ended@JOB.service.j2")
# root's GPU health watch while the job runs (payload/healthwatch.py)
HEALTH_SERVICE = ManagedFile("etc/systemd/system/torchrig-health@JOB.service.j2")
HEALTH_TIMER = ManagedFile("etc/systemd/system/torchrig-health@JOB.timer.j2")
LAUNCH_FILES = (JOB_ENV, JOB_RUN_ID, JOB_UNIT, GPUMON_SERVICE, GPUMON_TIMER, JOB_ENDED,
                HEALTH_SERVICE, HEALTH_TIMER)


def launch_request(job: str) -> dict[str, list[str]]:
    return {"files": [f.path(job) for f in LAUNCH_FILES if not f.secret],
            "secret_files": [f.path(job) for f in LAUNCH_FILES if f.secret]}
