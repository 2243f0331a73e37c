"""torchrig's layers, lowest first, declared once (data only; nothing imports this at run time).

A unit is a top-level module (`errors`: torchrig/errors.py) or a subpackage with everything
under it (`facts`: torchrig/facts/); `__init__` is torchrig/__init__.py. A unit may import
units of its own layer and of lower layers, never of a higher one, and no chain of imports
may lead from a unit back to itself. tests/unit/test_import_graph.py checks both over every
import statement of every file (inside functions too, where imports wait to keep `--list`
fast), and names any unit missing from this table: a new module or subpackage goes into one.
"""

from __future__ import annotations

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # what every part uses: errors, settings and the inventory, quoting, host keys, the
    # connections (SSH and local) and the fleet session,
    # templates and the scripts that run on a host (onhost/), the redactor, the terminal
    # sanitiser, torchrun's command line, a job's names and layout, shipped files (and this
    # table)
    ("base", ("__init__", "layers", "errors", "resources", "terminal", "localfiles", "settings",
              "secrets", "render", "torchrun", "job", "progress", "forward", "inventory",
              "quoting", "hostkeys", "connections", "onhost", "session")),
    # what a host is: each fact's command and its pure parser
    ("facts", ("facts",)),
    # what may change on a host: the change types, the managed files, the planners' view of
    # the facts (provision and launch both use them; neither imports the other)
    ("changes", ("changes",)),
    # one domain each, each a task's library: provision, verify, logs, metrics, exec, the
    # testbed, status's trend, datasets (data.push/pull/ls/rm)
    ("domains", ("provision", "verify", "logs", "metrics", "execute", "testbed", "trend",
                 "datasets", "power")),
    # a job: launch, status and stop use verify's version gate and logs' diagnosis
    ("jobs", ("launch",)),
    # what reads jobs and verify's records back: fetch, the job report, the terminal tables
    ("reports", ("fetch", "jobreport", "tables")),
    # the command line, the one layer that imports Invoke's task machinery: nothing imports it
    ("cli", ("cli",)),
)
