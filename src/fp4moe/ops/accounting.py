"""Bytes autograd holds for backward, measured: the accounting the tests, the layer benchmark, the model and the
trainer use.

``SavedTensorBytes`` records every tensor saved for backward while it is active; a saved-tensors hook that
replaces what autograd keeps (``fp4_store``'s MXFP4 packing: the innermost hook wins, so an outer counter would
see nothing) reports what it keeps instead through :func:`note_saved`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

_ACTIVE: list["SavedTensorBytes"] = []


def note_saved(*tensors: torch.Tensor) -> None:
    """Tell every active ``SavedTensorBytes`` that these tensors are now held for backward."""
    for counter in _ACTIVE:
        counter._seen.extend(tensors)


class SavedTensorBytes:
    """Context that records every tensor saved for backward while it is active and reports ``bytes()``: the
    storage bytes still held *now*, each storage once, excluding ``exclude``'s (e.g. the parameters, saved by
    reference). Storages freed after saving (megatron's output-discarding checkpoint resizes them to 0) count 0.
    Keeps references to what it saw until it is dropped."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._seen: list[torch.Tensor] = []
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        self._seen.append(t)
        return t

    def __enter__(self):
        _ACTIVE.append(self)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        _ACTIVE.remove(self)

    def bytes(self) -> int:
        sizes: dict[int, int] = {}
        for t in self._seen:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr and ptr not in self._exclude:
                sizes[ptr] = st.nbytes()
        return sum(sizes.values())


def saved_bytes_during(fn: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> tuple[int, Any]:
    """(``SavedTensorBytes.bytes()`` right after running ``fn()``, ``fn()``'s result): the bytes of the distinct
    storages autograd saved (custom Functions' ``save_for_backward`` included), ``exclude``'s left out. Tensors a
    Function keeps on ``ctx`` by other means are not seen."""
    with SavedTensorBytes(exclude) as counter:
        out = fn()
    return counter.bytes(), out


__all__ = ["SavedTensorBytes", "note_saved", "saved_bytes_during"]
