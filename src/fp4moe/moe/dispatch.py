"""The MoE data path's row operations, shared by the standalone layer (:mod:`fp4moe.moe.layer`) and the megatron-core
adapter (:mod:`fp4moe.model.recipe_moe`): router output -> permutation 1 -> dispatch -> permutation 2 -> (experts,
:mod:`fp4moe.moe.experts`) -> un-permutation 2 -> combine -> un-permutation 1. Plain torch + torch.distributed.

Layouts (one rank of an expert-parallel group of W ranks, E experts, El = E/W local ones, T tokens, top-k, H hidden):

=====================  ==========================================================================================
tokens                 ``[T, H]`` (BF16), the layer's input flattened
routed rows            ``[R = T*k, H]``: permutation 1 of the tokens, sorted by global expert id (= destination rank,
                       then local expert), tokens ascending inside each expert (megatron's ``permute`` order)
received rows          ``[R', H]`` after the dispatch all-to-all: source rank major, local expert minor
expert-major rows      the received rows after permutation 2: local expert major, source rank minor; what the
                       grouped experts take (``counts[e]`` rows of expert e)
=====================  ==========================================================================================

Permutation 1 is a gather (:func:`permute_tokens`); its inverse sums each token's k rows in float32 and rounds once
(:func:`unpermute_tokens`, ``sum_rows_by_token``), no ``index_add_`` atomics. Under ``recipe.dispatch_fp4`` the
tokens are quantized once and their MXFP4 rows gathered (``quantize_gather_rows``; the same bits as quantizing the
routed rows, which ``FP4MOE_DISPATCH_QUANTIZE=rows`` does instead). Permutation 2 and its inverse are gathers through
index tensors built on the device from the W*El chunk sizes (:func:`local_expert_permutation`).

Rows padded for the expert GEMMs: where the GEMM backend wants every expert's rows a multiple of an alignment
(``gemm_row_align``: 128 under ``kernels.grouped_gemm=deepgemm``), the gather right before the experts writes the
rows straight into that padded layout (probability 0 on the padding: :func:`row_padding`,
:meth:`TokenPermutation.padded`, :func:`pad_probs`), the experts get the padded counts (``grouped_expert_mlp`` then
pads nothing itself), and the gather right after them reads the real rows of their padded output. That gather is
permutation 1 and its inverse when W = 1, permutation 2 and its inverse (``reorder_rows(..., pad=/unpad=)``) when
W > 1 with more than one local expert; each backward reads the real rows only and gives the padding rows a zero
gradient. The rows: BF16 (zero rows on the padding), or under ``dispatch_fp4`` the ``DispatchedMXFP4`` (zero codes
and zero scale bytes, the bits ``grouped_expert_mlp``'s own padding writes): permutation 1 quantizes each token once
and gathers its k MXFP4 rows into the padded layout (``quantize_gather_rows(..., pad=)``; the gradient anchor's
per-token sums read the real rows), permutation 2 reorders the received MXFP4 rows into it (``permute_rows(...,
pad=, back=)``); the experts' recompute caches the padded MXFP4 rows. This saves a copy of the rows and of the
output on the way in and out, and their adjoints in the backward; the results are bit for bit those of the experts
padding on their own. Not at W > 1 with one local expert (no gather there), nor at W = 1 under ``dispatch_fp4``
with ``FP4MOE_DISPATCH_QUANTIZE=rows`` (the rows are quantized after permutation 1: the experts pad them). At W = 1
the (local) all-to-alls then carry, and count, the padded rows.

Wire formats (:func:`dispatch_rows`, :func:`combine_rows`): ``fp4moe.ops.all_to_all.quantized_all_to_all``; dispatch
MXFP4 when ``recipe.dispatch_fp4`` (kept MXFP4 on the receiver, a ``DispatchedMXFP4``, when also
``expert_input_fp4``) else BF16, combine BF16; gradients with ``recipe.backward_a2a``. The routing probabilities
travel in their own dtype beside the rows (:func:`dispatch_probs`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fp4moe_kernels.formats import Segments, host_to_device

from ..ops.all_to_all import (A2AStats, DispatchedMXFP4, gather_sum_fused, inverse_permutation, permute_rows,
                              quantize_gather_rows, quantized_all_to_all, sum_rows_by_token)
from ..ops.grouped_experts import RowPadding, map_rows, padded_rows
from ..recipe import Recipe


def ep_world(group) -> tuple[int, int]:
    """(size, rank) of the expert-parallel ``group`` (None: the default group); (1, 0) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


