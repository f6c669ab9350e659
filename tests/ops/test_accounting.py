"""fp4moe.ops.accounting.SavedTensorBytes: what it counts, and that it does not keep activations alive.

The trainer measures its first micro-batch with it and then drops it. A counter in a reference cycle (its hooks
held a bound method of itself) kept that micro-batch's saved activations alive after the backward pass until
Python's cyclic collector ran, steps later: on the H200 proxy one whole micro-batch of activations (12-33 GiB) was
still allocated when later steps began, and every measured peak carried it."""
from __future__ import annotations

import gc
import weakref

import torch

from fp4moe.ops.accounting import SavedTensorBytes, saved_bytes_during


def _saved_intermediate():
    """(x, h, y): y = h * h with h = exp(x) saved for backward (twice, one storage)."""
    x = torch.randn(64, 32, requires_grad=True)
    h = x.exp()
    return x, h, h * h


def test_counts_each_saved_storage_once_and_leaves_out_excluded():
    w = torch.randn(32, 16, requires_grad=True)
    with SavedTensorBytes(exclude=[w]) as c:
        x, h, y = _saved_intermediate()
        z = y @ w  # saves y (64 x 32 fp32) and w (excluded)
    # exp saves its output h, mul saves h twice (one storage), matmul saves y and w
    assert c.bytes() == h.numel() * 4 + y.numel() * 4
    assert c.release() == h.numel() * 4 + y.numel() * 4 and c.bytes() == 0
    z.sum().backward()


def _run_and_drop(release: bool) -> weakref.ref:
    with SavedTensorBytes() as c:
        x, h, y = _saved_intermediate()
    ref = weakref.ref(h)
    if release:
        assert c.release() > 0
    del h
    y.sum().backward()
    del y, x, c
    return ref


def test_dropped_counter_frees_the_saved_tensors_without_the_cyclic_collector():
    gc.collect()
    gc.disable()  # only reference counting may free them: the trainer cannot wait for the cyclic collector
    try:
        assert _run_and_drop(release=False)() is None
        assert _run_and_drop(release=True)() is None
    finally:
        gc.enable()


def test_released_counter_lets_backward_free_what_it_saw():
    with SavedTensorBytes() as c:
        x, h, y = _saved_intermediate()
    ref = weakref.ref(h)
    n = c.release()
    assert n == h.numel() * 4
    del h
    y.sum().backward()  # the graph's saved h is freed here; the counter, still alive, holds nothing
    del y
    assert ref() is None and c.bytes() == 0


def test_saved_bytes_during_returns_the_result_and_holds_nothing():
    x = torch.randn(8, 128, requires_grad=True)
    gc.disable()
    try:
        n, y = saved_bytes_during(lambda: x.exp())
        ref = weakref.ref(y)  # exp saves its output: y itself
        assert n == y.numel() * 4
        y.sum().backward()
        del y
        assert ref() is None
    finally:
        gc.enable()
