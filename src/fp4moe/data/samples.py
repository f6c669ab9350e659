"""Training samples: fixed-length windows over the token stream of an indexed dataset.

Why not megatron-core's ``GPTDataset``: it shuffles the *document order* anew each epoch and cuts samples from
that shuffled stream, sizes itself to a requested sample count (repeating epochs), splits train/valid by
document ranges of one prefix, and writes its own index caches next to the data. Our contract is simpler and
checkable: samples are consecutive windows of the documents as stored (EOD between them), the held-out split
is chosen by the corpus (whole works), and only the order of the windows is shuffled. So this is a small
numpy-memmap sampler over the ``.bin``, whose layout (dtype, token count, one contiguous stream) megatron-core's
own ``IndexedDataset`` reader checked when the build was made (``fp4moe.data.indexed.layout``; the manifest
records it); loading a build needs neither megatron-core nor the source.

Sample ``i`` (0 <= i < len):  window ``w = order[i]`` (``order`` = identity, or ``shuffled_order(len, seed)`` when a
seed is given; ``with_epoch(e)`` reshuffles with ``epoch_seed(seed, e)`` for a further pass), tokens ``stream[begin + w * S : begin + w * S + S + 1]`` with ``S = seq_length``: a LongTensor [S + 1];
inputs = ``[:-1]``, labels = ``[1:]``. Consecutive windows share one token (the last label of one is the first
input of the next); ``len = (end - begin - 1) // S``; the tail that fills no window is unused.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from fp4moe.data.errors import DataError

_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser of uint64 values (wrapping uint64 arithmetic: identical on every machine and numpy)."""
    with np.errstate(over="ignore"):
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def epoch_seed(seed: int, epoch: int) -> int:
    """Shuffle seed of pass ``epoch`` over the data: ``seed`` itself for epoch 0, a mix of both after."""
    if epoch == 0:
        return int(seed)
    return int(splitmix64(np.uint64(int(seed) % 2 ** 64) ^ splitmix64(np.uint64(int(epoch)))))


def shuffled_order(n: int, seed: int) -> np.ndarray:
    """A permutation of range(n) (int64) fixed by ``seed``: the indices sorted by splitmix64(index ^ h(seed)).
    It depends only on (n, seed), not on numpy's random streams (which may change between versions)."""
    key = splitmix64(np.arange(n, dtype=np.uint64) ^ splitmix64(np.uint64(int(seed) % 2 ** 64)))
    return np.argsort(key, kind="stable").astype(np.int64)


class TokenWindows(torch.utils.data.Dataset):
    """Map-style dataset of ``seq_length + 1``-token windows over tokens [begin, end) of a ``.bin`` file.

    ``bin_path``: the flat token stream (``dtype``, e.g. uint16). ``begin``/``end``: token offsets.
    ``seed``: None keeps stream order (evaluation); an int shuffles the windows (``shuffled_order``); ``epoch``
    picks the pass (``with_epoch``). ``ds[i]`` -> torch.int64 tensor [seq_length + 1]; IndexError past the end.
    Picklable (DataLoader workers): the memmap is reopened lazily.
    """

    def __init__(self, bin_path: str | os.PathLike, dtype, begin: int, end: int, seq_length: int,
                 seed: int | None = None, name: str = "train", epoch: int = 0):
        self.bin_path, self.dtype, self.name = str(bin_path), np.dtype(dtype), name
        self.begin, self.end, self.seq_length, self.seed = int(begin), int(end), int(seq_length), seed
        self.epoch = int(epoch)
        if self.seq_length < 1:
            raise DataError(f"seq_length={seq_length}: must be >= 1")
        n = (self.end - self.begin - 1) // self.seq_length
        if n < 1:
            more = " (data.valid_fraction / data.valid_works)" if name == "valid" else ""
            raise DataError(f"the {name} split has {self.end - self.begin} tokens, fewer than seq_length + 1 = "
                            f"{self.seq_length + 1}: lower parallel.seq_length or give the split more text{more}")
        size = os.path.getsize(self.bin_path) if os.path.exists(self.bin_path) else -1
        if size < self.end * self.dtype.itemsize:
            raise DataError(f"{self.bin_path} has {size} bytes, fewer than the {self.end} {self.dtype.name} tokens its "
                            "manifest promises (truncated copy?): delete its build directory and prepare again")
        self.num_samples = n
        self.order = None if seed is None else shuffled_order(n, epoch_seed(seed, self.epoch))
        self._mm: np.memmap | None = None

    def with_epoch(self, epoch: int) -> "TokenWindows":
        """The same windows in the order of pass ``epoch`` (epoch 0 = this order when built with epoch=0)."""
        return TokenWindows(self.bin_path, self.dtype, self.begin, self.end, self.seq_length, self.seed, self.name,
                            epoch)

    def __len__(self) -> int:
        return self.num_samples

    def window(self, i: int) -> tuple[int, int]:
        """Token offsets [start, stop) in the ``.bin`` of sample ``i`` (stop - start = seq_length + 1)."""
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.name} ({self.num_samples} samples)")
        i = int(i) % self.num_samples
        w = i if self.order is None else int(self.order[i])
        start = self.begin + w * self.seq_length
        return start, start + self.seq_length + 1

    def __getitem__(self, i: int) -> torch.Tensor:
        start, stop = self.window(i)
        if self._mm is None:
            self._mm = np.memmap(self.bin_path, dtype=self.dtype, mode="r")
        return torch.from_numpy(self._mm[start:stop].astype(np.int64))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_mm"] = None
        return state

    def __repr__(self) -> str:
        return (f"TokenWindows({self.name}: {self.num_samples} x {self.seq_length + 1} tokens from {self.bin_path} "
                f"[{self.begin}, {self.end}), seed={self.seed}, epoch={self.epoch})")


__all__ = ["TokenWindows", "epoch_seed", "shuffled_order", "splitmix64"]
