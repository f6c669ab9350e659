"""Fused SwiGLU (optionally weighted per row by routing probabilities), forward and backward, in one pass each.

The formulas are those of ``fp4moe.ops.swiglu.swiglu_math`` / ``swiglu_math_backward`` (float32 math, BF16 in
and out); unfused, they cost about a dozen full-size float32 tensors per call (casts, silu, products, cat), which
a profile of the H200 proxy measured at 19 % of the GPU time (results/train_proxy/README.md, "Profile"). Here every
element is read once and written once:

    forward   h [T, 2F] bf16 (gate 0..F-1, up F..2F-1), probs [T] f32 or none -> z [T, F] bf16
              z = silu(g) * u (* p)
    backward  h, dz [T, F] bf16, probs -> dh [T, 2F] bf16, dprobs [T] f32 (with probs)
              s = sigmoid(g), silu = g*s, a = dz (* p), dg = a*u*(s*(1 + g*(1 - s))), du = a*silu,
              dprobs = sum_f dz*silu*u

Layouts: row-major contiguous. ``T`` any size >= 0, ``F`` any size >= 1 (column tails are masked; ``F`` is a
compile-time constant: one compiled variant per expert / shared / dense FFN width). The values
equal the unfused torch formula up to float32 rounding (exp and the order of the dprobs sum), i.e. BF16 outputs
(rounded to nearest-even by integer arithmetic, ``_bf16_bits``) equal it or differ by one BF16 unit in the last
place; tests/kernels/test_swiglu_kernel.py checks both against
a float64 evaluation. Runs under ``TRITON_INTERPRET=1`` on CPU tensors (tests).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# (rows per program, columns per program, num_warps); forward tiles are 2-D, backward programs own whole rows
# (they sum dprobs over F) and loop over the columns.
FWD_TILE = (32, 128, 4)
BWD_TILE = (16, 128, 4)


@triton.jit
def _bf16_bits(x):
    """float32 -> the int16 bits of its BF16 rounding, nearest-even (as torch's ``.to(torch.bfloat16)``), by integer
    arithmetic: the same on the GPU and under the interpreter (whose own BF16 cast does not round to nearest)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _swiglu_fwd_kernel(h_ptr, p_ptr, z_ptr, T, F: tl.constexpr, HAS_P: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BF + tl.arange(0, BF)
    rmask = rows < T
    mask = rmask[:, None] & (cols[None, :] < F)
    base = rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]
    g = tl.load(h_ptr + base, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + base + F, mask=mask, other=0.0).to(tl.float32)
    z = g / (1.0 + tl.exp(-g)) * u
    if HAS_P:
        p = tl.load(p_ptr + rows, mask=rmask, other=0.0)
        z = z * p[:, None]
    out = rows.to(tl.int64)[:, None] * F + cols[None, :]
    tl.store(z_ptr + out, _bf16_bits(z), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(h_ptr, dz_ptr, p_ptr, dh_ptr, dp_ptr, T, F: tl.constexpr, HAS_P: tl.constexpr, BT: tl.constexpr,
                       BF: tl.constexpr):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    r64 = rows.to(tl.int64)[:, None]
    if HAS_P:
        p = tl.load(p_ptr + rows, mask=rmask, other=0.0)
    acc = tl.zeros((BT,), dtype=tl.float32)
    for c0 in range(0, F, BF):
        cols = c0 + tl.arange(0, BF)
        mask = rmask[:, None] & (cols[None, :] < F)
        hb = r64 * (2 * F) + cols[None, :]
        g = tl.load(h_ptr + hb, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + hb + F, mask=mask, other=0.0).to(tl.float32)
        dz = tl.load(dz_ptr + r64 * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        silu = g * s
        if HAS_P:
            acc += tl.sum(dz * silu * u, axis=1)
            a = dz * p[:, None]
        else:
            a = dz
        dg = a * u * (s * (1.0 + g * (1.0 - s)))
        du = a * silu
        tl.store(dh_ptr + hb, _bf16_bits(dg), mask=mask)
        tl.store(dh_ptr + hb + F, _bf16_bits(du), mask=mask)
    if HAS_P:
        tl.store(dp_ptr + rows, acc, mask=rmask)


def swiglu_fwd(h: torch.Tensor, probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """z ``[T, F]`` bf16 from h ``[T, 2F]`` bf16 contiguous (probs ``[T]`` float32 contiguous or None)."""
    t, f2 = h.shape
    f = f2 // 2
    z = torch.empty(t, f, dtype=torch.bfloat16, device=h.device)
    if t and f:
        bt, bf, warps = FWD_TILE
        grid = (triton.cdiv(t, bt), triton.cdiv(f, bf))
        _swiglu_fwd_kernel[grid](h, probs if probs is not None else h, z.view(torch.int16), t, f, HAS_P=probs is not None, BT=bt, BF=bf,
                                 num_warps=warps)
    return z


def swiglu_bwd(h: torch.Tensor, dz: torch.Tensor, probs: Optional[torch.Tensor] = None):
    """(dh ``[T, 2F]`` bf16, dprobs ``[T]`` float32 or None) for h ``[T, 2F]``, dz ``[T, F]`` bf16 contiguous."""
    t, f2 = h.shape
    f = f2 // 2
    dh = torch.empty(t, f2, dtype=torch.bfloat16, device=h.device)
    dp = torch.empty(t, dtype=torch.float32, device=h.device) if probs is not None else None
    if t and f:
        bt, bf, warps = BWD_TILE
        _swiglu_bwd_kernel[(triton.cdiv(t, bt),)](h, dz, probs if probs is not None else h, dh.view(torch.int16),
                                                  dp if dp is not None else dh, t, f, HAS_P=probs is not None,
                                                  BT=bt, BF=bf, num_warps=warps)
    elif dp is not None:
        dp.zero_()
    return dh, dp


__all__ = ["swiglu_fwd", "swiglu_bwd", "FWD_TILE", "BWD_TILE"]
