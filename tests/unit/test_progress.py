"""The progress-line protocol (payload/progress.py): what train.py writes is what status, logs
and demo read back, and the module stays importable without torch."""

from __future__ import annotations

import io
import random
import subprocess
import sys
from pathlib import Path

import pytest

from torchrig import progress

REPO = Path(__file__).resolve().parents[2]


def _values(rng):
    alphabet = "ab/:.-_=\"\\ \t\x01é0123456789()"
    yield ""
    yield "two words"
    yield 'say "hi"'
    yield "C:\\dir"
    yield "ünïcode"
    for _ in range(300):
        yield "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))


@pytest.mark.parametrize("kind", sorted(progress.protocol.KINDS))
def test_every_kind_round_trips_with_any_value(kind):
    rng = random.Random(kind)
    for v in _values(rng):
        fields = {kind: "7"} if kind in progress.protocol.KEYED else {}
        fields.update({"path": v, "tok/s": "12", "x.y": v})
        note = rng.choice(["", "(nothing to train: past the last step)", "SIGTERM received: 5"])
        text = progress.format_line(kind, fields, note)
        assert "\n" not in text
        assert progress.parse(text) == (kind, fields, note), text
        assert progress.parse(f"[default0]: {text}") == (kind, fields, note)


def test_the_lines_train_writes_parse_as_documented():
    p = progress.parse('start rank=3 local_rank=1 host=gpu2 device=cuda:1 device_name="NVIDIA H100 '
                       '80GB HBM3" world_size=16 backend=nccl pid=42')
    assert p.kind == "start" and p.fields["device_name"] == "NVIDIA H100 80GB HBM3"
    assert p.fields["world_size"] == "16" and p.note == ""
    assert progress.start_ranks(p and 'start rank=3 local_rank=1 host=h') == (3, 1)
    step = progress.parse("step=40 loss=2.3456 lr=3.00e-04 tok/s=12345 samples/s=12.3 mfu=n/a "
                          "rss=0.50GiB epoch=0")
    assert step.kind == "step" and step.fields["tok/s"] == "12345" and step.fields["step"] == "40"
    done = progress.parse("done step=7 ckpt=None (nothing to train: the checkpoint is at or past "
                          "the last step)")
    assert done.fields == {"step": "7", "ckpt": "None"} and done.note.startswith("(nothing")
    assert progress.parse("signal SIGTERM received: stopping after step 5") == (
        "signal", {}, "SIGTERM received: stopping after step 5")
    ev = progress.parse("[default0]: eval step=400 val_loss=3.2101 windows=640 tokens=40960")
    assert ev == ("eval", {"step": "400", "val_loss": "3.2101", "windows": "640",
                           "tokens": "40960"}, "")
    assert not progress.is_progress("eval step=400 val_loss=3.2")  # status shows step lines


@pytest.mark.parametrize("text", [
    "", "hello", "started rank=0", "stepping=3", "step 3", "done", "start=1 rank=0",
    "probe batch_size=4 ok", "WARNING: skipping unreadable checkpoint x", "[rank0]: Traceback",
])
def test_other_lines_are_not_progress(text):
    assert not progress.is_progress(text)
    assert progress.start_ranks(text) is None


def test_status_progress_and_start_ranks():
    assert progress.is_progress("step=7 loss=1.0")
    assert progress.is_progress("done step=30 loss=1.2 ckpt=none")
    assert not progress.is_progress("done with it")  # a done line names its step
    assert progress.start_ranks("start rank=0 local_rank=0") == (0, 0)
    assert progress.start_ranks("[x]: start rank=12 local_rank=3 host=h") == (12, 3)
    assert progress.start_ranks("start rank=²  local_rank=0") is None
    assert progress.start_ranks("start rank=\u0663 local_rank=0") is None  # Arabic-Indic 3
    assert progress.start_ranks("start local_rank=0") is None


@pytest.mark.parametrize("kind, fields, note", [
    ("nope", {}, ""),                   # unknown kind
    ("step", {"loss": "1"}, ""),        # a keyed line starts with its own field
    ("done", {"bad key": "1"}, ""),
    ("done", {"step": "1"}, "a=b then text"),   # would parse back as a field
    ("done", {"step": "1"}, "two\nlines"),
])
def test_lines_that_would_not_parse_back_are_refused(kind, fields, note):
    with pytest.raises(ValueError):
        progress.format_line(kind, fields, note)


