"""128x128 blockwise FP8 weight quantizer (DeepSeek-V3 weight scaling), one program per block.

``quantize_weight_128x128_kernel``: W, E experts of ``[N, K]`` bf16 each (as int16 bits), each row-major and
starting ``OFF[e]`` elements after ``w_ptr`` (int64, possibly negative: the experts may lie anywhere, e.g. where
megatron's DDP buffer put them; R = E N rows, a multiple of 128) -> E4M3 data ``[R, K]`` (as int16 pairs), float32
scale ``[R/128, K/128]``, and when ``TRANSPOSE`` the blocks of every expert's W_e^T: data ``[E, K, N]`` bytes, scale
``[E, K/128, N/128]``. Per block: amax over its finite values, k = ceil(log2(amax/448)) clamped to [-126, 127]
(0 for an all-zero block), elements w * 2**-k rounded to E4M3 nearest-even, non-finite -> NaN: bit-equal to
``fp4moe.ops.fp8_gemm.quantize_weight_128x128_torch`` (tested in tests/kernels). BF16 only: a float32
variant (int32 tiles through the same reshape/split) passed under the interpreter but gave wrong bits compiled
on an H200 (Triton 3.6; results/moe_layer/README.md); float32 weights take the torch path.

Layout inside a program: the block as ``[128, 64]`` pairs (columns 2j, 2j+1) so that one
``cvt.rn.satfinite.e4m3x2.f32`` makes two bytes; the transposed copy stores the two bytes separately.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import e4m3x2, exp2_i, fp8_exp_from_amax_bits

_MAG = tl.constexpr(0x7FFFFFFF)


@triton.jit
def quantize_weight_128x128_kernel(w_ptr, off_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, K: tl.constexpr, N: tl.constexpr,
                                   TRANSPOSE: tl.constexpr, EMULATE: tl.constexpr):
    bn = tl.program_id(0).to(tl.int64)  # block row (over all experts' rows)
    bk = tl.program_id(1).to(tl.int64)
    r = bn * 128 + tl.arange(0, 128)[:, None]  # [128, 1] rows
    j = tl.arange(0, 64)[None, :]  # [1, 64] column pairs
    c0 = bk * 128 + 2 * j
    e = (bn * 128) // N  # expert of this block row
    n0 = bn * 128 - e * N  # its first row inside the expert
    rw = tl.load(off_ptr + e) + (n0 + tl.arange(0, 128)[:, None]) * K  # [128, 1] row starts, from w_ptr
    v = tl.load(w_ptr + rw + bk * 128 + tl.arange(0, 128)[None, :]).to(tl.int32) << 16  # [128, 128] fp32 bits
    lo, hi = tl.split(tl.reshape(v, (128, 64, 2)))  # columns 2j and 2j+1
    mlo = lo & _MAG
    mhi = hi & _MAG
    fin_lo = mlo < 0x7F800000
    fin_hi = mhi < 0x7F800000
    amax = tl.max(tl.max(tl.maximum(tl.where(fin_lo, mlo, 0), tl.where(fin_hi, mhi, 0)), axis=1), axis=0)
    k = fp8_exp_from_amax_bits(amax)
    inv = exp2_i(-k)
    qlo = tl.where(fin_lo, lo.to(tl.float32, bitcast=True) * inv, float("nan"))
    qhi = tl.where(fin_hi, hi.to(tl.float32, bitcast=True) * inv, float("nan"))
    pairs = e4m3x2(qlo.to(tl.int32, bitcast=True), qhi.to(tl.int32, bitcast=True), EMULATE)  # [128, 64] int16
    tl.store(q_ptr + r * (K // 2) + bk * 64 + j, pairs)
    tl.store(s_ptr + bn * (K // 128) + bk, exp2_i(k))
    if TRANSPOSE:
        p = pairs.to(tl.int32)
        b_lo = (p & 0xFF).to(tl.uint8)
        b_hi = ((p >> 8) & 0xFF).to(tl.uint8)
        rl = tl.arange(0, 128)[:, None]
        base = e * K * N + n0 + rl  # element (col c, row n0 + rl) of W_e^T [K, N] at base + c * N
        tl.store(qt_ptr + base + c0 * N, b_lo)
        tl.store(qt_ptr + base + (c0 + 1) * N, b_hi)
        tl.store(st_ptr + e * (K // 128) * (N // 128) + bk * (N // 128) + n0 // 128, exp2_i(k))
