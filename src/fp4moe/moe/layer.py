"""A recipe-aware MoE layer for one expert-parallel (EP) group, on plain torch tensors and torch.distributed.

Data flow (SPEC §4), for x ``[T, H]`` on each rank of an EP group of size W with E experts (E/W local ones,
rank r owning experts ``r*E/W .. (r+1)*E/W - 1``):

1. router (float32): logits = x W_r^T, scores softmax (or sigmoid), top-k; softmax keeps the top-k
   probabilities as they are, sigmoid renormalises them to sum 1 (DeepSeek-V3). The logits GEMM saves the
   BF16 x itself, not a float32 copy.
2. permutation: the T*k (token, expert) pairs sorted stably by global expert id, i.e. by destination rank
   then local expert, tokens in order inside each expert; counts per expert exchanged (int32 all-to-all).
3. dispatch: ``quantized_all_to_all`` of the permuted rows (forward codec mxfp4 when ``dispatch_fp4``, else
   bf16; under dispatch_fp4 each token is quantized once and its k MXFP4 rows gathered, ``quantize_gather_rows``:
   the same bits as quantizing the permuted rows, which ``FP4MOE_DISPATCH_QUANTIZE=rows`` does instead; backward
   codec ``recipe.backward_a2a``; ``keep_fp4`` when also ``expert_input_fp4``); the routing probabilities travel
   in float32 beside them (a plain differentiable all-to-all).
4. the received rows (ordered by source rank, then local expert) are regrouped expert-major and go through
   ``grouped_expert_mlp`` (weighted SwiGLU); then back to source-major order.
5. combine: ``quantized_all_to_all`` with forward codec bf16 (backward ``recipe.backward_a2a``), then the
   k weighted expert outputs of each token are summed (float32, ``index_add``) and cast to bf16; only the
   token indices are saved for backward.
6. optional shared expert: SwiGLU MLP through ``fp8_linear(..., layer_kind='shared_expert')`` and ``swiglu``
   (its input saved as MXFP4 under ``activation_fp4_store``, else BF16).

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
import torch.distributed as dist

from ..ops.all_to_all import A2AStats, dispatch_quantize_mode, permute_rows, quantize_gather_rows, quantized_all_to_all
from ..ops.fp8_linear import fp8_linear
from ..ops.grouped_experts import grouped_expert_mlp
from ..ops.swiglu import swiglu
from ..recipe import Recipe

_BF16 = torch.bfloat16


def _world(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    return 1, 0


class _AllToAllF32(torch.autograd.Function):
    """Differentiable all-to-all of a 1-D float32 tensor (the routing probabilities); identity for W = 1."""

    @staticmethod
    def forward(ctx, x, ins, outs, group, world):
        ctx.meta = (ins, outs, group, world)
        if world == 1:
            return x.clone()
        out = x.new_empty(sum(outs))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=outs, input_split_sizes=ins, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        ins, outs, group, world = ctx.meta
        if world == 1:
            return g.clone(), None, None, None, None
        out = g.new_empty(sum(ins))
        dist.all_to_all_single(out, g.contiguous(), output_split_sizes=ins, input_split_sizes=outs, group=group)
        return out, None, None, None, None


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


class _CombineSum(torch.autograd.Function):
    """out ``[T, H]`` bf16: the k weighted expert rows of each token (``y [T*k, H]``, token ``tok[i]`` for row i)
    summed in float32, rounded once. Saves only ``tok`` (autograd's ``index_add`` would keep a float32 copy of
    y: 4H bytes per routed row); the gradient of row i is the token's gradient, ``g[tok[i]]``."""

    @staticmethod
    def forward(ctx, y, tok, t):
        ctx.save_for_backward(tok)
        out = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
        # in chunks of t rows: the float32 copy of y alive at once is [t, H] (as large as out), not [T*k, H]
        step = max(1, t)
        for i in range(0, y.shape[0], step):
            out.index_add_(0, tok[i:i + step], y[i:i + step].float())
        return out.to(_BF16)

    @staticmethod
    def backward(ctx, g):
        (tok,) = ctx.saved_tensors
        return g.index_select(0, tok).to(_BF16), None, None