def as_int_list(t) -> list[int]:
    """Split sizes / token counts (a tensor, or a sequence of ints) as a list of Python ints."""
    return [int(v) for v in (t.tolist() if hasattr(t, "tolist") else t)]


# ------------------------------------------------------------------------------------------ permutation 1


@dataclass(frozen=True)
class TokenPermutation:
    """Permutation 1 under dropless top-k (every token has exactly k rows).

    token   ``[R]`` int64: the token of each routed row (megatron's ``reversed_local_input_permutation_mapping``)
    order   ``[R]`` int64: the routed rows grouped by token (token 0's k rows first, experts ascending within)
    tokens  T; ``k``: rows per token (R = T*k)
    pad     None, or (:meth:`padded`) int64 ``[Rp - R]``: the padding rows of a padded layout of ``Rp`` rows (then
            ``token`` is ``[Rp]``, with any token on the padding, and ``order`` indexes the padded rows)"""

    token: torch.Tensor
    order: torch.Tensor
    tokens: int
    k: int
    pad: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, token: torch.Tensor, tokens: int, k: int) -> "TokenPermutation":
        """From the rows' tokens (each token appearing exactly k times, ascending inside each expert)."""
        return cls(token, torch.argsort(token, stable=True), tokens, k)

    def padded(self, rp: RowPadding) -> "TokenPermutation":
        """This permutation composed with the row padding ``rp`` of its rows (every expert's rows padded to the GEMM
        backend's alignment, :func:`row_padding`): padded row j is token ``token[rp.src[j]]`` (zero on ``rp.pad``),
        and token t's k rows are the padded rows ``rp.dst[order]``. :func:`permute_tokens` then gathers the tokens
        straight into the padded layout and :func:`unpermute_tokens` reads the padded rows, instead of a gather of
        the rows and a second one of the padded rows (``grouped_expert_mlp``'s own padding) each way."""
        if self.pad is not None:
            raise ValueError("this permutation is already padded")
        return TokenPermutation(self.token.index_select(0, rp.src), rp.dst.index_select(0, self.order), self.tokens,
                                self.k, rp.pad)


