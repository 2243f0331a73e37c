"""Pure parsers for GPU host facts.

Every module here is text in, data out: no I/O, no subprocess. Each module
exposes the command to run (a constant or a function returning an argv list)
and a pure ``parse(text)``; running the command is the caller's business.
"""
