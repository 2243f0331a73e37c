#!/usr/bin/env python3
"""Make a token folder (token_format.py: train.bin, val.bin, meta.json) from text, for train.py.

    python payload/prepare_data.py corpus/ --out tokens/                    # byte-level, vocab 256
    python payload/prepare_data.py corpus/ --out tokens/ --bpe 8192         # trains a BPE tokenizer
    python payload/prepare_data.py corpus/ --out tokens/ --tokenizer tokenizer.json

INPUT is a text file or a folder of them (every regular file below it, by path, skipping names
that start with a dot). Each file's last --val-fraction (at a line end) goes to val.bin, the
rest to train.bin. Files are read line by line and written as they are read: the corpus is
never held in memory. Byte-level needs the standard library only (this runs where torch is
not installed); --bpe and --tokenizer need the `tokenizers` package (pip install tokenizers).
With a tokenizer that knows <|endoftext|> (--bpe adds it), each file's part of a split ends
with it. Then:

    torchrig data.push tokens/ --name tokens
    torchrig launch --data tokens ...
"""

from __future__ import annotations

import argparse
import array
import json
import os
import sys

from token_format import BYTES, ITEMSIZE, META, SPLITS, dtype_for

EOT = "<|endoftext|>"
CHUNK = 1 << 20  # bytes of lines tokenized at a time
LONG_LINE = 1 << 16  # a line this long that holds the split point is split (else it is train's)


class PrepareError(Exception):
    """A problem with the inputs or the options; the message says what to do."""


def text_files(inputs: list[str]) -> list[str]:
    """The files of the inputs, each folder's by path, hidden names skipped."""
    files = []
    for inp in inputs:
        if os.path.isfile(inp):
            files.append(inp)
        elif os.path.isdir(inp):
            found = []
            for root, dirs, names in os.walk(inp):
                dirs[:] = [d for d in dirs if not d.startswith(".")]
                found += [os.path.join(root, n) for n in names
                          if not n.startswith(".") and os.path.isfile(os.path.join(root, n))]
            if not found:
                raise PrepareError(f"{inp}: no files in this folder")
            files += sorted(found)
        else:
            raise PrepareError(f"{inp}: no such file or folder")
    return files


def _char_start(line: bytes, at: int) -> int:
    """`at`, moved back to the start of a UTF-8 character."""
    while 0 < at < len(line) and line[at] & 0xC0 == 0x80:
        at -= 1
    return at


def split_chunks(path: str, val_fraction: float):
    """(split, [line, ...]) of a file in order, at most about CHUNK bytes each: the lines
    before the split point are train's, the rest val's. The point is the line end at or after
    the file's last val_fraction; a line of LONG_LINE bytes or more that holds it is split there
    (on a UTF-8 character boundary)."""
    cut = os.path.getsize(path) - int(os.path.getsize(path) * val_fraction)
    pos, split, lines, size = 0, "train", [], 0
    with open(path, "rb") as f:
        for line in f:
            parts = [("train" if pos < cut else "val", line)]
            if pos < cut < pos + len(line) and len(line) >= LONG_LINE:
                at = _char_start(line, cut - pos)
                parts = [("train", line[:at]), ("val", line[at:])]
            pos += len(line)
            for part_split, part in parts:
                if part_split != split or size >= CHUNK:
                    if lines:
                        yield split, lines
                    split, lines, size = part_split, [], 0
                lines.append(part)
                size += len(part)
    if lines:
        yield split, lines


class ByteTokens:
    """Byte-level: each byte is its token id (vocab 256)."""
    name, vocab_size, eot_id = BYTES, 256, None

    @staticmethod
    def encode(lines: list[bytes]) -> bytes:
        """The ids as little-endian uint16 (each byte, then a zero byte)."""
        text = b"".join(lines)
        out = bytearray(2 * len(text))
        out[0::2] = text
        return bytes(out)


class HFTokens:
    """A `tokenizers` tokenizer; ids written little-endian in token_format's dtype."""
    name = "tokenizer.json"

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eot_id = tokenizer.token_to_id(EOT)
        self.code = {"uint16": "H", "uint32": "I"}[dtype_for(self.vocab_size)]

    def ids(self, ids) -> bytes:
        a = array.array(self.code, ids)
        if sys.byteorder == "big":
            a.byteswap()
        return a.tobytes()

    def encode(self, lines: list[bytes]) -> bytes:
        texts = [ln.decode("utf-8", "replace") for ln in lines]
        return self.ids([i for e in self.tok.encode_batch(texts, add_special_tokens=False)
                         for i in e.ids])


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise PrepareError("--bpe and --tokenizer need the tokenizers package: pip install "
                           "tokenizers (or leave both out for byte-level tokens)") from None
    return tokenizers


