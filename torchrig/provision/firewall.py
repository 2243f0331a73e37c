"""The job ports' firewall: torchrig's own nftables table (`table inet torchrig`), rendered
whole from templates/etc/torchrig/firewall.nft.j2 and loaded atomically by
torchrig.firewall.service (`nft -f`, at boot too). The operator's own tables are never touched.

The job ports are the rendezvous ports (rdzv_port and the RDZV_PORTS above it, one per job)
and the kernel's ephemeral range (net.ipv4.ip_local_port_range, read from the host), where
gloo's and NCCL's sockets listen. New connections to them are accepted from the inventory's
hosts only; a rendezvous port is opened only by root, the service user and the login user
(matched on output by the socket's owner, so on every node of the fleet). torch's c10d store
has no authentication and unpickles what it is sent: see docs/security.md."""

from __future__ import annotations

import ipaddress
import re

from ..changes import managed
from ..changes.model import AptInstall, Cmd, FileChange
from ..errors import TorchrigError
from ..inventory import resolve
from ..facts.netfilter import TABLE, UNIT, loaded_argv, parse_ephemeral
from ..quoting import sh
from ..settings import RDZV_PORTS
from .slurm import USER as slurm_user

PACKAGE = "nftables"   # the distribution's package
USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


def fleet_addresses(inv) -> tuple[str, ...]:
    """Every inventory host's addresses (the fleet: all hosts of the inventory, whichever are
    provisioned now), for the hosts whose firewall is on."""
    if not any(h.settings.firewall for h in inv.hosts):
        return ()
    return tuple(sorted({ip for h in inv.hosts for ip in resolve(h.address, f"host {h.name}")},
                        key=lambda a: (ipaddress.ip_address(a).version, ipaddress.ip_address(a))))


def render_rules(c) -> str:
    s = c.s
    ips = [ipaddress.ip_address(a) for a in c.fleet]
    lo, hi = parse_ephemeral(c.facts["firewall"]["ephemeral"])
    # slurmctld (user slurm) calls srun back on an ephemeral port of the job's node
    slurm = [slurm_user] if c.cluster is not None and c.cluster.roles(c.host) else []
    owners = list(dict.fromkeys(["root", s.service_user, *([c.login] if c.login else []), *slurm]))
    for o in owners:  # nft resolves the names when it loads the table; no quoting there
        if not USER_RE.fullmatch(o):
            raise TorchrigError(f"host {c.host}: login user {o!r} is not a plain Linux user "
                                "name; the firewall cannot name it (set var firewall: false)")
    return managed.FIREWALL_RULES.render(
        rdzv=f"{s.rdzv_port}-{s.rdzv_port + RDZV_PORTS - 1}", ephemeral=f"{lo}-{hi}",
        fleet4=[str(a) for a in ips if a.version == 4], fleet6=[str(a) for a in ips if a.version == 6],
        keep=sorted({c.ssh_port, s.node_exporter_port}), owners=owners)


def plan(c) -> list[Cmd | FileChange]:
    """nftables installed, torchrig's rules and unit written, the table loaded; with var
    firewall false, whatever an earlier provision put there removed (table unloaded)."""
    loaded = c.facts["firewall"]["loaded"]
    unit_file = managed.FIREWALL_UNIT.path()
    if not c.s.firewall:
        out: list[Cmd | FileChange] = []
        if c.facts.unit(UNIT).get("enabled") == "enabled" or loaded:
            out.append(Cmd(f"stop and disable {UNIT} (var firewall: false)",
                           f"systemctl disable --now {sh(UNIT)} || true\n"
                           f"nft delete table {' '.join(TABLE)} 2>/dev/null || true"))
        out += managed.absent(c.facts, managed.FIREWALL_RULES.path())
        out += managed.absent(c.facts, unit_file)
        return out
    out = []
    if c.pkg(PACKAGE) is None:
        out.append(AptInstall(f"install {PACKAGE}", f"apt_get install --no-install-recommends {PACKAGE}",
                              (PACKAGE,)))
    rules = managed.FIREWALL_RULES.change(c.facts, content=render_rules(c))
    unit = managed.FIREWALL_UNIT.change(c.facts, rules=managed.FIREWALL_RULES.path())
    out += rules + unit
    state = c.facts.unit(UNIT)
    if unit or state.get("enabled") != "enabled":
        out.append(Cmd(f"enable {UNIT}", f"systemctl daemon-reload\nsystemctl enable {sh(UNIT)}"))
    if rules or unit or not loaded or state.get("active") != "active":
        why = "its rules changed" if rules or unit else "not loaded"
        out.append(Cmd(f"load torchrig's nftables table ({why})",
                       # nft's own message when the rules do not load (a unit's failure
                       # only says "see journalctl")
                       f"nft -c -f {sh(managed.FIREWALL_RULES.path())}\n"
                       f"systemctl restart {sh(UNIT)}\n{sh(*loaded_argv())} >/dev/null"))
    return out
