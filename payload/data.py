"""Data: a token folder (token_format.py: train.bin, val.bin, meta.json), a synthetic task with
learnable structure, or a byte-level text file, in batches.

A run's data is a source (open_source): `samples` windows in all, `rank_samples` of them this
rank's per epoch, `vocab_size` (None: the preset's), and batches(epoch, step_in_epoch, step),
the micro-batches from a position on, grad_accum of them per optimizer step."""

from __future__ import annotations

import hashlib
import itertools
import os

import torch
from torch.utils.data import Dataset, DistributedSampler

from token_format import META, SPLITS, DataError, count_tokens, read_meta


class SyntheticCopyDataset(Dataset):
    """Deterministic byte sequences with learnable structure.

    Sample i is a random pattern of 2..8 letters from a 16-letter alphabet (chosen by a
    generator seeded with (seed, i)), repeated to fill seq_len+1 tokens. A model first
    learns the alphabet (loss ln 256 -> ln 16), then to copy the period (induction).
    """

    ALPHABET = torch.tensor(list(b"abcdefghijklmnop"), dtype=torch.long)

    def __init__(self, num_samples: int, seq_len: int, seed: int = 0):
        self.n = num_samples
        self.seq_len = seq_len
        self.seed = seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        period = int(torch.randint(2, 9, (1,), generator=g))
        pattern = self.ALPHABET[torch.randint(0, len(self.ALPHABET), (period,), generator=g)]
        reps = (self.seq_len + 1 + period - 1) // period
        seq = pattern.repeat(reps)[: self.seq_len + 1]
        return seq[:-1], seq[1:]


class ByteFileDataset(Dataset):
    """Non-overlapping windows of seq_len+1 bytes from a file."""

    def __init__(self, path: str, seq_len: int):
        with open(path, "rb") as f:
            raw = f.read()
        self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self.seq_len = seq_len
        self.n = (len(self.data) - 1) // seq_len if len(self.data) > seq_len else 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        start = int(i) * self.seq_len
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def iterate_batches(dataset, indices, batch_size: int, skip_batches: int = 0, pin: bool = False):
    """Yield (x, y) batches of the given per-rank indices, skipping the first skip_batches.
    pin: in page-locked memory, so that the copy to the GPU is asynchronous."""
    nb = len(indices) // batch_size
    for b in range(skip_batches, nb):
        items = [dataset[i] for i in indices[b * batch_size : (b + 1) * batch_size]]
        x, y = torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
        yield (x.pin_memory(), y.pin_memory()) if pin else (x, y)


# ---- a token folder ---------------------------------------------------------------------------

TORCH_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}