def train_bpe(files: list[str], vocab_size: int, val_fraction: float) -> HFTokens:
    """A byte-level BPE (GPT-2's kind: any text encodes, no unknown token) of vocab_size ids,
    <|endoftext|> among them, trained on the train parts of the files."""
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT],
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                     show_progress=False)
    texts = ([ln.decode("utf-8", "replace") for ln in lines]
             for path in files for split, lines in split_chunks(path, val_fraction)
             if split == "train")
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokens(tok)


def load_tokenizer(path: str) -> HFTokens:
    tk = _tokenizers()
    try:
        return HFTokens(tk.Tokenizer.from_file(path))
    except Exception as e:  # the Rust side's error: no file, not a tokenizer.json
        raise PrepareError(f"--tokenizer {path}: not a readable tokenizer.json ({e})") from None


def prepare(inputs: list[str], out: str, val_fraction: float = 0.05, bpe: int | None = None,
            tokenizer: str | None = None) -> dict:
    """Write the token folder `out` from the inputs; its meta.json's content. Each file goes in
    as it is written (a temporary name, renamed when complete), meta.json last."""
    files = text_files(inputs)
    tokens = (train_bpe(files, bpe, val_fraction) if bpe else
              load_tokenizer(tokenizer) if tokenizer else ByteTokens())
    dtype = dtype_for(tokens.vocab_size)
    os.makedirs(out, exist_ok=True)
    part = {split: os.path.join(out, f".{name}.part") for split, name in SPLITS.items()}
    written = dict.fromkeys(SPLITS, 0)
    sinks = {split: open(p, "wb") for split, p in part.items()}

    def put(split, data):
        sinks[split].write(data)
        written[split] += len(data)

    try:
        for path in files:
            splits = []
            for split, lines in split_chunks(path, val_fraction):
                put(split, tokens.encode(lines))
                splits += [split] if split not in splits else []
            for split in splits if tokens.eot_id is not None else []:
                put(split, tokens.ids([tokens.eot_id]))
    finally:
        for f in sinks.values():
            f.close()
    counts = {split: n // ITEMSIZE[dtype] for split, n in written.items()}
    empty = [name for split, name in SPLITS.items() if not counts[split]]
    if empty:
        for p in part.values():
            os.remove(p)
        raise PrepareError(f"{' and '.join(empty)} would be empty: the input is too small to "
                           f"split (use more text or a larger --val-fraction)")
    for split, name in SPLITS.items():
        os.replace(part[split], os.path.join(out, name))
    tok_file = os.path.join(out, HFTokens.name)
    if isinstance(tokens, HFTokens):
        tokens.tok.save(tok_file + ".part")
        os.replace(tok_file + ".part", tok_file)
    elif os.path.exists(tok_file):
        os.remove(tok_file)  # an earlier run's: this folder is byte-level now
    meta = {"vocab_size": tokens.vocab_size, "dtype": dtype, "tokenizer": tokens.name,
            "eot_id": tokens.eot_id, "train_tokens": counts["train"],
            "val_tokens": counts["val"], "val_fraction": val_fraction, "files": len(files)}
    with open(os.path.join(out, META + ".part"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    os.replace(os.path.join(out, META + ".part"), os.path.join(out, META))
    return meta


def _fraction(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = -1.0
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {s!r}")
    return v


def _vocab(s: str) -> int:
    if not s.isdigit() or not 256 < int(s) < 1 << 32:
        raise argparse.ArgumentTypeError(f"expected a vocabulary size above 256, got {s!r}")
    return int(s)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prepare_data.py",
        description="Make a token folder (train.bin, val.bin, meta.json) for train.py --data "
                    "from text files.")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="a text file or a folder of them")
    p.add_argument("--out", required=True, metavar="DIR", help="the token folder to write")
    p.add_argument("--val-fraction", type=_fraction, default=0.05,
                   help="each file's share (its end) that goes to val.bin (default 0.05)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--bpe", type=_vocab, metavar="VOCAB",
                     help="train a byte-level BPE tokenizer of VOCAB ids (needs tokenizers)")
    how.add_argument("--tokenizer", metavar="FILE",
                     help="tokenize with this tokenizer.json (needs tokenizers)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        meta = prepare(args.inputs, args.out, args.val_fraction, args.bpe, args.tokenizer)
    except (PrepareError, OSError) as e:
        sys.stderr.write(f"prepare_data.py: error: {e}\n")
        return 2
    print(f"{args.out}: train.bin {meta['train_tokens']} tokens, val.bin {meta['val_tokens']} "
          f"tokens, vocab_size {meta['vocab_size']} ({meta['tokenizer']}), {meta['dtype']}, "
          f"from {meta['files']} file(s)")
    name = os.path.basename(os.path.normpath(args.out))
    print(f"next: torchrig data.push {args.out} --name {name}; torchrig launch --data {name} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
