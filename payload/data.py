"""Data: a synthetic task with learnable structure, or a byte-level text file, in batches."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


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
