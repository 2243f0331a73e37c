"""Data: a token folder (token_format.py: train.bin, val.bin, meta.json), a synthetic task with
learnable structure, or a byte-level text file, in batches.

The order is defined over global batches (GlobalOrder): the samples of global step k are a fixed
set that depends on (seed, k) alone (k's epoch is k // steps_per_epoch), split among the ranks
and micro-steps. A run resumed at another world size (with the same --global-batch) trains step
k on exactly the samples the uninterrupted run would have used: the data position is the step.

A run's data is a source (open_source): `samples` windows in all, `steps_per_epoch`, `vocab_size`
(None: the preset's), rank_ids(step) (this rank's micro-batches of a step, as sample ids) and
batches(step), the micro-batches from a step on, grad_accum of them per optimizer step."""

from __future__ import annotations

import hashlib
import itertools
import os

import torch
from torch.utils.data import Dataset

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


def stack_batch(dataset, ids, pin: bool = False):
    """(x, y): the samples `ids` of a map-style dataset, stacked. pin: in page-locked memory,
    so that the copy to the GPU is asynchronous."""
    items = [dataset[i] for i in ids]
    x, y = torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])
    return (x.pin_memory(), y.pin_memory()) if pin else (x, y)


def iterate_batches(dataset, indices, batch_size: int, skip_batches: int = 0, pin: bool = False):
    """Yield (x, y) batches of the given indices, skipping the first skip_batches."""
    for b in range(skip_batches, len(indices) // batch_size):
        yield stack_batch(dataset, indices[b * batch_size : (b + 1) * batch_size], pin)


# ---- the order over global batches -------------------------------------------------------------


def window_seed(*key) -> int:
    """A generator seed for a key such as ("train", seed, rank, step, micro): a hash, so that
    no two keys share a stream (seed * K + rank would, for some pair of runs)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def rank_share(ids, rank: int, world_size: int, micro_batch: int) -> list:
    """This rank's micro-batches of a global batch's ids: micro-step m takes the slice
    m * world_size + rank of micro_batch ids (the ids are the step's; who trains on which
    follows the world size)."""
    per = micro_batch * world_size
    return [ids[m * per + rank * micro_batch : m * per + (rank + 1) * micro_batch]
            for m in range(len(ids) // per)]


class GlobalOrder:
    """Which samples each global step trains on: global_batch ids per step, a function of the
    seed and the step alone. `steps_per_epoch` global batches make an epoch (0: the data
    holds less than one)."""

    def __init__(self, samples: int, global_batch: int, seed: int):
        self.samples, self.global_batch, self.seed = samples, global_batch, seed
        self.steps_per_epoch = samples // global_batch

    def step_ids(self, step: int) -> list[int]:
        raise NotImplementedError


class ShuffledOrder(GlobalOrder):
    """A map-style data set: each epoch a permutation of every sample drawn from (seed, epoch);
    step k is the (k mod steps_per_epoch)-th slice of global_batch of it (the rest dropped)."""

    _perm: tuple = (None, None)  # (epoch, its permutation): the one the run is in

    def step_ids(self, step: int) -> list[int]:
        epoch, j = divmod(step, self.steps_per_epoch)
        if self._perm[0] != epoch:
            g = torch.Generator().manual_seed(window_seed("order", self.seed, epoch))
            self._perm = (epoch, torch.randperm(self.samples, generator=g))
        return self._perm[1][j * self.global_batch:(j + 1) * self.global_batch].tolist()


class WindowOrder(GlobalOrder):
    """A token folder: step k is global_batch window offsets into train.bin drawn from (seed, k)
    (`span` tokens each, anywhere in its `tokens`); an epoch is as many windows as train.bin
    holds without overlap."""

    def __init__(self, tokens: int, span: int, global_batch: int, seed: int):
        super().__init__((tokens - 1) // (span - 1), global_batch, seed)
        self.starts = tokens - span + 1

    def step_ids(self, step: int) -> list[int]:
        g = torch.Generator().manual_seed(window_seed("train", self.seed, step))
        return torch.randint(0, self.starts, (self.global_batch,), generator=g).tolist()


# ---- a token folder ---------------------------------------------------------------------------

TORCH_DTYPES = {"uint16": torch.uint16, "uint32": torch.uint32}


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
        return self.read(split, torch.randint(0, len(data) - span + 1, (count,),
                                              generator=g).tolist())

    def read(self, split: str, starts) -> torch.Tensor:
        """The windows of seq_len+1 tokens at offsets `starts` (int64, checked against the
        vocabulary)."""
        data, span = self.tokens[split], self.seq_len + 1
        w = torch.stack([data[s:s + span].to(torch.int64) for s in starts])
        top = int(w.max())
        if top >= self.vocab_size:
            raise DataError(f"{os.path.join(self.folder, SPLITS[split])}: token id {top} is not "
                            f"below vocab_size {self.vocab_size} of {META}: the ids and "
                            f"{META} disagree; prepare the folder again with prepare_data.py")
        return w

    def batch(self, split: str, count: int, *key, pin: bool = False):
        """(x, y): inputs and next-token targets of windows(split, count, *key)."""
        return split_xy(self.windows(split, count, *key), pin)


def split_xy(w: torch.Tensor, pin: bool = False):
    """(x, y) of windows of seq_len+1 tokens: the inputs and the next-token targets."""
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
    return (x.pin_memory(), y.pin_memory()) if pin else (x, y)


class Source:
    """This rank's training batches of an order over global batches (GlobalOrder): the micro-batches
    of global step s are rank_share() of the step's ids."""

    vocab_size = None  # the preset's

    def __init__(self, order: GlobalOrder, rank: int, world_size: int, batch_size: int,
                 pin: bool = False):
        self.order, self.rank, self.world_size = order, rank, world_size
        self.batch_size, self.pin = batch_size, pin
        self.samples, self.steps_per_epoch = order.samples, order.steps_per_epoch

    def rank_ids(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of global step `step`, as sample ids."""
        return rank_share(self.order.step_ids(step), self.rank, self.world_size, self.batch_size)

    def batches(self, step: int):
        """The micro-batches (x, y) from global step `step` on."""
        for s in itertools.count(step):
            for ids in self.rank_ids(s):
                yield self.load(ids)

    def load(self, ids):
        raise NotImplementedError


class TokenStream(Source):
    """A token folder's batches: windows at the offsets WindowOrder draws. Evaluation draws
    this rank's own val.bin windows."""

    def __init__(self, data: TokenData, seed: int, rank: int, world_size: int, batch_size: int,
                 grad_accum: int, pin: bool = False):
        order = WindowOrder(len(data.tokens["train"]), data.seq_len + 1,
                            batch_size * grad_accum * world_size, seed)
        super().__init__(order, rank, world_size, batch_size, pin)
        self.data, self.seed, self.vocab_size = data, seed, data.vocab_size

    def load(self, ids):
        return split_xy(self.data.read("train", ids), self.pin)

    def eval_batches(self, n: int):
        """The n evaluation batches of this rank: the same val.bin windows at every
        evaluation, so that the val_loss of two evaluations compares the model alone."""
        for b in range(n):
            yield self.data.batch("val", self.batch_size, self.seed, self.rank, b, pin=self.pin)


class SampledDataset(Source):
    """A map-style dataset in the order ShuffledOrder draws: each epoch a new permutation."""

    def __init__(self, dataset, seed: int, rank: int, world_size: int, batch_size: int,
                 grad_accum: int, pin: bool = False):
        super().__init__(ShuffledOrder(len(dataset), batch_size * grad_accum * world_size, seed),
                         rank, world_size, batch_size, pin)
        self.dataset = dataset

    def load(self, ids):
        return stack_batch(self.dataset, ids, self.pin)


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
