"""torchrig progress lines: the one definition of the stdout lines a training script prints and
`invoke status`, `invoke logs` and `invoke demo` read. Python standard library only: it is
pushed with every payload release (next to train.py, so a script there can `import progress`),
and torchrig loads this same file on the operator's side and sends it along with the status
reader it runs on the nodes.

A line is a kind word, then key=value fields, then optional free text (the note):

    start rank=0 local_rank=0 host=gpu1 device=cuda:0 device_name="NVIDIA H100" world_size=16 ...
    resume step=200 epoch=0 ckpt=/ckpt/ckpt_00000200.pt
    step=40 loss=2.3456 lr=3.00e-04 tok/s=12345 ... epoch=0
    eval step=300 val_loss=1.4567 windows=640 tokens=655360
    done step=300 loss=1.2345 ckpt=/ckpt/ckpt_00000300.pt
    signal SIGTERM received: stopping after step 41
    world step=200 world_size=2 nodes=1 global_batch=32 micro_batch=4 grad_accum=4 from=4

Kinds in KEYED (step, batch_size) have no kind word: the kind is the first field's key. A value
with a space, a quote, a backslash or a control character, or an empty one, is written as a
JSON string ("..."); every other value is written as is. A note starts at the first word that
is not a field. A launcher's "[tag]:" prefix before the kind is skipped when parsing.

A script of your own writes them with the small writers at the end (rank 0 only, by default:
torchrun's RANK; one flushed write per line):

    import progress
    progress.step(step, loss=loss.item(), **{"tok/s": rate})   # -> step=10 loss=2.306 tok/s=5120
    progress.done(step, loss=loss.item())                      # -> done step=100 loss=1.92
"""

import json
import os
import re
import socket
import sys

# kind -> what the line says; the ones `status` shows as a job's progress are PROGRESS
KINDS = {
    "start": "every rank, first: rank, local_rank, host, device, world_size, backend, pid",
    "config": "rank 0: the run's settings",
    "resume": "rank 0: step, epoch, ckpt the run continues from",
    "step": "rank 0, every --log-every steps: step, loss, lr, throughput, memory, epoch",
    "ckpt": "rank 0: step, path, write_s of a checkpoint written",
    "eval": "rank 0, on a token folder: step, val_loss (mean per token over every rank's "
            "val.bin windows), windows, tokens of an evaluation",
    "signal": "rank 0: a stop was requested (note: which, and the step)",
    "world": "rank 0, at every (re)start: step (the global step the run starts from), "
             "world_size, nodes, global_batch, micro_batch, grad_accum; from= the world size "
             "of the checkpoint resumed from, only when it differs",
    "done": "rank 0, last: step, loss, ckpt",
    "param_hash": "every rank, --dump-param-hash: rank, step, sha256",
    "batch_size": "rank 0, --find-batch-size: the batch size found",
}
KEYED = ("step", "batch_size")
PROGRESS = ("step", "done")

_PREFIX = re.compile(r"\[[^\]]*\]:?\s*")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_/.]*\Z")
_FIELD = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_/.]*)=("(?:[^"\\]|\\.)*"|[^\s"]*)(?=\s|$)')
_DIGITS = re.compile(r"[0-9]+\Z")
_BARE = re.compile(r'[^\s"\\\x00-\x1f\x7f]+\Z')


class Line(tuple):
    """A parsed line: kind, fields {key: text}, note (the free text after the fields, or "")."""
    __slots__ = ()

    def __new__(cls, kind, fields, note=""):
        return tuple.__new__(cls, (kind, fields, note))

    kind = property(lambda self: self[0])
    fields = property(lambda self: self[1])
    note = property(lambda self: self[2])

    def __repr__(self):
        return "Line(kind=%r, fields=%r, note=%r)" % self


def _value(v) -> str:
    v = str(v)
    return v if _BARE.match(v) else json.dumps(v)


def format_line(kind: str, fields=None, note: str = "") -> str:
    """The line for `kind` with `fields` (a dict, in order; values are str()'d) and `note`.
    ValueError for a line that would not parse back to the same kind, fields and note."""
    fields = dict(fields or {})
    if kind not in KINDS:
        raise ValueError("unknown progress kind %r" % (kind,))
    bad = [k for k in fields if not _KEY.match(k)]
    if bad:
        raise ValueError("bad field name(s) %r" % (bad,))
    if kind in KEYED and next(iter(fields), None) != kind:
        raise ValueError("a %s line starts with its %s= field" % (kind, kind))
    note = note.strip()
    if "\n" in note or "\r" in note or (note and _FIELD.match(note)):
        raise ValueError("a note is one line and does not start with key=value: %r" % (note,))
    words = [] if kind in KEYED else [kind]
    words += ["%s=%s" % (k, _value(v)) for k, v in fields.items()]
    return " ".join(words + ([note] if note else []))


