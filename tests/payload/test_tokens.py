"""Token folders: payload/prepare_data.py makes them (byte-level, a BPE it trains, a given
tokenizer.json), train.py trains on one named by TORCHRIG_DATA (what `torchrig launch --data`
sets), evaluates on val.bin, resumes the same window stream, and refuses a bad one in one line.
"""

from __future__ import annotations

import array
import json
import math
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import torch
from tokenizers import Tokenizer  # a test dependency (pyproject [test])

from test_train import DONE_RE, HASH_RE, REPO, TRAIN, _env, _fail_msg, run_torchrun, steps

sys.path.insert(0, str(TRAIN.parent))
import cli  # noqa: E402
import data  # noqa: E402
import prepare_data  # noqa: E402
import progress  # noqa: E402
import token_format  # noqa: E402

PREPARE = TRAIN.parent / "prepare_data.py"
EVAL_RE = re.compile(r"^eval step=(\d+) val_loss=(\S+) windows=(\d+) tokens=(\d+)$", re.M)
WORDS = ("the quick brown fox jumps over a lazy dog while the cat sleeps near the warm stove "
         "and a bird sings ünïcödé words too").split()


def write_text(path: Path, lines: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    text = "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "\n"
                   for _ in range(lines))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return text


def read_ids(path: Path, code: str = "H") -> list[int]:
    a = array.array(code)
    a.frombytes(path.read_bytes())
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def make_folder(d: Path, train, val, vocab: int, **meta) -> Path:
    """A token folder written by hand (not by prepare_data.py), for data.py's side."""
    dtype = token_format.dtype_for(vocab)
    d.mkdir(parents=True, exist_ok=True)
    for name, ids in (("train.bin", train), ("val.bin", val)):
        (d / name).write_bytes(array.array("H" if dtype == "uint16" else "I", ids).tobytes())
    (d / "meta.json").write_text(json.dumps({"vocab_size": vocab, "dtype": dtype, **meta}))
    return d


# ------------------------------------------------------------------ prepare_data.py


def test_prepare_bytes_splits_each_file_at_a_line_end(tmp_path, capsys):
    a = write_text(tmp_path / "corpus" / "a.txt", 300, seed=1)
    b = write_text(tmp_path / "corpus" / "sub" / "b.txt", 100, seed=2)
    (tmp_path / "corpus" / ".hidden").write_text("not text")
    out = tmp_path / "tokens"
    assert prepare_data.main([str(tmp_path / "corpus"), "--out", str(out)]) == 0
    assert "next: torchrig data.push" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == "bytes" and meta["files"] == 2 and meta["eot_id"] is None
    train, val = read_ids(out / "train.bin"), read_ids(out / "val.bin")
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    # each file in path order, its head in train.bin and its tail (about 5%) in val.bin
    whole = [t.encode() for t in (a, b)]
    cuts = [len(w) - int(len(w) * 0.05) for w in whole]
    ends = [w.index(b"\n", c - 1) + 1 for w, c in zip(whole, cuts)]
    assert bytes(train) == whole[0][:ends[0]] + whole[1][:ends[1]]
    assert bytes(val) == whole[0][ends[0]:] + whole[1][ends[1]:]
    assert 0.04 < len(val) / (len(train) + len(val)) < 0.07
    assert not (out / "tokenizer.json").exists() and not list(out.glob(".*part"))


def test_a_long_line_is_split_on_a_character_boundary(tmp_path):
    one_line = "é" * 50_000  # 100 kB, no line end
    (tmp_path / "one.txt").write_text(one_line, encoding="utf-8")
    out = tmp_path / "t"
    prepare_data.prepare([str(tmp_path / "one.txt")], str(out), val_fraction=0.1)
    train, val = bytes(read_ids(out / "train.bin")), bytes(read_ids(out / "val.bin"))
    assert train.decode() + val.decode() == one_line and len(val) == 10_000


