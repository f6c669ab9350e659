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

    It keeps references to what it saw, so the saved tensors outlive the backward pass that would free them, until
    :meth:`release` or until the counter is dropped. No reference cycle holds it: the hooks close over the list of
    tensors, not over the counter (a bound-method hook made a cycle, so ``del counter`` left one micro-batch's
    activations alive until Python's cyclic collector happened to run, steps later)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        seen: list[torch.Tensor] = []
        self._seen = seen
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen.append(t)
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

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

    def release(self) -> int:
        """``bytes()``, then drop the references: from here on the backward pass frees the saved tensors as usual."""
        n = self.bytes()
        self._seen.clear()
        return n


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def saved_bytes_during(fn: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> tuple[int, Any]:
    """(``SavedTensorBytes.bytes()`` right after running ``fn()``, ``fn()``'s result): the bytes of the distinct
    storages autograd saved (custom Functions' ``save_for_backward`` included), ``exclude``'s left out. Tensors a
    Function keeps on ``ctx`` by other means are not seen."""
    with SavedTensorBytes(exclude) as counter:
        out = fn()
    return counter.release(), out


__all__ = ["SavedTensorBytes", "note_saved", "saved_bytes_during"]
