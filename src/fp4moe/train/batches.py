"""The trainer's batches: its one door to the data pipeline, and which samples make each micro-batch.

:func:`build_token_datasets` calls ``fp4moe.data.build_token_datasets``:
``train_ds, valid_ds, info = build_token_datasets(settings)`` (the run's fp4moe.settings.Settings). Each dataset is
map-style and deterministic, ``ds[i]`` a LongTensor ``[seq_length + 1]`` (input ``[:-1]``, labels ``[1:]``); ``info`` holds
``vocab_size, eod_id, train_tokens, valid_tokens, tokenizer_path, dataset_prefix``. The trainer calls this module
attribute (never a copy of it), so tests can replace it in this one place.

Sampling (:func:`micro_batch_indices`): global sample ``n`` is ``train_ds[n % len(train_ds)]``. A step consumes
``global_batch`` consecutive samples from ``consumed_samples``; micro-batch ``k`` of data-parallel rank ``r``
takes ``micro`` of them at offset ``(k * DP + r) * micro``. A resumed run starts at its checkpoint's
``consumed_samples``, so it sees exactly the samples the uninterrupted run would.
"""
from __future__ import annotations

from typing import Any


def build_token_datasets(settings: Any):
    """``fp4moe.data.build_token_datasets(settings)``, looked up here on every call (see the module docstring)."""
    from fp4moe.data import build_token_datasets as build

    return build(settings)


def micro_batch_indices(consumed: int, micro_index: int, micro: int, dp_rank: int, dp_size: int) -> list[int]:
    """Global sample numbers of micro-batch ``micro_index`` of the step starting at ``consumed`` on ``dp_rank``."""
    start = consumed + (micro_index * dp_size + dp_rank) * micro
    return list(range(start, start + micro))


def _samples(ds: Any, indices: list[int]):
    """LongTensor [len(indices), seq_length + 1]: samples ``indices`` (mod len(ds)), stacked on the host."""
    import torch

    n = len(ds)
    return torch.stack([torch.as_tensor(ds[i % n], dtype=torch.long) for i in indices])


def batch(ds: Any, indices: list[int]):
    """(tokens, labels), each LongTensor [len(indices), seq_length], from samples ``indices`` (mod len(ds))."""
    rows = _samples(ds, indices)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def micro_batch(ds: Any, consumed: int, micro_index: int, micro: int, dp_rank: int, dp_size: int, device: Any,
                non_blocking: bool = False):
    """(tokens, labels) of micro-batch ``micro_index`` of the step starting at ``consumed`` on ``dp_rank``
    (:func:`micro_batch_indices`, :func:`batch`), on ``device``. On a CUDA device the samples ``[micro, seq + 1]``
    travel once, from pinned memory (queued on the stream with ``non_blocking``), and are split into tokens and
    labels there: the two host copies of :func:`batch` took 6-12 ms of host time in an H200 profile, time the GPU
    waited at the start of every micro-batch."""
    import torch

    indices = micro_batch_indices(consumed, micro_index, micro, dp_rank, dp_size)
    if torch.device(device).type != "cuda":
        return tuple(x.to(device) for x in batch(ds, indices))
    rows = _samples(ds, indices).pin_memory().to(device, non_blocking=non_blocking)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


__all__ = ["build_token_datasets", "micro_batch_indices", "batch", "micro_batch"]
