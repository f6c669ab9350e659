"""The MoE permutation's row reduction: each token's k rows gathered and summed in one pass.

    gather_sum_rows(g [R, H] bf16, order [T*k] int64, t, k) -> [T, H] bf16
        out[i] = bf16( sum_{j<k} float32(g[order[i*k + j]]) ), the k terms added in order j = 0, 1, ..., k-1
        in float32 and rounded once to nearest-even

It replaces ``g.index_select(0, order).view(t, k, H).sum(1, dtype=float32).to(bf16)`` (fp4moe.ops.all_to_all
``sum_rows_by_token``: the inverse of permutation 1 in the forward, its gradient in the backward), which writes the
gathered ``[T*k, H]`` copy, reads it back for the sum, and writes and reads a float32 ``[T, H]`` before the cast:
here the rows are read once and the output written once. A program owns ``BT`` tokens x ``BH`` channels. NaN stays
NaN (a quiet NaN, 0x7FFF); Inf + (-Inf) is NaN as in float32. Runs under ``TRITON_INTERPRET=1`` on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import bf16_rne_bits

# (tokens per program, channels per program, num_warps); not measured on a GPU yet
TILE = (16, 256, 4)


@triton.jit
def gather_sum_rows_kernel(g_ptr, order_ptr, out_ptr, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                           BH: tl.constexpr):
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    tmask = toks < T
    mask = tmask[:, None] & (cols[None, :] < H)
    acc = tl.zeros([BT, BH], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(order_ptr + toks.to(tl.int64) * K + j, mask=tmask, other=0)
        bits = tl.load(g_ptr + row.to(tl.int64)[:, None] * H + cols[None, :], mask=mask, other=0).to(tl.int32)
        acc += ((bits & 0xFFFF) << 16).to(tl.float32, bitcast=True)  # exact widening (denormals kept)
    out = bf16_rne_bits(acc.to(tl.int32, bitcast=True)).to(tl.int16)
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * H + cols[None, :], out, mask=mask)


def gather_sum_rows(g: torch.Tensor, order: torch.Tensor, t: int, k: int, tile=None) -> torch.Tensor:
    """``[t, H]`` bf16: the k rows of each token of ``g`` ``[R, H]`` (bf16, contiguous) listed by ``order`` (int64
    ``[t*k]``: token i's rows at ``order[i*k : (i+1)*k]``), summed in float32 in that order and rounded once.
    ``tile`` (tokens, channels, num_warps) overrides ``TILE``."""
    if g.dtype != torch.bfloat16 or g.dim() != 2 or not g.is_contiguous():
        raise ValueError(f"gather_sum_rows: g must be a contiguous bfloat16 [R, H] tensor, got {g.dtype} "
                         f"{tuple(g.shape)}")
    if order.dtype != torch.int64 or order.numel() != t * k:
        raise ValueError(f"gather_sum_rows: order must be int64 with t * k = {t * k} entries, got {order.dtype} "
                         f"{tuple(order.shape)}")
    h = g.shape[1]
    out = torch.empty(t, h, dtype=torch.bfloat16, device=g.device)
    if t and h:
        bt, bh, warps = tile or TILE
        grid = (triton.cdiv(t, bt), triton.cdiv(h, bh))
        gather_sum_rows_kernel[grid](g.view(torch.int16), order.contiguous(), out.view(torch.int16), t, h, K=k,
                                     BT=bt, BH=bh, num_warps=warps)
    return out


__all__ = ["TILE", "gather_sum_rows", "gather_sum_rows_kernel"]
