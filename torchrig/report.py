"""Human-readable output: rich tables, printed at the edge (tasks call these)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .inventory import Host, Inventory
from .remote import Result
from .secrets import redact

console = Console(highlight=False)


def hosts_table(inv: Inventory, hosts: list[Host]) -> None:
    t = Table(title=f"{inv.path}  (known_hosts: {inv.known_hosts})")
    for col in ("host", "connection", "address", "port", "user", "jump", "gpus", "groups", "vars"):
        t.add_column(col)
    for h in hosts:
        t.add_row(h.name, h.connection, h.address, str(h.port or 22), h.user or "(ssh default)",
                  h.jump or "", "" if h.gpus is None else str(h.gpus), ",".join(h.groups),
                  ", ".join(f"{k}={v}" for k, v in redact(h.vars).items()))
    console.print(t)


def exec_summary(results: list[Result]) -> list[str]:
    """Print the per-host exit table; return 'host: why' for every host that failed."""
    t = Table(title="exec summary")
    for col in ("host", "status", "exit", "seconds", "error"):
        t.add_column(col)
    bad = []
    for r in results:
        code = r.value.code if r.ok else None
        ok = r.ok and code == 0
        t.add_row(r.host, "[green]ok[/]" if ok else "[red]FAILED[/]",
                  "" if code is None else str(code), f"{r.seconds:.1f}", r.error or "")
        if not ok:
            bad.append(f"{r.host}: " + (r.error or f"exit status {code}"))
    console.print(t)
    return bad


def testbed_table(st: dict) -> None:
    if not st["up"]:
        console.print("testbed is down")
        return
    t = Table(title=f"testbed (TESTBED SIMULATION) serving {st['server']}"
                    f"{'' if st['serving'] else ' [red](server not running)[/]'}")
    for col in ("host", "address", "profile", "running", "ssh", "mounted"):
        t.add_column(col)
    yn = {True: "[green]yes[/]", False: "[red]no[/]"}
    for name, h in st["hosts"].items():
        t.add_row(name, h["ip"], h["profile"], yn[h["running"]], yn[h["ssh"]], yn[h["mounted"]])
    console.print(t)
    console.print(f"inventory: {st['inventory']}")
