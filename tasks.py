"""`invoke <task>` in a checkout: torchrig's task collection, defined in torchrig/cli/tasks.py
(shipped in the wheel, where the `torchrig` command reads it) and re-exported here."""

from torchrig.cli.tasks import ns  # noqa: F401