def test_prepare_bpe_then_the_same_with_its_tokenizer(tmp_path):
    text = write_text(tmp_path / "c.txt", 400, seed=3)
    out = tmp_path / "bpe"
    meta = prepare_data.prepare([str(tmp_path / "c.txt")], str(out), bpe=300)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert meta["tokenizer"] == "tokenizer.json" and meta["dtype"] == "uint16"
    assert 256 < meta["vocab_size"] == tok.get_vocab_size() <= 300
    eot = meta["eot_id"]
    assert tok.id_to_token(eot) == "<|endoftext|>"
    train, val = read_ids(out / "train.bin"), read_ids(out / "val.bin")
    assert train[-1] == val[-1] == eot and eot not in train[:-1] + val[:-1]
    decoded = tok.decode(train[:-1]) + tok.decode(val[:-1])
    assert decoded == text  # byte-level BPE: nothing is lost
    assert len(train) < len(text.encode()) / 2  # merges were learned
    # an existing tokenizer.json gives the same ids
    again = tmp_path / "again"
    p = subprocess.run([sys.executable, str(PREPARE), str(tmp_path / "c.txt"), "--out", str(again),
                        "--tokenizer", str(out / "tokenizer.json")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert (again / "train.bin").read_bytes() == (out / "train.bin").read_bytes()
    assert json.loads((again / "meta.json").read_text()) == meta


@pytest.mark.parametrize("argv, needle", [
    (["missing.txt"], "missing.txt: no such file or folder"),
    (["tiny.txt"], "val.bin would be empty"),
    (["c.txt", "--tokenizer", "c.txt"], "not a readable tokenizer.json"),
])
def test_prepare_errors_are_one_line(tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.txt").write_text("hi\n")
    write_text(tmp_path / "c.txt", 20)
    assert prepare_data.main([*argv, "--out", "out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prepare_data.py: error: ") and needle in err and err.count("\n") == 1


# ------------------------------------------------------------------ data.py: windows


def test_windows_are_slices_of_the_file_drawn_from_the_key(tmp_path):
    n = 5000
    td = data.TokenData(str(make_folder(tmp_path / "d", range(n), range(n, 2 * n), 2 * n)), 16)
    w = td.windows("train", 8, "k", 1)
    assert w.dtype == torch.int64 and w.shape == (8, 17)
    assert bool(((w[:, 1:] - w[:, :-1]) == 1).all()) and int(w.max()) < n  # contiguous runs
    assert torch.equal(w, td.windows("train", 8, "k", 1))
    assert not torch.equal(w, td.windows("train", 8, "k", 2))
    assert int(td.windows("val", 8, "k", 1).min()) >= n
    x, y = td.batch("train", 8, "k", 1)
    assert torch.equal(x, w[:, :-1]) and torch.equal(y, w[:, 1:])


def test_uint32_ids_are_read_as_they_were_written(tmp_path):
    ids = [70_000 + i for i in range(300)]
    td = data.TokenData(str(make_folder(tmp_path / "d", ids, ids, 70_300)), 8)
    assert td.dtype == "uint32" and td.vocab_size == 70_300
    w = td.windows("train", 4, 0)
    assert int(w.min()) >= 70_000 and bool(((w[:, 1:] - w[:, :-1]) == 1).all())


def test_ranks_and_steps_draw_different_windows_and_resume_draws_the_same(tmp_path):
    td = data.TokenData(str(make_folder(tmp_path / "d", range(20_000), range(2000), 20_000)), 32)

    def stream(rank, from_step, n, world_size=2, grad_accum=2):
        it = data.TokenStream(td, seed=7, rank=rank, world_size=world_size, batch_size=4,
                              grad_accum=grad_accum).batches(from_step)
        return [next(it)[0] for _ in range(n)]

    r0, r1 = stream(0, 0, 10), stream(1, 0, 10)
    assert all(not torch.equal(a, b) for a, b in zip(r0, r1))  # ranks differ
    assert len({tuple(x[:, 0].tolist()) for x in r0}) == 10  # so do micro-batches and steps
    assert all(torch.equal(a, b) for a, b in zip(r0[6:], stream(0, 3, 4)))  # step 3 on: the same
    # the same global batch (16) on one rank: step 3 trains on the two ranks' windows
    one = torch.cat(stream(0, 3, 4, world_size=1, grad_accum=4))
    two = torch.cat(r0[6:8] + r1[6:8])
    assert sorted(map(tuple, one.tolist())) == sorted(map(tuple, two.tolist()))
    s = data.TokenStream(td, 7, 0, 2, 4, 2)
    assert s.samples == 19_999 // 32 and s.steps_per_epoch == s.samples // 16
    first, again = list(s.eval_batches(3)), list(s.eval_batches(3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again))  # the same val windows


def test_an_id_past_the_vocabulary_is_refused(tmp_path):
    """meta.json is read, the ids are not (the files may be large): a window that holds an id
    past vocab_size stops the run with the file's name."""
    ids = [5] * 50 + [9] + [5] * 49
    td = data.TokenData(str(make_folder(tmp_path / "d", ids, [1] * 100, 6)), 8)
    with pytest.raises(data.DataError, match=r"train\.bin: token id 9 is not below vocab_size 6"):
        for key in range(100):  # a draw of 64 windows that misses offset 50 is rare
            td.windows("train", 64, key)


# ------------------------------------------------------------------ a bad folder


def _bad_folders(d: Path) -> dict[str, tuple[Path, str]]:
    ok = dict(train=range(100), val=range(100), vocab=100)
    out = {}

    def case(name, needle, **kw):
        args = {**ok, **kw}
        meta = {k: v for k, v in args.items() if k not in ("train", "val", "vocab")}
        out[name] = (make_folder(d / name, args["train"], args["val"], args["vocab"], **meta),
                     needle)

    case("no_meta", "no meta.json (not a token folder")
    (d / "no_meta" / "meta.json").unlink()
    case("bad_json", "meta.json: not readable JSON")
    (d / "bad_json" / "meta.json").write_text("{vocab")
    case("bad_dtype", "dtype must be one of uint16, uint32, got 'int8'")
    (d / "bad_dtype" / "meta.json").write_text('{"vocab_size": 100, "dtype": "int8"}')
    case("no_vocab", "vocab_size must be a positive integer, got None")
    (d / "no_vocab" / "meta.json").write_text('{"dtype": "uint16"}')
    case("no_val", "val.bin: missing")
    (d / "no_val" / "val.bin").unlink()
    case("odd_size", "train.bin: 201 bytes is no whole number of uint16 tokens")
    with open(d / "odd_size" / "train.bin", "ab") as f:
        f.write(b"\0")
    case("stale_count", "train.bin: holds 100 tokens, meta.json says 120", train_tokens=120)
    case("too_small", "val.bin: 10 tokens, fewer than one window of 65", val=range(10))
    return out


def test_a_bad_folder_is_one_line_naming_what_where_and_what_to_do(tmp_path, monkeypatch,
                                                                   capsys):
    for name, (folder, needle) in _bad_folders(tmp_path).items():
        monkeypatch.setenv("TORCHRIG_DATA", str(folder))
        with pytest.raises(SystemExit) as e:
            cli.parse_args(["--device", "cpu"])
        err = capsys.readouterr().err
        assert e.value.code == 2, name
        assert err.startswith(f"train.py: error: TORCHRIG_DATA (--data): {folder}"), err
        assert needle in err and err.count("\n") == 1, (name, err)
        assert "prepare_data.py" in err or "--seq-len" in err, err  # what to do
    monkeypatch.delenv("TORCHRIG_DATA")
    with pytest.raises(SystemExit):
        cli.parse_args(["--data", str(tmp_path / "nowhere")])
    assert "train.py: error: --data: " in capsys.readouterr().err


def test_a_bad_folder_exits_2_without_a_traceback(tmp_path):
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "part0.txt").write_text("some text\n")
    p = subprocess.run([sys.executable, str(TRAIN), "--device", "cpu"], cwd=REPO,
                       env={**_env(), "TORCHRIG_DATA": str(tmp_path / "shards")},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "", _fail_msg(p)
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert "shards: no meta.json" in p.stderr and "prepare_data.py" in p.stderr


# ------------------------------------------------------------------ training on a token folder

ARGS = ["--deterministic", "--max-steps", 8, "--log-every", 1, "--seq-len", 32, "--batch-size", 4,
        "--eval-every", 4, "--eval-batches", 2, "--ckpt-every", 4, "--dump-param-hash"]


@pytest.fixture(scope="module")
def token_runs(tmp_path_factory):
    """A 2-rank run on a byte-level folder named by TORCHRIG_DATA, and a run resumed from its
    step-4 checkpoint."""
    d = tmp_path_factory.mktemp("tokens")
    write_text(d / "corpus.txt", 2000, seed=4)
    folder = d / "data"
    prepare_data.prepare([str(d / "corpus.txt")], str(folder))
    env = {"TORCHRIG_DATA": str(folder)}
    full = run_torchrun([*ARGS, "--ckpt-dir", d / "full", "--out-json", d / "m.json"], env=env)
    assert full.returncode == 0, _fail_msg(full)
    (d / "resumed").mkdir()
    shutil.copy(d / "full" / "ckpt_00000004.pt", d / "resumed")
    resumed = run_torchrun([*ARGS, "--ckpt-dir", d / "resumed"], env=env)
    assert resumed.returncode == 0, _fail_msg(resumed)
    return full, resumed, folder, d


def test_training_reads_the_folder_and_evaluates(token_runs):
    full, _, folder, d = token_runs
    cfg = progress.parse(next(ln for ln in full.stdout.splitlines() if ln.startswith("config ")))
    assert cfg.fields["data"] == str(folder) and cfg.fields["vocab_size"] == "256"
    assert sorted(steps(full.stdout)) == list(range(1, 9))
    evals = [progress.parse(ln) for ln in full.stdout.splitlines() if ln.startswith("eval ")]
    assert [e.kind for e in evals] == ["eval", "eval"]  # rank 0 only, at 4 and at the end
    assert [e.fields["step"] for e in evals] == ["4", "8"]
    # all ranks together: 2 ranks x 2 batches x 4 windows of 32 tokens
    assert all(e.fields["windows"] == "16" and e.fields["tokens"] == "512" for e in evals)
    losses = [float(e.fields["val_loss"]) for e in evals]
    assert all(math.isfinite(v) for v in losses) and losses[1] < losses[0] < math.log(256)
    assert json.loads((d / "m.json").read_text())["val_loss"] == pytest.approx(losses[1],
                                                                               abs=1e-4)


def test_resume_continues_the_same_stream(token_runs):
    full, resumed, _, _ = token_runs
    assert "resume step=4 " in resumed.stdout
    a, b = steps(full.stdout), steps(resumed.stdout)
    assert sorted(b) == [5, 6, 7, 8] and all(b[s] == a[s] for s in b)
    assert len(set(a.values())) == 8  # the losses move: equality is not vacuous
    assert EVAL_RE.findall(resumed.stdout) == EVAL_RE.findall(full.stdout)[1:]
    hashes = {h for *_, h in HASH_RE.findall(full.stdout + resumed.stdout)}
    assert len(hashes) == 1 and DONE_RE.search(resumed.stdout).group(1) == "8"


def test_a_bpe_folder_sets_the_model_vocabulary(tmp_path):
    write_text(tmp_path / "c.txt", 1500, seed=5)
    folder = tmp_path / "bpe"
    meta = prepare_data.prepare([str(tmp_path / "c.txt")], str(folder), bpe=320)
    p = subprocess.run([sys.executable, str(TRAIN), "--device", "cpu", "--max-steps", "2",
                        "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1"],
                       cwd=REPO, env={**_env(), "TORCHRIG_DATA": str(folder)},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, _fail_msg(p)
    assert f" vocab_size={meta['vocab_size']} " in p.stdout
    assert re.search(r"^eval step=2 val_loss=[0-9.]+ windows=4 tokens=128$", p.stdout, re.M)


def test_a_checkpoint_of_another_vocabulary_is_refused(token_runs, tmp_path):
    """The same job relaunched on a re-tokenized folder: its checkpoints do not fit the model."""
    _, _, _, d = token_runs
    write_text(tmp_path / "c.txt", 300)
    folder = tmp_path / "bpe"
    vocab = prepare_data.prepare([str(tmp_path / "c.txt")], str(folder), bpe=300)["vocab_size"]
    shutil.copytree(d / "full", tmp_path / "ck")
    p = subprocess.run([sys.executable, str(TRAIN), "--device", "cpu", "--max-steps", "12",
                        "--seq-len", "32", "--batch-size", "4", "--ckpt-dir", str(tmp_path / "ck")],
                       cwd=REPO, env={**_env(), "TORCHRIG_DATA": str(folder)},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, _fail_msg(p)
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"ckpt_00000008.pt: a model of vocab_size 256, the data's is {vocab}" in p.stderr
