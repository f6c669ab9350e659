"""Keep tensors that autograd saves for backward as MXFP4: a ``saved_tensors_hooks`` context (docs/recipe.md).

    with fp4_saved_tensors() as store:          # inside: every eligible saved tensor is packed to MXFP4
        y = block(x)                            # e.g. a recompute wrapper's kept inputs, a layernorm's input
    y.backward(g)                               # unpacked (decoded to bf16) when backward reads it
    store.packed_bytes, store.original_bytes    # what was kept vs what autograd would have kept

Eligible (default): a bfloat16 tensor of >= 2 dims whose last dim is a multiple of 32 (MXFP4 blocks run along
it), with at least ``min_numel`` elements, that is not a parameter (a leaf that requires grad: weights are never
quantized here); ``accept`` replaces that rule (the model's recompute caches, ``fp4moe.model.recompute``).
Anything else is saved as autograd would save it. What is kept is reported to active byte counters
(``accounting.note_saved``). Packing is ``bf16_to_fp4_row`` of the tensor
viewed ``[-1, last]`` (0.53 bytes per element instead of 2); unpacking is ``fp4_to_bf16``, so backward reads
``dequantize(quantize(t))``: the caller opts into that error (the paper's FP4 recompute caches and FP4-stored
activations). The routed experts do the same explicitly (``grouped_expert_mlp``); this context is the generic
mechanism for other saved tensors and for recompute wrappers.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fp4moe_kernels import convert as kops
from fp4moe_kernels.constants import MX_BLOCK
from fp4moe_kernels.formats import MXFP4Tensor

from .accounting import note_saved


@dataclass
class FP4Store:
    """Byte accounting of one ``fp4_saved_tensors`` context: tensors packed, their bf16 bytes, MXFP4 bytes."""

    rule: str = "ceil"
    min_numel: int = 1 << 12
    accept: Optional[Callable[[torch.Tensor], bool]] = None  # replaces the default eligibility rule
    packed: int = 0
    original_bytes: int = 0
    packed_bytes: int = 0

    def eligible(self, t: torch.Tensor) -> bool:
        if self.accept is not None:
            return self.accept(t)
        return (t.dtype == torch.bfloat16 and t.dim() >= 2 and t.shape[-1] % MX_BLOCK == 0
                and t.numel() >= self.min_numel and not (t.is_leaf and t.requires_grad))

    def pack(self, t: torch.Tensor):
        if not self.eligible(t):
            note_saved(t)
            return t
        q = kops.bf16_to_fp4_row(t.detach().reshape(-1, t.shape[-1]).contiguous(), self.rule)
        self.packed += 1
        self.original_bytes += t.numel() * t.element_size()
        self.packed_bytes += q.data.numel() + q.scales.numel()
        note_saved(q.data, q.scales)
        return (q, tuple(t.shape), t.dtype)

    @staticmethod
    def unpack(obj):
        if isinstance(obj, torch.Tensor):
            return obj
        q, shape, dtype = obj
        return kops.fp4_to_bf16(MXFP4Tensor(q.data, q.scales, tuple(q.shape))).reshape(shape).to(dtype)


@contextlib.contextmanager
def fp4_saved_tensors(rule: str = "ceil", min_numel: int = 1 << 12, enabled: bool = True,
                      accept: Optional[Callable[[torch.Tensor], bool]] = None):
    """Context in which autograd keeps eligible saved tensors as MXFP4 (module docstring); yields the
    ``FP4Store`` whose counters say what was packed. ``enabled=False``: a no-op (the same code path for bf16 / fp8
    recipes). ``accept``: which saved tensors to pack, instead of the default rule."""
    store = FP4Store(rule=rule, min_numel=min_numel, accept=accept)
    if not enabled:
        yield store
        return
    with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack):
        yield store


__all__ = ["FP4Store", "fp4_saved_tensors"]
