"""The peer in bench/provision_bench.py: pyinfra checking, on a host torchrig provisioned, the
state provision manages there (bench/peers/pyinfra_peer.py captures it per host into
`host.data.state`), as a pyinfra user would write it: pinned packages present and held, the
managed files (contents, mode, owner), the absent cuda-keyring source lists, the service
user and torchrig's directories, the units enabled and running, torch and the payload's
requirements in the venv, torchrig's nftables table loaded. On a converged host every
operation reports no change; the bench fails if one does not."""

from pyinfra import host
from pyinfra.facts.server import Command
from pyinfra.operations import apt, files, pip, server, systemd

st = host.data.state

apt.packages(name="pinned packages", packages=[f"{n}={v}" for n, v in st["packages"].items()])
held = set(host.get_fact(Command, "apt-mark showhold").split())
unheld = sorted(set(st["packages"]) - held)
if unheld:
    server.shell(name="hold the pinned packages", commands=["apt-mark hold " + " ".join(unheld)])

for f in st["files"]:
    files.put(name=f["path"], src=f["src"], dest=f["path"], user=f["owner"], group=f["group"],
              mode=f["mode"])
for path in st["absent"]:
    files.file(name=f"absent {path}", path=path, present=False)

server.user(name="service user", user=st["user"], group=st["user"], home=st["home"],
            shell="/usr/sbin/nologin", system=True, create_home=False,
            ensure_home=False)  # the prefix is root's (provision's dirs())
for d in st["dirs"]:
    files.directory(name=d["path"], path=d["path"], user=d["owner"], group=d["owner"],
                    mode=d["mode"])

for unit in st["units"]:
    systemd.service(name=unit, service=unit, running=True, enabled=True)

# torch by its dist-info: pyinfra's pip fact skips versions with a local part (2.13.0+cpu,
# +cu128), so pip.packages would run `pip install` on every run
torch = host.get_fact(Command, f"ls -d {st['venv']}/lib/python3*/site-packages/torch-*.dist-info")
if f"torch-{st['torch']}.dist-info" not in torch:
    pip.packages(name="torch", packages=[f"torch=={st['torch']}"], pip=st["venv"] + "/bin/pip")
pip.packages(name="the venv's packages", packages=st["pip"], pip=st["venv"] + "/bin/pip")

loaded = host.get_fact(Command, "nft list table inet torchrig >/dev/null 2>&1 && echo yes || true")
if loaded != "yes":
    server.shell(name="load torchrig's nftables table", commands=["nft -f /etc/torchrig/firewall.nft"])
