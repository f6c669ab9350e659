"""Bytes autograd holds for backward, measured: the accounting the tests, the layer benchmark and P3 use."""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch


def saved_bytes_during(fn: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> tuple[int, Any]:
    """(bytes of the distinct storages autograd saved while running ``fn()``, ``fn()``'s result).

    Counted with ``saved_tensors_hooks`` over every tensor any autograd node saves (custom Functions'
    ``save_for_backward`` included), each storage once; storages of ``exclude`` (e.g. the parameters) are left
    out. Tensors a Function keeps on ``ctx`` by other means are not seen."""
    packed: list[torch.Tensor] = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed}
    return sum(v for k, v in storages.items() if k not in skip), out


__all__ = ["saved_bytes_during"]
