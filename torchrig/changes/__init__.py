"""What torchrig may change on a host, shared by provision and launch (neither imports the
other): the change types (model.py: Cmd, FileChange), every managed file declared once
(managed.py) and the planners' view of a host's facts with the plan's fingerprint
(factview.py)."""
