"""The command line: Invoke's task collection (tasks.py; the tasks in one module per domain
beside it, their shared prologue in common.py) and the `torchrig` program over it
(program.py). The one layer of torchrig that imports Invoke."""
