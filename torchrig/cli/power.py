"""power: out-of-band power control through each host's BMC (inventory `bmc:`)."""

from __future__ import annotations

import json

from invoke import Exit

from .common import HOST_HELP, INVENTORY_HELP, _inventory, _parallel, _redactor, _say, task, \
    user_errors


@task(help={"action": "status (read only), on, off or cycle (these three need --yes)",
            "inventory": INVENTORY_HELP, "host": HOST_HELP,
            "yes": "switch the power (on, off, cycle): without it they are refused",
            "json": "print each host's outcome as JSON"})
@user_errors
def power(c, action, inventory=None, host=None, yes=False, json_=False):
    """Read or switch hosts' power through their BMCs (IPMI), from this machine."""
    from torchrig.power import plan, run
    plan.check_action(action)
    inv = _inventory(c, inventory)
    targets = plan.plan(inv.select(host), action, inv.path)
    plan.refuse_without_yes(targets, yes)
    red = _redactor(inv)  # the BMC passwords included, as every output's
    results = run.power(targets, _parallel(c))
    if json_:
        print(json.dumps(red.data([
            {"host": t.host, "bmc": t.bmc.address, "protocol": t.bmc.protocol, "action": action,
             "ok": r.ok, ("power" if action == "status" else "result"): r.value,
             "error": r.error} for t, r in zip(targets, results)]), indent=2))
    else:
        for t, r in zip(targets, results):
            if r.ok:
                _say(red.text(f"{t.where}: {r.value}"))
    failed = [f"error: {t.where}: {r.error}" for t, r in zip(targets, results) if not r.ok]
    if failed:
        raise Exit(red.text("\n".join(failed)), code=1)
