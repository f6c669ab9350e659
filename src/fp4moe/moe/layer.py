"""A recipe-aware MoE layer for one expert-parallel (EP) group, on plain torch tensors and torch.distributed.

Data flow (docs/recipe.md), for x ``[T, H]`` on each rank of an EP group of size W with E experts (E/W local ones,
rank r owning experts ``r*E/W .. (r+1)*E/W - 1``). Steps 2-6 are :mod:`fp4moe.moe.dispatch` and
:mod:`fp4moe.moe.experts`, the functions megatron's MoE layer runs in training (``fp4moe.model.recipe_moe``), so
given the same weights and routing both give the same outputs and gradients, bit for bit
(tests/model/test_one_moe_path.py); :meth:`MoELayer.forward_routed` is that path for a given routing.

1. router (float32): logits = x W_r^T, scores softmax (or sigmoid), top-k; softmax keeps the top-k
   probabilities as they are, sigmoid renormalises them to sum 1 (DeepSeek-V3). The logits GEMM saves the
   BF16 x itself, not a float32 copy.
2. permutation 1 (``permute_tokens``): the T*k (token, expert) rows sorted stably by global expert id, i.e. by
   destination rank then local expert, tokens in order inside each expert; counts per expert exchanged (int32
   all-to-all, ``expert_splits``). Under dispatch_fp4 each token is quantized once and its k MXFP4 rows gathered
   (``quantize_gather_rows``: the same bits as quantizing the permuted rows, which ``FP4MOE_DISPATCH_QUANTIZE=rows``
   does instead).
3. dispatch (``dispatch_rows``): ``quantized_all_to_all`` of the rows (forward codec mxfp4 when ``dispatch_fp4``,
   else bf16; backward codec ``recipe.backward_a2a``; ``keep_fp4`` when also ``expert_input_fp4``); the routing
   probabilities travel in float32 beside them (``dispatch_probs``).
4. permutation 2: the received rows (ordered by source rank, then local expert) are regrouped expert-major by a
   gather through ``local_expert_permutation`` (skipped when it is the identity: W = 1 or one local expert), go
   through ``routed_experts`` (``grouped_expert_mlp``, weighted SwiGLU; ``expert_recompute``: its recompute), and
   are gathered back to source-major order. Where the expert GEMMs want every expert's rows a multiple of an
   alignment (``row_align``: 128 under DeepGEMM), the rows (BF16, or the dispatched MXFP4) are gathered straight
   into that padded layout by permutation 1 (W = 1) or permutation 2 (W > 1, several local experts) and read back
   by their inverses (``fp4moe.moe.dispatch``, "Rows padded for the expert GEMMs"); the experts then pad nothing
   themselves.
5. combine (``combine_rows``): ``quantized_all_to_all`` with forward codec bf16 (backward ``recipe.backward_a2a``),
   then (``unpermute_tokens``) the k weighted expert outputs of each token are summed in float32 and rounded once
   to bf16, ``T/k`` tokens at a time (the gathered copy alive at once is ``[T, H]``, not ``[T*k, H]``); only the
   rows' token indices are saved for backward.
6. optional shared expert (``shared_expert``): SwiGLU MLP through ``fp8_linear(..., layer_kind='shared_expert')``
   and ``swiglu`` (its input saved as MXFP4 under ``activation_fp4_store``, else BF16).

Within an expert the rows are the tokens of source rank 0, then rank 1, ..., each in token order, which
is exactly the order a single process holding all ranks' tokens (concatenated by rank) sees. Every
quantization is per row (1x128 FP8, MXFP4 blocks of 32) or per 128 rows of one expert (FP8 columns), so an
EP=W run computes bit for bit what one process computes on the concatenated tokens, for every recipe; only
the router weight gradient differs (a sum over ranks of partial float32 sums, left to the data-parallel
reduction of the caller).

Accounting: ``dispatch_stats`` / ``combine_stats`` (``A2AStats``) accumulate the payload bytes of every call.
Works with torch.distributed uninitialised (W = 1) and on gloo or NCCL groups.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.all_to_all import A2AStats, dispatch_quantize_mode
from ..ops.grouped_experts import gemm_row_align
from ..recipe import Recipe
from .dispatch import (chunk_orders, combine_rows, dispatch_probs, dispatch_rows, ep_world, expert_splits,
                       local_expert_permutation, pad_probs, permutation_from_topk, permute_tokens, reorder_rows,
                       row_padding, unpermute_tokens)
from .experts import routed_experts, shared_expert

_BF16 = torch.bfloat16


class _RouterLinear(torch.autograd.Function):
    """logits ``[T, E]`` float32 = x ``[T, H]`` (bf16) @ W^T (float32 ``[E, H]``), computed in float32; saves the
    BF16 x (the layer's input, no copy) instead of autograd's float32 copy of it (4H bytes per token)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.float() @ w.float().t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = (g @ w.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = (g.t() @ x.float()).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


class MoELayer(torch.nn.Module):
    """Top-k routed MoE with grouped SwiGLU experts and an optional shared expert (module docstring).

    hidden H, ffn F (per routed expert), num_experts E (global, divisible by the EP size), top_k, recipe,
    group (EP process group; None: the default group, or W = 1 without torch.distributed), shared_ffn
    (0: no shared expert), score 'softmax' | 'sigmoid', seed (deterministic init of the *global* weights, so
    every EP size gets the same model), params_dtype of the expert weights (bf16 default), init_device (where
    the global weights are drawn: 'cpu' default; a CUDA device is much faster at DeepSeek-V3 sizes and gives
    other values, from CUDA's generator; parameters stay on that device), expert_recompute (the routed experts'
    recompute, fp4moe's ``moe_expert`` module: the forward unchanged, a smaller cache), row_align (the rows every
    expert's block must be a multiple of in the expert GEMMs; None: the GEMM backend's, ``gemm_row_align``, 128
    under DeepGEMM, else 1; an explicit value forces it, e.g. on CPU in tests).

    Attributes read at each forward: ``row_align``; ``pad_in_dispatch`` (default True): the rows are padded to
    ``row_align`` by the gather before the experts and read back by the one after (``fp4moe.moe.dispatch``, "Rows
    padded for the expert GEMMs"); False leaves the padding to ``grouped_expert_mlp`` (a copy each way; the same
    bits).

    Parameters: ``router`` [E, H] float32, ``w1`` [E/W, 2F, H], ``w2`` [E/W, H, F], and with a shared
    expert ``shared_w1`` [2Fs, H], ``shared_w2`` [H, Fs]."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, recipe: Recipe, group=None, *,
                 shared_ffn: int = 0, score: str = "softmax", seed: int = 0, params_dtype=_BF16,
                 init_device="cpu", expert_recompute: bool = False, row_align: Optional[int] = None):
        super().__init__()
        world, rank = ep_world(group)
        if num_experts % world:
            raise ValueError(f"num_experts={num_experts} must be divisible by the EP group size {world}")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score={score!r} must be 'softmax' or 'sigmoid'")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.hidden, self.ffn, self.num_experts, self.top_k = hidden, ffn, num_experts, top_k
        self.recipe, self.group, self.score, self.world, self.rank = recipe, group, score, world, rank
        self.local_experts = num_experts // world
        self.expert_recompute = expert_recompute
        self.row_align, self.pad_in_dispatch = row_align, True
        dev = torch.device(init_device)
        gen = torch.Generator(device=dev).manual_seed(seed)
        rnd = lambda *shape: torch.randn(*shape, generator=gen, device=dev)  # noqa: E731
        router = rnd(num_experts, hidden) * hidden**-0.5
        w1 = rnd(num_experts, 2 * ffn, hidden) * hidden**-0.5
        w2 = rnd(num_experts, hidden, ffn) * ffn**-0.5
        lo, hi = rank * self.local_experts, (rank + 1) * self.local_experts
        self.router = torch.nn.Parameter(router)
        self.w1 = torch.nn.Parameter(w1[lo:hi].to(params_dtype).contiguous())
        self.w2 = torch.nn.Parameter(w2[lo:hi].to(params_dtype).contiguous())
        self.shared_ffn = shared_ffn
        if shared_ffn:
            self.shared_w1 = torch.nn.Parameter((rnd(2 * shared_ffn, hidden) * hidden**-0.5).to(params_dtype))
            self.shared_w2 = torch.nn.Parameter((rnd(hidden, shared_ffn) * shared_ffn**-0.5).to(params_dtype))
        self.quantize_tokens = dispatch_quantize_mode() == "tokens"  # FP4MOE_DISPATCH_QUANTIZE (dispatch_fp4 only)
        self.dispatch_stats = A2AStats()
        self.combine_stats = A2AStats()
        self.last_routing: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (top-k indices, probs) of the last call

    # ------------------------------------------------------------------------------------------ pieces

    def route(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices [T, k] int64, probs [T, k] float32) of the float32 router."""
        logits = _RouterLinear.apply(x2, self.router)
        if self.score == "softmax":
            probs, idx = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        else:
            p, idx = torch.sigmoid(logits).topk(self.top_k, dim=-1)
            probs = p / p.sum(-1, keepdim=True)
        return idx, probs

    def split_sizes(self, idx: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """From this rank's top-k expert ids ``idx [T, k]``: (recv ``[W, El]`` int64 on the CPU: rows source rank s
        sends to each of my local experts; input splits: rows I send to each rank; output splits: rows each
        rank sends me). Exchanges the per-expert counts with one int32 all-to-all (collective for W > 1)."""
        return expert_splits(idx, self.num_experts, self.group, self.world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., H]`` -> ``[..., H]`` bf16: the router, then :meth:`forward_routed`."""
        x2 = x.reshape(-1, x.shape[-1]).to(_BF16)
        idx, probs = self.route(x2)
        return self.forward_routed(x2, idx, probs).reshape(x.shape)

    def forward_routed(self, x: torch.Tensor, idx: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The layer after its router, for a given routing: x ``[..., H]`` (T tokens), top-k expert ids ``idx [T, k]``
        int64 and their probabilities ``probs [T, k]`` (float32; differentiable) -> ``[..., H]`` bf16 (module
        docstring, steps 2-6). Sets ``last_routing``."""
        h = x.shape[-1]
        x2 = x.reshape(-1, h).to(_BF16)
        t, k, w, el, r = x2.shape[0], self.top_k, self.world, self.local_experts, self.recipe
        self.last_routing = (idx.detach(), probs.detach())
        # the [T*k, H] intermediates below die as soon as the next one exists (autograd keeps what it saves): no
        # more than two of them are alive at once in this forward (fp4moe.scale.memory.standalone_moe_layer_peak)
        chunk = -(-t // k)  # the un-permutation's token sums, T/k tokens at a time: a [T, H] gathered copy at once
        perm, row_probs = permutation_from_topk(idx, probs)
        recv, ins, outs = self.split_sizes(idx)
        counts = recv.sum(0).tolist()
        regroup = w > 1 and el > 1  # permutation 2 is the identity otherwise
        # rows padded for the expert GEMMs by the gather before the experts (permutation 1 at W = 1, permutation 2
        # when it runs) and read back by the one after, instead of grouped_expert_mlp's copies; at W = 1 under
        # dispatch_fp4 only when permutation 1 gathers the MXFP4 rows (FP4MOE_DISPATCH_QUANTIZE=tokens): the rows
        # mode quantizes the rows after it (the experts pad them)
        align = gemm_row_align(x2.device, r, self.row_align)
        pad = self.pad_in_dispatch and (regroup or (w == 1 and (not r.dispatch_fp4 or self.quantize_tokens)))
        rp = row_padding(counts, align, x2.device) if pad else None
        if rp is not None:
            counts = list(rp.padded.counts)
            if w == 1:
                perm, row_probs = perm.padded(rp), pad_probs(row_probs, rp)
                ins = outs = [rp.padded.total]
        rows = permute_tokens(x2, perm, r, self.quantize_tokens, chunk_tokens=chunk)
        rows = dispatch_rows(rows, ins, outs, self.group, r, self.dispatch_stats)  # rebinding frees the sent rows
        row_probs = dispatch_probs(row_probs, ins, outs, self.group, w)
        n = int(recv.sum())
        if regroup:
            to_expert, to_source = chunk_orders(w, el)
            p2 = local_expert_permutation(recv.reshape(-1), to_expert, n, x2.device)
            rows, row_probs = reorder_rows(rows, p2, pad=rp), reorder_rows(row_probs, p2, pad=rp)
        y = routed_experts(rows, counts, self.w1, self.w2, row_probs.float(), r, self.expert_recompute,
                           row_align=align)
        del rows, row_probs
        if regroup:
            y = reorder_rows(y, local_expert_permutation(recv.T.reshape(-1), to_source, n, x2.device), unpad=rp)
        y = combine_rows(y, outs, ins, self.group, r, self.combine_stats)
        out = unpermute_tokens(y, perm, chunk_tokens=chunk)
        del y
        if self.shared_ffn:
            out = out + shared_expert(x2, self.shared_w1, self.shared_w2, r)
        return out.reshape(*x.shape[:-1], h)


__all__ = ["MoELayer"]