class MoELayer(torch.nn.Module):
    """Top-k routed MoE with grouped SwiGLU experts and an optional shared expert (module docstring).

    hidden H, ffn F (per routed expert), num_experts E (global, divisible by the EP size), top_k, recipe,
    group (EP process group; None: the default group, or W = 1 without torch.distributed), shared_ffn
    (0: no shared expert), score 'softmax' | 'sigmoid', seed (deterministic init of the *global* weights, so
    every EP size gets the same model), params_dtype of the expert weights (bf16 default), init_device (where
    the global weights are drawn: 'cpu' default; a CUDA device is much faster at DeepSeek-V3 sizes and gives
    other values, from CUDA's generator; parameters stay on that device).

    Parameters: ``router`` [E, H] float32, ``w1`` [E/W, 2F, H], ``w2`` [E/W, H, F], and with a shared
    expert ``shared_w1`` [2Fs, H], ``shared_w2`` [H, Fs]."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, recipe: Recipe, group=None, *,
                 shared_ffn: int = 0, score: str = "softmax", seed: int = 0, params_dtype=_BF16,
                 init_device="cpu"):
        super().__init__()
        world, rank = _world(group)
        if num_experts % world:
            raise ValueError(f"num_experts={num_experts} must be divisible by the EP group size {world}")
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score={score!r} must be 'softmax' or 'sigmoid'")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.hidden, self.ffn, self.num_experts, self.top_k = hidden, ffn, num_experts, top_k
        self.recipe, self.group, self.score, self.world, self.rank = recipe, group, score, world, rank
        self.local_experts = num_experts // world
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
        w, el = self.world, self.local_experts
        counts = torch.bincount(idx.reshape(-1), minlength=self.num_experts).to(torch.int32)  # [E]
        if w > 1:
            recv = torch.empty_like(counts)
            dist.all_to_all_single(recv, counts, group=self.group)  # [W * El]: source s's counts for my experts
        else:
            recv = counts
        recv = recv.view(w, el).to(device="cpu", dtype=torch.int64)  # one host sync for all the split sizes
        return recv, counts.view(w, el).sum(1).tolist(), recv.sum(1).tolist()

    def _shared(self, x2: torch.Tensor) -> torch.Tensor:
        hmat = fp8_linear(x2, self.shared_w1, self.recipe, layer_kind="shared_expert")
        z = swiglu(hmat, self.recipe, "shared_expert")
        return fp8_linear(z, self.shared_w2, self.recipe, layer_kind="shared_expert")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, h = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, h).to(_BF16)
        t, k, w, el = x2.shape[0], self.top_k, self.world, self.local_experts
        idx, probs = self.route(x2)
        self.last_routing = (idx.detach(), probs.detach())
        # ---- permutation by global expert (= destination rank, then local expert)
        flat_e = idx.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        tok = torch.arange(t, device=x2.device).repeat_interleave(k)[order]
        r = self.recipe
        xp = (quantize_gather_rows(x2, tok, r.scale_rule) if r.dispatch_fp4 and self.quantize_tokens
              else x2[tok])
        pp = probs.reshape(-1)[order]
        recv, ins, outs = self.split_sizes(idx)
        # ---- dispatch
        keep = r.dispatch_fp4 and r.expert_input_fp4
        xin = quantized_all_to_all(
            xp, ins, outs, self.group, "mxfp4" if r.dispatch_fp4 else "bf16", r.backward_a2a,
            keep_fp4=keep, stats=self.dispatch_stats, rule=r.scale_rule,
        )
        # the [T*k, H] intermediates below die as soon as the next one exists (autograd keeps what it saves): no
        # more than two of them are alive at once in this forward (fp4moe.scale.calibration's layer peak)
        del xp
        pin = _AllToAllF32.apply(pp, ins, outs, self.group, w)
        # ---- regroup source-major -> expert-major
        chunk = recv.reshape(-1).tolist()  # chunk (s, j) at position s*El + j
        starts = [0]
        for c in chunk[:-1]:
            starts.append(starts[-1] + c)
        emaj = [s * el + j for j in range(el) for s in range(w)]
        perm = torch.cat([torch.arange(starts[i], starts[i] + chunk[i]) for i in emaj]) if emaj \
            else torch.zeros(0, dtype=torch.int64)
        perm = perm.to(torch.int64).to(x2.device)
        local_counts = recv.sum(0).tolist()
        x_e = permute_rows(xin, perm)
        del xin
        y_e = grouped_expert_mlp(x_e, local_counts, self.w1, self.w2, pin[perm], r)
        del x_e
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        y_src = y_e[inv]
        del y_e
        # ---- combine and un-permute
        y_back = quantized_all_to_all(y_src, outs, ins, self.group, "bf16", r.backward_a2a, stats=self.combine_stats)
        del y_src
        out = _CombineSum.apply(y_back, tok, t)
        del y_back
        if self.shared_ffn:
            out = out + self._shared(x2)
        return out.reshape(*lead, h)


__all__ = ["MoELayer"]
