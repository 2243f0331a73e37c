"""The token folder format, declared once: what prepare_data.py writes and data.py reads.
Standard library only (prepare_data.py runs where torch may not be installed).

A token folder holds:

    train.bin    token ids, flat, little-endian, of meta.json's dtype
    val.bin      the same, for evaluation
    meta.json    {"vocab_size": N, "dtype": "uint16", "tokenizer": "bytes" | "tokenizer.json", ...}
    tokenizer.json   (when meta's tokenizer names it) the tokenizer, for decoding

dtype is uint16 when vocab_size <= 65535, else uint32. meta.json may say more
(train_tokens, val_tokens, eot_id, sources); train_tokens and val_tokens, when given, must match
the files.
"""

from __future__ import annotations

import json
import os

TRAIN, VAL, META = "train.bin", "val.bin", "meta.json"
SPLITS = {"train": TRAIN, "val": VAL}
ITEMSIZE = {"uint16": 2, "uint32": 4}
BYTES = "bytes"  # meta's tokenizer for byte-level data: ids are the bytes, vocab 256
FIX = "make the folder with payload/prepare_data.py (docs/payload.md#your-own-token-data)"


class DataError(Exception):
    """A data folder that cannot be trained on; the message says what is wrong, where, and
    what to do."""


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 0xFFFF else "uint32"


def read_meta(folder: str) -> dict:
    """meta.json of a token folder, checked: a dict with vocab_size (a positive integer below
    2**32) and a dtype that holds every id. DataError otherwise."""
    path = os.path.join(folder, META)
    if not os.path.isdir(folder):
        raise DataError(f"{folder}: no such folder; {FIX}, then push it with torchrig data.push")
    if not os.path.isfile(path):
        raise DataError(f"{folder}: no {META} (not a token folder: it needs {TRAIN}, {VAL} and "
                        f"{META}); {FIX}")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not readable JSON ({e}); {FIX}") from None
    vocab, dtype = (meta.get("vocab_size"), meta.get("dtype")) if isinstance(meta, dict) else (
        None, None)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab < 1 << 32:
        raise DataError(f"{path}: vocab_size must be a positive integer, got {vocab!r}; {FIX}")
    if dtype not in ITEMSIZE:
        raise DataError(f"{path}: dtype must be one of {', '.join(ITEMSIZE)}, got {dtype!r}; "
                        f"{FIX}")
    if dtype == "uint16" and dtype_for(vocab) != "uint16":
        raise DataError(f"{path}: dtype uint16 is for a vocab_size up to 65535, got {vocab} "
                        f"(use uint32); {FIX}")
    return meta


def count_tokens(folder: str, meta: dict, split: str, min_tokens: int = 1) -> int:
    """How many tokens a split's file holds, checked against its size, meta's count (when
    given) and min_tokens. DataError otherwise."""
    path = os.path.join(folder, SPLITS[split])
    if not os.path.isfile(path):
        raise DataError(f"{path}: missing (a token folder holds {TRAIN}, {VAL} and {META}); {FIX}")
    size, item = os.path.getsize(path), ITEMSIZE[meta["dtype"]]
    if size % item:
        raise DataError(f"{path}: {size} bytes is no whole number of {meta['dtype']} tokens "
                        f"(a cut copy?); {FIX}")
    n = size // item
    said = meta.get(f"{split}_tokens")
    if said is not None and said != n:
        raise DataError(f"{path}: holds {n} tokens, {META} says {said} (a cut or stale copy?); "
                        f"{FIX}")
    if n < min_tokens:
        raise DataError(f"{path}: {n} tokens, fewer than one window of {min_tokens} (--seq-len "
                        f"+ 1); use more text, a smaller --seq-len or a larger --val-fraction")
    return n