def test_the_module_is_stdlib_only_and_pushed_with_the_payload():
    """Importable in an isolated interpreter with torch made unimportable, and a payload file
    (push sends every file under payload/)."""
    from torchrig.launch.tree import payload_tree
    assert "progress.py" in payload_tree(REPO / "payload").manifest()
    code = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, sys.argv[1]); "
            "import progress; print(progress.format_line('done', {'step': 1}))")
    r = subprocess.run([sys.executable, "-I", "-c", code, str(REPO / "payload")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "done step=1\n", r.stderr


def _imports(path: Path) -> set[str]:
    import ast
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_payload_files_import_only_each_other_stdlib_and_torch():
    """launch pushes payload/ whole, so train.py's modules travel together; verify sends
    allreduce_bench.py alone, so it imports no payload module; progress.py needs nothing;
    prepare_data.py runs where torch may not be (a laptop): the standard library, the token
    format, and `tokenizers` only for --bpe/--tokenizer; ce_kernel.py `triton` (CUDA builds of
    torch bring it; model.py imports ce_kernel only for --ce-kernel triton)."""
    payload = REPO / "payload"
    local = {p.stem for p in payload.glob("*.py")}
    allowed = set(sys.stdlib_module_names) | {"torch"} | local
    for p in payload.glob("*.py"):
        extra = {"prepare_data.py": {"tokenizers"}, "ce_kernel.py": {"triton"}}.get(p.name, set())
        assert _imports(p) <= allowed | extra, (p.name, _imports(p) - allowed)
    assert not _imports(payload / "allreduce_bench.py") & local
    assert _imports(payload / "progress.py") <= set(sys.stdlib_module_names)
    stdlib = set(sys.stdlib_module_names)
    assert _imports(payload / "prepare_data.py") <= stdlib | {"token_format", "tokenizers"}
    assert _imports(payload / "token_format.py") <= stdlib
    assert {"model", "runtime", "progress"} <= _imports(payload / "train.py") | _imports(
        payload / "runtime.py")


def test_demo_summary_from_rank_0_lines():
    lines = ["start rank=0 local_rank=0 host=h", "config preset=tiny (lr 0.01 x 8/32)",
             "step=10 loss=5.5000 lr=1e-3 tok/s=100 epoch=0", "step=20 loss=3.0 tok/s=300",
             "step=30 loss=2.0 tok/s=200", "step=40 loss=1.5 tok/s=oops",
             'done step=40 loss=1.5000 ckpt="/c k/ckpt_00000040.pt"']
    assert progress.run_summary(lines) == {"steps": "40", "first_loss": "5.5000",
                                           "last_loss": "1.5000", "ckpt": "/c k/ckpt_00000040.pt",
                                           "median_tok_s": 300.0}
    assert progress.run_summary(lines[:-1]) is None  # the job did not finish
    assert progress.run_summary(["done step=3 ckpt=x (nothing to train: past the end)"])[
        "median_tok_s"] is None


class _Out:
    """A stream that records each write() and flush() (one write per line: ranks share a file)."""

    def __init__(self):
        self.calls = []

    def write(self, s):
        self.calls.append(("write", s))

    def flush(self):
        self.calls.append(("flush",))


def test_a_user_scripts_step_and_done_lines_are_what_status_reads(monkeypatch):
    """progress.step()/done(): the two lines a script of one's own writes; one flushed write
    each, on rank 0 only, and they parse back as status, metrics and report read them."""
    p = progress.protocol
    monkeypatch.setenv("RANK", "0")
    out = _Out()
    line = p.step(10, loss=2.30567, lr=3e-4, epoch=None, **{"tok/s": 51200.7})
    assert line == "step=10 loss=2.306 lr=0.0003 tok/s=51201"
    p.step(11, file=out, loss=1.5)
    assert out.calls == [("write", "step=11 loss=1.5\n"), ("flush",)]
    assert progress.is_progress(line) and progress.parse(line).fields["tok/s"] == "51201"
    done = p.done(3, file=out, loss=float("nan"), note_free="ok")
    assert done == "done step=3 loss=nan note_free=ok" and progress.is_progress(done)
    monkeypatch.setenv("RANK", "1")
    out = _Out()
    assert p.step(4, file=out, loss=1.0) == "step=4 loss=1" and out.calls == []
    p.step(4, file=out, all_ranks=True)
    assert out.calls == [("write", "step=4\n"), ("flush",)]


def test_a_user_scripts_start_line_names_its_ranks(monkeypatch):
    p = progress.protocol
    for k, v in {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(k, v)
    out = _Out()
    line = p.start(file=out, backend="gloo")
    assert progress.start_ranks(line) == (5, 1)  # every rank writes its start line
    assert out.calls[0] == ("write", line + "\n")
    assert progress.parse(line).fields["world_size"] == "8"
    assert progress.parse(line).fields["backend"] == "gloo"


def test_the_writers_refuse_what_would_not_parse_back(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError):
        progress.protocol.step(1, file=_Out(), **{"bad key": 1})
    with pytest.raises(ValueError):
        progress.protocol.step("x")  # a step is a whole number


def test_the_writer_works_from_a_plain_script_with_the_payload_on_its_path(tmp_path):
    """docs/payload.md's two lines, in a script outside payload/ (a user's project): PYTHONPATH
    names payload/ as launch's release layout does, and the line is on stdout at once."""
    script = tmp_path / "train.py"
    script.write_text("import progress\nprogress.step(3, loss=0.25)\nprogress.done(3)\n")
    env = {"PYTHONPATH": str(REPO / "payload"), "RANK": "0", "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["step=3 loss=0.25", "done step=3"]


def test_world_line_format_is_the_published_contract():
    """The launch side's status and logs read this exact text: a change here breaks them."""
    line = progress.protocol.world(12, 2, 1, 32, 4, 4, previous=4, file=io.StringIO())
    assert line == "world step=12 world_size=2 nodes=1 global_batch=32 micro_batch=4 grad_accum=4 from=4"
    assert progress.parse_world(line) == {"step": 12, "world_size": 2, "nodes": 1,
                                          "global_batch": 32, "micro_batch": 4, "grad_accum": 4,
                                          "from": 4}
    same = progress.protocol.world(0, 4, 2, 32, 4, 2, previous=4, file=io.StringIO())
    assert same == "world step=0 world_size=4 nodes=2 global_batch=32 micro_batch=4 grad_accum=2"
    assert "from" not in progress.parse_world("[default0]: " + same)
    assert progress.parse_world("world step=1 world_size=2") is None  # incomplete
    assert progress.parse_world(same.replace("nodes=2", "nodes=x")) is None
    assert progress.parse_world("step=3 loss=1") is None
    assert not progress.is_progress(same)
