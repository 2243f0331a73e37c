"""Facts about a host: the probe and the pure parsers of what it returns.

probe_host.py is the one script that runs on a host (standard library only): it runs the
requested commands concurrently and reads files, returning raw text. Every other module here
is text in, data out: no I/O, no subprocess. A domain module names the command it needs
(a constant or a function returning an argv list) and parses its output; the *_facts and
job_state modules turn a task's needs into a probe request and the reply into its facts
(provision_facts: one declaration per fact, its request part and its parser, in FACTS).
"""
