"""Token folders: payload/prepare_data.py makes them (byte-level, a BPE it trains, a given
tokenizer.json)."""

from __future__ import annotations

import array
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tokenizers import Tokenizer  # a test dependency (pyproject [test])

PAYLOAD = Path(__file__).resolve().parents[2] / "payload"
sys.path.insert(0, str(PAYLOAD))
import prepare_data  # noqa: E402

PREPARE = PAYLOAD / "prepare_data.py"
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