def window_seed(*key) -> int:
    """A generator seed for a key such as ("train", seed, rank, step, micro): a hash, so that
    no two keys share a stream (seed * K + rank would, for some pair of runs)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class TokenData:
    """A token folder, checked (DataError names what is wrong) and memory-mapped: the files are
    read as windows are taken, never loaded whole (torch.from_file with shared=False opens them
    read-only, as a dataset's stored files are, and maps them private: nothing is written)."""

    def __init__(self, folder: str, seq_len: int):
        self.folder, self.seq_len = folder, seq_len
        self.meta = read_meta(folder)
        self.vocab_size = int(self.meta["vocab_size"])
        self.dtype = self.meta["dtype"]
        self.tokens = {split: torch.from_file(
            os.path.join(folder, name), shared=False, dtype=TORCH_DTYPES[self.dtype],
            size=count_tokens(folder, self.meta, split, seq_len + 1))
            for split, name in SPLITS.items()}

    def windows(self, split: str, count: int, *key) -> torch.Tensor:
        """`count` windows of seq_len+1 tokens (int64, count x (seq_len+1)) at offsets drawn
        from a generator seeded by (split, *key): the same key, the same windows."""
        data, span = self.tokens[split], self.seq_len + 1
        g = torch.Generator().manual_seed(window_seed(split, *key))
        starts = torch.randint(0, len(data) - span + 1, (count,), generator=g).tolist()
        w = torch.stack([data[s:s + span].to(torch.int64) for s in starts])
        top = int(w.max())
        if top >= self.vocab_size:
            raise DataError(f"{os.path.join(self.folder, SPLITS[split])}: token id {top} is not "
                            f"below vocab_size {self.vocab_size} of {META}: the ids and "
                            f"{META} disagree; prepare the folder again with prepare_data.py")
        return w

    def batch(self, split: str, count: int, *key, pin: bool = False):
        """(x, y): inputs and next-token targets of windows(split, count, *key)."""
        w = self.windows(split, count, *key)
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        return (x.pin_memory(), y.pin_memory()) if pin else (x, y)


class TokenStream:
    """This rank's training batches from a token folder: micro-batch m of step s holds
    batch_size windows drawn from (seed, rank, s, m). Ranks draw different windows, and a run
    resumed at step s draws what the uninterrupted run drew from there: the position is the
    step alone. An epoch is as many windows as train.bin holds without overlap."""

    def __init__(self, data: TokenData, seed: int, rank: int, world_size: int, batch_size: int,
                 grad_accum: int, pin: bool = False):
        self.data, self.seed, self.rank = data, seed, rank
        self.batch_size, self.grad_accum, self.pin = batch_size, grad_accum, pin
        self.vocab_size = data.vocab_size
        self.samples = (len(data.tokens["train"]) - 1) // data.seq_len
        self.rank_samples = self.samples // world_size

    def batches(self, epoch: int, step_in_epoch: int, step: int):
        for s in itertools.count(step):
            for m in range(self.grad_accum):
                yield self.data.batch("train", self.batch_size, self.seed, self.rank, s, m,
                                      pin=self.pin)

    def eval_batches(self, n: int):
        """The n evaluation batches of this rank: the same val.bin windows at every
        evaluation, so that the val_loss of two evaluations compares the model alone."""
        for b in range(n):
            yield self.data.batch("val", self.batch_size, self.seed, self.rank, b, pin=self.pin)


class SampledDataset:
    """A map-style dataset split across ranks by DistributedSampler: each epoch a new order
    (seed, epoch), this rank's share in batches."""

    vocab_size = None  # the preset's

    def __init__(self, dataset, seed: int, rank: int, world_size: int, batch_size: int,
                 grad_accum: int, pin: bool = False):
        self.dataset, self.batch_size, self.grad_accum, self.pin = (dataset, batch_size,
                                                                    grad_accum, pin)
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=seed, drop_last=True)
        self.samples, self.rank_samples = len(dataset), len(self.sampler)

    def batches(self, epoch: int, step_in_epoch: int, step: int):
        self.sampler.set_epoch(epoch)
        return iterate_batches(self.dataset, list(iter(self.sampler)), self.batch_size,
                               skip_batches=step_in_epoch * self.grad_accum, pin=self.pin)


def open_source(cfg, rank: int, world_size: int, pin: bool = False,
                tokens: TokenData | None = None):
    """The run's data source: the token folder `tokens` (open_tokens(cfg)), else cfg.data's
    byte-level text file, else the synthetic task."""
    args = (cfg.seed, rank, world_size, cfg.batch_size, cfg.grad_accum, pin)
    if tokens is not None:
        return TokenStream(tokens, *args)
    dataset = (ByteFileDataset(cfg.data, cfg.seq_len) if cfg.data else
               SyntheticCopyDataset(cfg.synthetic_samples, cfg.seq_len, seed=cfg.seed))
    return SampledDataset(dataset, *args)


def open_tokens(cfg) -> TokenData | None:
    """cfg.data's token folder, checked and mapped, or None when cfg.data is no folder."""
    return TokenData(cfg.data, cfg.seq_len) if cfg.data and os.path.isdir(cfg.data) else None