def parse(text: str, kinds=None):
    """The Line `text` is, or None when it is no progress line (of one of `kinds`, when given)."""
    text = text.rstrip("\r\n")
    if text.startswith("["):
        m = _PREFIX.match(text)
        if m:
            text = text[m.end():]
    head = text.split(None, 1)[0] if text.strip() else ""
    kind = head.split("=", 1)[0] if "=" in head else head
    if kind not in KINDS or (kind in KEYED) != ("=" in head) or (kinds and kind not in kinds):
        return None
    pos = 0 if kind in KEYED else len(kind)
    fields = {}
    while True:
        m = _FIELD.match(text, pos)
        if not m:
            break
        k, v = m.groups()
        if v.startswith('"'):
            try:
                v = json.loads(v)
            except ValueError:
                break
        fields[k] = v
        pos = m.end()
    if kind in KEYED and kind not in fields:
        return None
    return Line(kind, fields, text[pos:].strip())


def start_ranks(text: str):
    """(global rank, local rank) from a `start` line, or None."""
    p = parse(text, ("start",))
    got = p and (p.fields.get("rank", ""), p.fields.get("local_rank", ""))
    # ASCII digits only: int() also takes other scripts' digits
    return (int(got[0]), int(got[1])) if got and all(map(_DIGITS.match, got)) else None


def is_progress(text: str) -> bool:
    """Whether `text` is a line `status` shows as a job's progress: a step or done line."""
    p = parse(text, PROGRESS)
    return p is not None and "step" in p.fields


def write(kind: str, fields=None, note: str = "", all_ranks: bool = False, file=None) -> str:
    """Print the line for `kind` (format_line) to stdout (or `file`) in one write and flush it,
    on rank 0 only (torchrun's RANK; no RANK: a single process) unless `all_ranks`. Returns the
    line (also where it was not printed). Unbuffered: torchrun's log files and the journal see
    the line when it is printed, not when an 8 KiB buffer fills."""
    text = format_line(kind, fields, note)
    if all_ranks or os.environ.get("RANK", "0") == "0":
        out = file or sys.stdout
        out.write(text + "\n")  # one write: ranks share torchrun's stdout
        out.flush()
    return text


def _ordered(first: str, value, fields: dict) -> dict:
    return {first: value, **{k: v for k, v in fields.items() if v is not None}}


def _number(v):
    """A float as a short string (4 significant digits: 2.346, 0.0003; from 1000 on, no
    decimals: 51200), anything else as is."""
    if not isinstance(v, float):
        return v
    return "%.0f" % v if abs(v) >= 1000 and v == v and abs(v) != float("inf") else "%.4g" % v


def step(step, all_ranks: bool = False, file=None, **fields) -> str:
    """A step line `status`, `metrics` and `report` read: step=N then the fields given, in
    order (loss=..., lr=..., and names that are no Python keywords through a dict:
    **{"tok/s": 5120}); a None field is left out, a float is written with 4 significant
    digits. Rank 0 only unless `all_ranks` (see write())."""
    fields = {k: _number(v) for k, v in _ordered("step", int(step), fields).items()}
    return write("step", fields, all_ranks=all_ranks, file=file)


def done(step, all_ranks: bool = False, file=None, **fields) -> str:
    """The run's last line: done step=N and the fields given (loss=...), as step() writes them."""
    fields = {k: _number(v) for k, v in _ordered("step", int(step), fields).items()}
    return write("done", fields, all_ranks=all_ranks, file=file)


WORLD_FIELDS = ("step", "world_size", "nodes", "global_batch", "micro_batch", "grad_accum")


def world(step, world_size, nodes, global_batch, micro_batch, grad_accum, previous=None,
          file=None) -> str:
    """The line every (re)start prints (rank 0): the global step it starts from and the world
    it runs in; previous: the world size of the checkpoint resumed from, written as from=N
    only when it differs from world_size (a resize)."""
    fields = dict(zip(WORLD_FIELDS, map(int, (step, world_size, nodes, global_batch,
                                             micro_batch, grad_accum))))
    if previous is not None and int(previous) != int(world_size):
        fields["from"] = int(previous)
    return write("world", fields, file=file)


def parse_world(text: str):
    """A world line's numbers {step, world_size, nodes, global_batch, micro_batch, grad_accum
    and from when given} as ints, or None when `text` is no complete world line."""
    p = parse(text, ("world",))
    if p is None:
        return None
    keys = WORLD_FIELDS + (("from",) if "from" in p.fields else ())
    got = [p.fields.get(k, "") for k in keys]
    if not all(map(_DIGITS.match, got)):
        return None
    return dict(zip(keys, map(int, got)))


def start(file=None, **fields) -> str:
    """Every rank's first line: rank, local_rank and world_size from torchrun's environment,
    host and pid, then the fields given (device=..., backend=...). With it, `status` and
    `report` know each rank's global rank and count a restarted run's attempts."""
    env = os.environ.get
    base = {"rank": env("RANK", "0"), "local_rank": env("LOCAL_RANK", "0"),
            "host": socket.gethostname(), "world_size": env("WORLD_SIZE", "1"), "pid": os.getpid()}
    base.update({k: v for k, v in fields.items() if v is not None})
    return write("start", base, all_ranks=True, file=file)
