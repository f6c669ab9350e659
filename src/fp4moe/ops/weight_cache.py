"""FP8 copies of the weights made once per optimizer step and reused until the next one (opt-in: ``enable(params)``).

Without the cache every FP8 GEMM quantizes its weight again: the forward of each micro-batch (128x128 blocks of W),
the backward's dgrad (the blocks of W^T), and a recomputed forward. The weights only change at the optimizer step,
so with gradient accumulation over n micro-batches that is ~2n quantizations per weight and step where one pass
would do. This module keeps, per weight (a dense ``[N, K]`` parameter, or the E experts ``[N, K]`` of one grouped
GEMM), both copies made in the same pass:

    forward   data ``[N, K]`` float8_e4m3fn, scale ``[N/128, K/128]`` float32   (``[E, N, K]``, ``[E, N/128, K/128]``)
    dgrad     data ``[K, N]``,                scale ``[K/128, N/128]``          (``[E, K, N]``, ``[E, K/128, N/128]``)

bit for bit what ``quantize_weight_128x128`` / ``transpose_weight_128x128`` (``quantize_experts_128x128``) give.
For weights that do not require grad only the forward copy is made; the dgrad copy is added when first asked for.

Memory: while enabled, the copies of every FP8-computed weight stay allocated between steps, ``2 N K + 8 N K /
128^2`` bytes per ``[N, K]`` weight (~2 B per parameter; Transformer Engine's weight workspaces cost the same).

Which weights: those whose storage is one of the parameters' given to ``enable(params)`` (a megatron model's
parameters, views into its DDP buffer included; a tensor made per call, e.g. a cast, is never cached, so its
freed memory can never be mistaken for a weight). A weight is found again through any view or ``detach()`` of it
(the key is its place in its storage: offset, shape, strides, dtype), e.g. the detached weights of an expert
recompute's backward.

When the copies are dropped (``new_step``): after every optimizer step. ``enable()`` registers a global post-hook
on every ``torch.optim.Optimizer.step`` (megatron-core's optimizers step torch optimizers inside, so this covers
them; the copy of the main parameters into the model's BF16 parameters that follows the step is done before any
forward can ask again); a trainer that updates weights another way calls ``new_step()`` itself. A weight changed in
place through autograd's view (``w.copy_(...)`` under ``no_grad``: its version counter moves) is quantized again;
a change through ``w.data`` between steps is not seen: call ``new_step``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

Quantized = tuple[torch.Tensor, torch.Tensor]


@dataclass
class _Entry:
    versions: tuple[int, ...]         # the weights' version counters when quantized
    forward: Quantized
    dgrad: Quantized | None = None


@dataclass
class CacheStats:
    """Quantizer passes (``misses``: one per weight and step when the cache works) and reuses (``hits``)."""

    hits: int = 0
    misses: int = 0
    steps: int = 0


def _place(w: torch.Tensor) -> tuple:
    return (w.untyped_storage().data_ptr(), w.storage_offset(), tuple(w.shape), w.stride(), w.dtype, w.device)


@dataclass
class FP8WeightCache:
    """See the module docstring. ``get(weights, make, transposed)``; ``enable`` / ``disable`` / ``new_step``."""

    enabled: bool = False
    stats: CacheStats = field(default_factory=CacheStats)
    _entries: dict[tuple, _Entry] = field(default_factory=dict)
    _storages: set[int] = field(default_factory=set)
    _hook: object | None = None

    def enable(self, params: Iterable[torch.Tensor]) -> None:
        """Cache the FP8 copies of the weights that live in ``params``' storages; drop them after every torch
        optimizer step (a global post-hook). ``stats`` count from here."""
        self._storages = {p.untyped_storage().data_ptr() for p in params}
        self._entries.clear()
        self.stats = CacheStats()
        self.enabled = True
        if self._hook is None:
            self._hook = register_optimizer_step_post_hook(lambda *_: self.new_step())

    def disable(self) -> None:
        """Turn caching off, free every copy and remove the optimizer hook."""
        self.enabled = False
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._entries.clear()
        self._storages = set()

    def new_step(self) -> None:
        """The weights changed (an optimizer step): free every copy; the next GEMM of each weight quantizes again."""
        self._entries.clear()
        self.stats.steps += 1

    def bytes(self) -> int:
        """Bytes held by the copies now (data and scales, both layouts)."""
        n = 0
        for e in self._entries.values():
            for q in (e.forward, e.dgrad):
                if q is not None:
                    n += sum(t.numel() * t.element_size() for t in q)
        return n

    def get(self, weights: Sequence[torch.Tensor], make: Callable[[bool], tuple[Quantized, Quantized | None]],
            transposed: bool) -> Quantized:
        """The forward (``transposed`` False) or dgrad copy of ``weights`` (one tensor, or the experts of a grouped
        GEMM). ``make(both)`` quantizes: (forward, dgrad if ``both`` else None); called on a miss, with ``both``
        True when a weight requires grad (its backward will ask: the dgrad copy in the same pass; an autograd
        Function's forward runs under no_grad, so grad mode cannot tell)."""
        if not self.enabled or any(w.untyped_storage().data_ptr() not in self._storages for w in weights):
            fwd, dgrad = make(transposed)
            return dgrad if transposed else fwd
        key = tuple(_place(w) for w in weights)
        versions = tuple(w._version for w in weights)
        e = self._entries.get(key)
        if e is None or e.versions != versions:
            self.stats.misses += 1
            fwd, dgrad = make(transposed or any(w.requires_grad for w in weights))
            e = self._entries[key] = _Entry(versions, fwd, dgrad)
            return e.dgrad if transposed else e.forward
        if transposed and e.dgrad is None:
            self.stats.misses += 1
            e.dgrad = make(True)[1]
            return e.dgrad
        self.stats.hits += 1
        return e.dgrad if transposed else e.forward


CACHE = FP8WeightCache()


class enabled_for:
    """``with enabled_for(model.parameters()):`` the process-wide ``CACHE`` on for those parameters during the
    block, off and empty after it; ``enabled_for(None)`` leaves it as it is."""

    def __init__(self, params: Iterable[torch.Tensor] | None):
        self.params = None if params is None else list(params)

    def __enter__(self) -> FP8WeightCache:
        if self.params is not None:
            CACHE.enable(self.params)
        return CACHE

    def __exit__(self, *exc) -> None:
        if self.params is not None:
            CACHE.disable()


__all__ = ["CACHE", "CacheStats", "FP8WeightCache", "enabled_for"]
