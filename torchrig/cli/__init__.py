"""The command line: Invoke's task collection (tasks.py) and the `torchrig` program over it
(program.py). The one layer of torchrig that imports Invoke."""
