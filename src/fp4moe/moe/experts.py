"""The MoE layer's experts under a precision recipe, shared by the standalone layer (:mod:`fp4moe.moe.layer`) and the
megatron-core adapter (:mod:`fp4moe.model.recipe_moe`).

:func:`routed_experts`: the grouped SwiGLU experts of one rank (``fp4moe.ops.grouped_experts.grouped_expert_mlp``,
routing probabilities applied after the SwiGLU, before fc2: megatron's ``per_token_scale`` order), optionally with
the recompute of :class:`_ExpertRecompute`. :func:`shared_expert`: the shared expert, ``fp8_linear`` (layer_kind
'shared_expert') -> ``swiglu`` (input stored MXFP4 under ``activation_fp4_store``) -> ``fp8_linear``.

Weights: fc1 ``[2F, H]`` (gate rows 0..F-1, up rows F..2F-1), fc2 ``[H, F]``, per expert; the routed experts take E
of each (a sequence, read where each lies, or one ``[E, 2F, H]`` / ``[E, H, F]`` tensor).
"""
from __future__ import annotations

from typing import Optional

import torch

from fp4moe_kernels import convert as kops
from fp4moe_kernels.formats import MXFP4Tensor

from ..ops.all_to_all import DispatchedMXFP4
from ..ops.fp8_linear import fp8_linear
from ..ops.grouped_experts import function_weights, grouped_expert_mlp, weight_halves
from ..ops.swiglu import swiglu
from ..recipe import Recipe

_BF16 = torch.bfloat16


class _ExpertRecompute(torch.autograd.Function):
    """Recompute of the routed experts (fp4moe recompute module ``moe_expert``): forward runs
    ``grouped_expert_mlp`` without saving anything but its inputs (the *recompute cache*: the received rows,
    the probs, the weights by reference), backward runs it again with autograd and back-propagates. No
    dispatch re-run. Cache modes (``mode``):

    ``'fp4'``       rows arrived MXFP4 (``DispatchedMXFP4``): x is the stride-0 anchor; data + scales are cached.
    ``'bf16'``      rows are BF16 and cached as they are (bf16 / fp8 recipes): recompute is bit-exact.
    ``'bf16_fp4'``  rows are BF16 (mxfp4 recipe without dispatch_fp4/expert_input_fp4): the forward uses x, the
                    cache is MXFP4 of x (data + scales) and the backward recomputes from its dequantized rows.

    Inputs: (x, data, scales, probs, counts, recipe, mode, row_align, *weights): w1 ``[E, 2F, H]`` and w2
    ``[E, H, F]`` (their ``[E, N, K]`` gradients come back whole), or the E fc1 then the E fc2 weights
    (``grouped_experts.function_weights``).
    Rows the dispatch padded for the GEMMs (``fp4moe.moe.dispatch.row_padding``) are cached padded."""

    @staticmethod
    def forward(ctx, x, data, scales, probs, counts, recipe, mode, row_align, *weights):
        ctx.meta = (counts, recipe, mode, x.dtype, tuple(x.shape), row_align)
        n = len(counts)
        xin = DispatchedMXFP4(data, scales, tuple(x.shape), x) if mode == "fp4" else x
        with torch.no_grad():
            y = grouped_expert_mlp(xin, counts, *weight_halves(weights, n), probs, recipe, row_align=row_align)
        cache = (x,) if mode == "bf16" else (data, scales)
        ctx.save_for_backward(*cache, probs, *weights)  # the weights by reference
        return y

    @staticmethod
    def backward(ctx, dy):
        counts, recipe, mode, x_dtype, x_shape, row_align = ctx.meta
        n = len(counts)
        data = scales = None
        saved = ctx.saved_tensors
        if mode == "bf16":
            (x, probs), weights = saved[:2], saved[2:]
        else:
            (data, scales, probs), weights = saved[:3], saved[3:]
            if mode == "fp4":
                x = torch.zeros((), dtype=x_dtype, device=data.device).expand(x_shape)
            else:
                x = kops.fp4_to_bf16(MXFP4Tensor(data, scales, x_shape)).to(x_dtype)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[3], *ctx.needs_input_grad[8:])
        ins = [t.detach().requires_grad_(need) for t, need in zip((x, probs, *weights), needs)]
        with torch.enable_grad():
            xin = DispatchedMXFP4(data, scales, x_shape, ins[0]) if mode == "fp4" else ins[0]
            y = grouped_expert_mlp(xin, counts, *weight_halves(ins[2:], n), ins[1], recipe, row_align=row_align)
        need = [t for t in ins if t.requires_grad]
        grads = iter(torch.autograd.grad(y, need, dy, allow_unused=True) if need else ())
        gx, gp, *gws = (next(grads) if t.requires_grad else None for t in ins)
        return (gx, None, None, gp, None, None, None, None, *gws)


def routed_experts(x, counts: list[int], w1, w2, probs: torch.Tensor, recipe: Recipe,
                   recompute: bool = False, *, row_align: Optional[int] = None) -> torch.Tensor:
    """The local experts on their rows: x ``[R, H]`` (a tensor, or a ``DispatchedMXFP4`` from the dispatch) in
    expert-major order, ``counts[e]`` rows for expert e (ints summing to R), w1 / w2 the E fc1 / fc2 weights (module
    docstring), probs ``[R]`` float32 -> ``[R, H]`` bf16. ``row_align``: ``grouped_expert_mlp``'s (None: the GEMM
    backend's); rows the dispatch already padded to it (counts all multiples of it) are not padded again.

    ``recompute``: :class:`_ExpertRecompute`, the forward unchanged; its cache is the dispatched MXFP4 ('fp4') when x
    is one, MXFP4 of the BF16 rows under the mxfp4 recipe ('bf16_fp4'), else the BF16 rows ('bf16', bit-exact).
    Under ``torch.no_grad`` (evaluation) no backward comes: the plain forward, nothing cached."""
    if not recompute or not torch.is_grad_enabled():
        # under no_grad a DispatchedMXFP4 also has no gradient anchor for _ExpertRecompute to take
        return grouped_expert_mlp(x, counts, w1, w2, probs, recipe, row_align=row_align)
    ws = function_weights(w1, w2)  # two [E, N, K] tensors stay whole
    if isinstance(x, DispatchedMXFP4):
        anchor = x.grad_anchor
        if anchor is None:  # the sender's rows need no gradient: a stride-0 stand-in carries dtype and shape
            anchor = torch.zeros((), dtype=_BF16, device=x.data.device).expand(x.shape)
        return _ExpertRecompute.apply(anchor, x.data, x.scales, probs, counts, recipe, "fp4", row_align, *ws)
    if recipe.name == "mxfp4":  # cache as MXFP4 (_ExpertRecompute 'bf16_fp4')
        q = kops.bf16_to_fp4_row(x.detach().to(_BF16), recipe.scale_rule)
        return _ExpertRecompute.apply(x, q.data, q.scales, probs, counts, recipe, "bf16_fp4", row_align,
                                    *ws)
    return _ExpertRecompute.apply(x, None, None, probs, counts, recipe, "bf16", row_align, *ws)


def shared_expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """The shared expert: x ``[T, H]`` -> ``[T, H]`` bf16 with w1 ``[2Fs, H]``, w2 ``[H, Fs]`` (SwiGLU, no biases)."""
    hmat = fp8_linear(x, w1, recipe, layer_kind="shared_expert").to(_BF16)
    z = swiglu(hmat, recipe, "shared_expert")
    return fp8_linear(z, w2, recipe, layer_kind="shared_expert")


__all__ = ["routed_experts", "shared_expert"]