def permutation_from_topk(idx: torch.Tensor, probs: torch.Tensor) -> tuple[TokenPermutation, torch.Tensor]:
    """(permutation 1, the routed rows' probabilities ``[R]``) from the top-k expert ids ``idx [T, k]`` (int64) and
    probabilities ``probs [T, k]``: the rows sorted stably by expert id, so tokens ascend inside each expert."""
    t, k = idx.shape
    by_expert = torch.argsort(idx.reshape(-1), stable=True)  # flat (token, choice) index of each routed row
    return TokenPermutation.of(by_expert // k, t, k), probs.reshape(-1).index_select(0, by_expert)


def permutation_from_routing_map(routing_map: torch.Tensor, probs: torch.Tensor,
                                 k: int) -> tuple[Optional[TokenPermutation], torch.Tensor, torch.Tensor]:
    """megatron's permutation 1 (``moe_utils.permute`` without drop/pad) from ``routing_map [T, E]`` (bool) and the
    dense ``probs [T, E]``: (permutation, or None when some token has other than k rows; the rows' tokens ``[R]``;
    the rows' probabilities ``[R]``). The same rows as :func:`permutation_from_topk` for the same routing."""
    t = routing_map.shape[0]
    mask = routing_map.bool().T.contiguous()  # [E, T], expert-major as megatron's permute
    token = torch.arange(t, device=mask.device).unsqueeze(0).expand(mask.shape[0], -1).masked_select(mask)
    row_probs = probs.T.contiguous().masked_select(mask)
    perm = TokenPermutation.of(token, t, k) if token.numel() == t * k else None
    return perm, token, row_probs


def _gather_padded(x: torch.Tensor, index: torch.Tensor, pad: Optional[torch.Tensor]) -> torch.Tensor:
    """``x[index]`` with the rows ``pad`` (None: none) zeroed."""
    out = x.index_select(0, index)
    return out if pad is None or pad.numel() == 0 else out.index_fill_(0, pad, 0)


class _PermuteTokens(torch.autograd.Function):
    """tokens ``[T, H]`` -> rows ``[T*k, H]`` = ``tokens[token]`` (padded: ``[Rp, H]`` with the rows ``pad`` zeroed).
    Backward: each token's k row gradients gathered through ``order`` and summed in float32 (``sum_rows_by_token``),
    instead of autograd's ``index_add_`` with atomics (an H200 profile measured megatron's permute/unpermute atomics
    at ~6 % of an mxfp4 step); the padding rows' gradients are not read."""

    @staticmethod
    def forward(ctx, tokens, token, order, k: int, chunk: Optional[int], pad: Optional[torch.Tensor] = None):
        ctx.save_for_backward(order)
        ctx.k, ctx.t, ctx.chunk = k, tokens.shape[0], chunk
        return _gather_padded(tokens, token, pad)

    @staticmethod
    def backward(ctx, g):
        (order,) = ctx.saved_tensors
        return _sum_by_token(g, order, ctx.t, ctx.k, ctx.chunk), None, None, None, None, None


class _UnpermuteTokens(torch.autograd.Function):
    """rows ``[T*k, H]`` (padded: ``[Rp, H]``) -> tokens ``[T, H]``: each token's k rows summed in float32 and
    rounded once to the rows' dtype (megatron's unpermute without probs scatter-adds in the rows' dtype). Backward: a
    gather, ``g[token]``, with the padding rows zeroed (their gradient must be zero: the experts' wgrad quantizes dy
    in 1x128 columns of 128 rows of one expert, padding included)."""

    @staticmethod
    def forward(ctx, rows, token, order, k: int, t: int, chunk: Optional[int], pad: Optional[torch.Tensor] = None):
        ctx.save_for_backward(token, *(() if pad is None else (pad,)))
        return _sum_by_token(rows, order, t, k, chunk)

    @staticmethod
    def backward(ctx, g):
        token, *pad = ctx.saved_tensors
        return _gather_padded(g, token, pad[0] if pad else None), None, None, None, None, None, None


def _sum_by_token(g: torch.Tensor, order: torch.Tensor, t: int, k: int, chunk: Optional[int]) -> torch.Tensor:
    """``sum_rows_by_token(g, order, t, k)``; with ``chunk`` tokens at a time, so that the gathered copy alive at once
    is ``[chunk*k, H]`` instead of ``[T*k, H]``. Each token's k rows are reduced by the same ``sum(1, float32)`` over
    a ``[c, k, H]`` view either way (the order of its k additions depends on k only), so the bits are the same. The
    one-kernel sum (``gather_sum_fused``) makes no gathered copy: it takes every token at once."""
    if chunk is None or chunk >= t or gather_sum_fused(g):
        return sum_rows_by_token(g, order, t, k)
    out = torch.empty((t, g.shape[1]), dtype=g.dtype, device=g.device)
    for lo in range(0, t, chunk):
        hi = min(t, lo + chunk)
        out[lo:hi].copy_(g.index_select(0, order[lo * k:hi * k]).view(hi - lo, k, g.shape[1]).sum(1, dtype=torch.float32))
    return out


def permute_tokens(tokens: torch.Tensor, perm: TokenPermutation, recipe: Recipe, quantize_tokens: bool = True, *,
                   chunk_tokens: Optional[int] = None):
    """Permutation 1: tokens ``[T, H]`` -> routed rows ``[T*k, H]`` in ``perm``'s order, ready for
    :func:`dispatch_rows`. Under ``recipe.dispatch_fp4`` with ``quantize_tokens`` (``FP4MOE_DISPATCH_QUANTIZE=tokens``,
    the default) a ``DispatchedMXFP4``: each token quantized once and its k MXFP4 rows gathered (the same bits as
    quantizing the BF16 rows; k times fewer rows to quantize, a quarter of the bytes to permute); else the BF16 rows.
    ``chunk_tokens``: the gradient's per-token sums are made that many tokens at a time (:func:`unpermute_tokens`).
    A padded ``perm`` (:meth:`TokenPermutation.padded`) gives the padded rows ``[Rp, H]``: zero rows on the padding
    (BF16), or zero codes with zero scale bytes (the ``DispatchedMXFP4``: the experts' own padding's bits); the
    padding rows' gradients are not read."""
    if recipe.dispatch_fp4 and quantize_tokens:
        return quantize_gather_rows(tokens, perm.token, recipe.scale_rule, order=perm.order, k=perm.k, pad=perm.pad)
    return _PermuteTokens.apply(tokens, perm.token, perm.order, perm.k, chunk_tokens, perm.pad)


def unpermute_tokens(rows: torch.Tensor, perm: TokenPermutation, *, chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """The inverse of permutation 1: the combined rows ``[T*k, H]`` (``perm``'s order) -> ``[T, H]`` in the rows'
    dtype, each token's k rows summed in float32 and rounded once. Saves only ``perm.token`` for backward.
    ``chunk_tokens`` (None: all at once): sum that many tokens at a time; the same bits, and a gathered copy of
    ``[chunk_tokens*k, H]`` alive at once instead of ``[T*k, H]``. A padded ``perm`` reads the padded rows ``[Rp, H]``
    (the padding rows are not read, and get a zero gradient)."""
    return _UnpermuteTokens.apply(rows, perm.token, perm.order, perm.k, perm.tokens, chunk_tokens, perm.pad)


# ------------------------------------------------------------------------------------------ row padding


def row_padding(counts, align: int, device) -> Optional[RowPadding]:
    """The :class:`~fp4moe.ops.grouped_experts.RowPadding` of rows grouped by expert, ``counts[e]`` rows of expert e
    (host ints or a tensor), every expert's rows padded to a multiple of ``align`` (the GEMM backend's,
    ``gemm_row_align``: 128 under DeepGEMM); None when nothing needs padding (``align`` <= 1, or every count a
    multiple of it)."""
    counts = as_int_list(counts)
    if align <= 1 or all(c % align == 0 for c in counts):
        return None
    return padded_rows(Segments(tuple(counts)), align, device)


def pad_probs(probs: torch.Tensor, rp: RowPadding) -> torch.Tensor:
    """The rows' probabilities ``[R]`` in the padded layout ``[Rp]`` of ``rp``, 0 on the padding; differentiable
    (the gradient: that of the real rows)."""
    return map_rows(probs, rp.rows, rp.unpad)


# ------------------------------------------------------------------------------------------ splits, permutation 2


def expert_splits(idx: torch.Tensor, num_experts: int, group, world: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """From this rank's top-k expert ids ``idx [T, k]``: (recv ``[W, El]`` int64 on the CPU: the rows source rank s
    sends to each of my local experts; input splits: rows I send to each rank; output splits: rows each rank sends
    me). Exchanges the per-expert counts with one int32 all-to-all (collective for W > 1); one host sync."""
    el = num_experts // world
    counts = torch.bincount(idx.reshape(-1), minlength=num_experts).to(torch.int32)  # [E]
    if world > 1:
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=group)  # [W * El]: source s's counts for my experts
    else:
        recv = counts
    recv = recv.view(world, el).to(device="cpu", dtype=torch.int64)
    return recv, counts.view(world, el).sum(1).tolist(), recv.sum(1).tolist()


def chunk_orders(world: int, local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(to_expert ``[W*El]``, to_source ``[W*El]``): the chunk orders of permutation 2 and its inverse, megatron's
    ``sort_input_by_local_experts`` and ``restore_output_by_local_experts``. Chunk (s, e) of the received rows is
    chunk ``s*El + e``; of the expert-major rows, chunk ``e*W + s``."""
    ids = torch.arange(world * local_experts)
    return ids.reshape(-1, local_experts).T.reshape(-1), ids.reshape(local_experts, -1).T.reshape(-1)


def local_expert_permutation(sizes: torch.Tensor, order: torch.Tensor, rows: int, device) -> torch.Tensor:
    """Permutation 2 (or its inverse) as a gather index: the rows arrive as ``C`` chunks of ``sizes[c]`` rows and
    leave in chunk order ``order``. Returns ``perm`` ``[rows]`` int64 on ``device`` with ``out = rows_in[perm]``.
    Permutation 2: ``sizes`` = recv ``[W, El]`` flattened, ``order`` = ``chunk_orders(W, El)[0]``; its inverse:
    ``recv.T`` flattened and ``chunk_orders(W, El)[1]``. Built with device ops from the ``C`` chunk sizes (no
    per-chunk host loop, no ``rows``-long host tensor); ``rows`` = ``sizes.sum()`` is passed in so that nothing
    waits on the device."""
    sizes, order = (host_to_device(torch.as_tensor(t).to(torch.int64), device) for t in (sizes, order))
    starts = torch.cumsum(sizes, 0) - sizes                 # where each chunk begins in the input
    out_sizes, out_starts = sizes[order], starts[order]
    out_offsets = torch.cumsum(out_sizes, 0) - out_sizes     # where each chunk begins in the output
    chunk = torch.repeat_interleave(torch.arange(order.numel(), device=device), out_sizes, output_size=rows)
    return torch.arange(rows, device=device) + (out_starts - out_offsets)[chunk]


class _ReorderRows(torch.autograd.Function):
    """``x[perm]`` for a permutation ``perm``; backward a gather through the inverse permutation (no zero fill, no
    scatter-add as autograd's ``index_select`` backward)."""

    @staticmethod
    def forward(ctx, x, perm):
        ctx.save_for_backward(perm)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, g):
        (perm,) = ctx.saved_tensors
        return g.index_select(0, inverse_permutation(perm)), None


def reorder_rows(x, perm: torch.Tensor, *, pad: Optional[RowPadding] = None, unpad: Optional[RowPadding] = None):
    """Rows ``x[perm]`` (``perm`` a permutation of ``range(len(x))``, int64 on x's device) of a tensor ``[R, ...]``
    (the rows or their probabilities) or of a ``DispatchedMXFP4`` (data/scales gathered, the gradient anchor
    re-made: ``permute_rows``). Differentiable; the gradient is gathered back.

    Composed with a row padding, one gather each way: ``pad`` (the padding of the result's rows, :func:`row_padding`
    of the expert-major counts) gives ``x[perm]`` in the padded layout ``[Rp, ...]`` (zero rows on the padding, or
    for a ``DispatchedMXFP4`` zero codes and zero scale bytes, the experts' own padding's bits; permutation 2 writing
    the experts' padded input); ``unpad`` (tensors only: the padding of x's rows) gives ``x_real[perm]`` of the real
    rows of a padded x (the inverse permutation 2 reading the experts' padded output; the gradient is zero on the
    padding)."""
    if pad is not None or unpad is not None:
        if (isinstance(x, DispatchedMXFP4) and unpad is not None) or (pad is not None and unpad is not None):
            raise ValueError("reorder_rows pads a tensor's or a DispatchedMXFP4's rows, or unpads a tensor's, not both")
        if pad is not None:  # out[j] = x[perm[src[j]]]; gradient[i] = g[dst[perm^-1[i]]]
            index = perm.index_select(0, pad.src)
            if isinstance(x, DispatchedMXFP4):
                back = pad.dst.index_select(0, inverse_permutation(perm)) if x.grad_anchor is not None else None
                return permute_rows(x, index, pad=pad.pad, back=back)
            return map_rows(x, lambda v: _gather_padded(v, index, pad.pad),
                            lambda g: g.index_select(0, pad.dst.index_select(0, inverse_permutation(perm))))
        index = unpad.dst.index_select(0, perm)  # out[i] = x[dst[perm[i]]]; gradient[j] = g[perm^-1[src[j]]]
        return map_rows(x, lambda v: v.index_select(0, index),
                        lambda g: _gather_padded(g, inverse_permutation(perm).index_select(0, unpad.src), unpad.pad))
    if isinstance(x, DispatchedMXFP4):
        return permute_rows(x, perm)
    return _ReorderRows.apply(x, perm)


# ------------------------------------------------------------------------------------------ all-to-alls


def dispatch_rows(rows, input_splits, output_splits, group, recipe: Recipe, stats: Optional[A2AStats] = None):
    """The dispatch all-to-all: routed rows ``[R, H]`` (BF16, or the ``DispatchedMXFP4`` of :func:`permute_tokens`),
    grouped by destination rank with ``input_splits[r]`` rows for rank r -> received rows ``[sum(output_splits), H]``:
    a tensor, or a ``DispatchedMXFP4`` under ``dispatch_fp4`` + ``expert_input_fp4``. Wire: MXFP4 under
    ``dispatch_fp4`` else BF16; gradient ``recipe.backward_a2a``; bytes added to ``stats``."""
    return quantized_all_to_all(rows, input_splits, output_splits, group, "mxfp4" if recipe.dispatch_fp4 else "bf16",
                                recipe.backward_a2a, keep_fp4=recipe.dispatch_fp4 and recipe.expert_input_fp4,
                                stats=stats, rule=recipe.scale_rule)


def combine_rows(rows: torch.Tensor, input_splits, output_splits, group, recipe: Recipe,
                 stats: Optional[A2AStats] = None) -> torch.Tensor:
    """The combine all-to-all: expert outputs ``[R', H]`` in received-row order back to their tokens' ranks (pass the
    dispatch's output splits as ``input_splits`` and its input splits as ``output_splits``). BF16 forward,
    ``recipe.backward_a2a`` backward."""
    return quantized_all_to_all(rows, input_splits, output_splits, group, "bf16", recipe.backward_a2a, stats=stats)


class _ProbsAllToAll(torch.autograd.Function):
    """Differentiable all-to-all of the routed rows' probabilities ``[R]`` (any dtype); the splits swap in backward."""

    @staticmethod
    def forward(ctx, p, ins, outs, group):
        ctx.meta = (ins, outs, group)
        out = p.new_empty(sum(outs))
        dist.all_to_all_single(out, p.contiguous(), output_split_sizes=outs, input_split_sizes=ins, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        ins, outs, group = ctx.meta
        out = g.new_empty(sum(ins))
        dist.all_to_all_single(out, g.contiguous(), output_split_sizes=ins, input_split_sizes=outs, group=group)
        return out, None, None, None


def dispatch_probs(probs: torch.Tensor, input_splits, output_splits, group, world: int) -> torch.Tensor:
    """The routed rows' probabilities ``[R]`` sent beside the rows (the same splits); ``probs`` itself when W = 1."""
    if world == 1:
        return probs
    return _ProbsAllToAll.apply(probs, as_int_list(input_splits), as_int_list(output_splits), group)


# host_to_device: fp4moe_kernels.formats' queued host-to-GPU copy, re-exported for fp4moe.model (which imports no
# kernels)
__all__ = ["TokenPermutation", "as_int_list", "chunk_orders", "combine_rows", "dispatch_probs", "dispatch_rows",
           "ep_world", "expert_splits", "host_to_device", "inverse_permutation", "local_expert_permutation",
           "pad_probs", "permutation_from_routing_map", "permutation_from_topk", "permute_tokens", "reorder_rows",
           "row_padding", "unpermute_tokens"]
