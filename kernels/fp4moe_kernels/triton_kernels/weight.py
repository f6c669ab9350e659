"""128x128 blockwise FP8 weight quantizer (DeepSeek-V3 weight scaling), one program per block.

``quantize_weight_128x128_kernel``: W, E experts of ``[N, K]`` bf16 each (as int16 bits), each row-major and
starting ``OFF[e] * UNIT`` elements after ``w_ptr`` (int64, possibly negative: the experts may lie anywhere, e.g.
where megatron's DDP buffer put them; R = E N rows, a multiple of 128) -> E4M3 data ``[R, K]`` (as int16 pairs),
float32 scale ``[R/128, K/128]``, and when ``TRANSPOSE`` the blocks of every expert's W_e^T: data ``[E, K, N]``
bytes, scale ``[E, K/128, N/128]``. Per block: amax over its finite values, k = ceil(log2(amax/448)) clamped to
[-126, 127] (0 for an all-zero block), elements w * 2**-k rounded to E4M3 nearest-even, non-finite -> NaN:
bit-equal to ``fp4moe.ops.fp8_gemm.quantize_weight_128x128_torch`` (tested in tests/kernels). BF16 only: a float32
variant (int32 tiles through the same reshape/split) passed under the interpreter but gave wrong bits compiled
on an H200 (Triton 3.6; results/moe_layer/README.md); float32 weights take the torch path.

Layout inside a program: the block as four ``[32, 64]`` int32 tiles of bf16 pairs, tile b holding rows 4a + b
(a < 32) and in word j the columns 2j (low half), 2j + 1 (high half). ``UNIT`` (the launcher's choice, 1, 2 or 8)
is what every expert's offset and ``w_ptr`` are known to be multiples of (in elements; 8: 16-byte aligned rows):
with 2 or 8 the words are loaded as int32 (vectorized with 8), with 1 as two int16 loads. One
``cvt.rn.satfinite.e4m3x2.f32`` per word gives the two bytes of a row-major int16 pair; the four tiles' pairs
at (a, j) are the 4x2 bytes that become, by byte shuffles in registers, the two int32 words of W_e^T rows
2j and 2j + 1, columns 4a .. 4a + 3: both copies are stored as whole words, no single bytes (Triton moves the
W_e^T words through shared memory so that each thread stores 16 contiguous bytes). A block with no Inf/NaN (its
max |w| bits below 0x7F800000) skips the finiteness tests; one that has any takes a branch that reads it again.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import e4m3x2, exp2_i, fp8_exp_from_amax_bits

_MAG = tl.constexpr(0x7FFFFFFF)
_HI16 = tl.constexpr(-65536)  # 0xFFFF0000 as int32


@triton.jit
def _words(w_ptr, off, rows, j, bk, K: tl.constexpr, UNIT: tl.constexpr, VOLATILE: tl.constexpr = False):
    """int32 ``[32, 64]``: bf16 columns (bk * 128 + 2j, + 1) of the expert's ``rows`` ([32, 1]) as one word each,
    the expert starting ``off * UNIT`` elements after ``w_ptr``. ``VOLATILE``: a load the compiler may not merge
    with another of the same words."""
    if UNIT == 1:
        p = w_ptr + off + rows * K + bk * 128 + 2 * j
        lo = tl.load(p, volatile=VOLATILE).to(tl.int32) & 0xFFFF
        return lo | (tl.load(p + 1, volatile=VOLATILE).to(tl.int32) << 16)
    else:
        wp = w_ptr.to(tl.pointer_type(tl.int32))
        return tl.load(wp + off * (UNIT // 2) + rows * (K // 2) + bk * 64 + j, volatile=VOLATILE)


@triton.jit
def _finite_mag(x):
    """|x| as int32 bits where x (float32 bits) is finite, else 0."""
    m = x & _MAG
    return tl.where(m < 0x7F800000, m, 0)


@triton.jit
def _finite_amax(w0, w1, w2, w3):
    """Bits of the largest finite |w| of the four tiles of words (0 if none)."""
    m01 = tl.maximum(tl.maximum(_finite_mag(w0 << 16), _finite_mag(w0 & _HI16)),
                     tl.maximum(_finite_mag(w1 << 16), _finite_mag(w1 & _HI16)))
    m23 = tl.maximum(tl.maximum(_finite_mag(w2 << 16), _finite_mag(w2 & _HI16)),
                     tl.maximum(_finite_mag(w3 << 16), _finite_mag(w3 & _HI16)))
    return tl.max(tl.max(tl.maximum(m01, m23), axis=1), axis=0)


@triton.jit
def _pairs(wd, inv, NONFINITE: tl.constexpr, EMULATE: tl.constexpr):
    """int32 words of bf16 pairs -> int32 holding in its low 16 bits (upper bits 0) the two E4M3 bytes (low
    column in the low byte) of ``w * inv``; with ``NONFINITE`` non-finite w -> NaN (without, w must be finite)."""
    lo = (wd << 16).to(tl.float32, bitcast=True) * inv
    hi = (wd & _HI16).to(tl.float32, bitcast=True) * inv
    if NONFINITE:
        lo = tl.where(((wd << 16) & _MAG) < 0x7F800000, lo, float("nan"))
        hi = tl.where((wd & 0x7FFF0000) < 0x7F800000, hi, float("nan"))
    return e4m3x2(lo.to(tl.int32, bitcast=True), hi.to(tl.int32, bitcast=True), EMULATE).to(tl.int32) & 0xFFFF


@triton.jit
def quantize_weight_128x128_kernel(w_ptr, off_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, K: tl.constexpr, N: tl.constexpr,
                                   TRANSPOSE: tl.constexpr, EMULATE: tl.constexpr, UNIT: tl.constexpr = 1):
    bn = tl.program_id(0).to(tl.int64)  # block row (over all experts' rows)
    bk = tl.program_id(1).to(tl.int64)
    e = (bn * 128) // N  # expert of this block row
    n0 = bn * 128 - e * N  # its first row inside the expert
    off = tl.load(off_ptr + e)
    a = tl.arange(0, 32)[:, None]  # [32, 1] row quads
    j = tl.arange(0, 64)[None, :]  # [1, 64] column pairs
    w0 = _words(w_ptr, off, n0 + 4 * a, j, bk, K, UNIT)
    w1 = _words(w_ptr, off, n0 + 4 * a + 1, j, bk, K, UNIT)
    w2 = _words(w_ptr, off, n0 + 4 * a + 2, j, bk, K, UNIT)
    w3 = _words(w_ptr, off, n0 + 4 * a + 3, j, bk, K, UNIT)
    # |w| bits: high halves as they are, low halves shifted up; >= 0x7F800000 iff the block holds Inf or NaN
    mh = tl.maximum(tl.maximum(w0 & 0x7FFF0000, w1 & 0x7FFF0000), tl.maximum(w2 & 0x7FFF0000, w3 & 0x7FFF0000))
    ml = tl.maximum(tl.maximum(w0 & 0x7FFF, w1 & 0x7FFF), tl.maximum(w2 & 0x7FFF, w3 & 0x7FFF))
    amax = tl.max(tl.max(tl.maximum(mh, ml << 16), axis=1), axis=0)
    if amax >= 0x7F800000:
        # rare (Inf or NaN in the block): the finite amax, non-finite -> NaN. The block is read again (from L2,
        # volatile so that these loads stay apart from the ones above): sharing the words and the finiteness
        # tests across the reduction costs the common path ~100 registers per thread (ptxas keeps both paths').
        v0 = _words(w_ptr, off, n0 + 4 * a, j, bk, K, UNIT, True)
        v1 = _words(w_ptr, off, n0 + 4 * a + 1, j, bk, K, UNIT, True)
        v2 = _words(w_ptr, off, n0 + 4 * a + 2, j, bk, K, UNIT, True)
        v3 = _words(w_ptr, off, n0 + 4 * a + 3, j, bk, K, UNIT, True)
        k = fp8_exp_from_amax_bits(_finite_amax(v0, v1, v2, v3))
        inv = exp2_i(-k)
        p0 = _pairs(_words(w_ptr, off, n0 + 4 * a, j, bk, K, UNIT, True), inv, True, EMULATE)
        p1 = _pairs(_words(w_ptr, off, n0 + 4 * a + 1, j, bk, K, UNIT, True), inv, True, EMULATE)
        p2 = _pairs(_words(w_ptr, off, n0 + 4 * a + 2, j, bk, K, UNIT, True), inv, True, EMULATE)
        p3 = _pairs(_words(w_ptr, off, n0 + 4 * a + 3, j, bk, K, UNIT, True), inv, True, EMULATE)
    else:
        k = fp8_exp_from_amax_bits(amax)
        inv = exp2_i(-k)
        p0 = _pairs(w0, inv, False, EMULATE)  # [32, 64]: row 4a, bytes of columns 2j, 2j + 1
        p1 = _pairs(w1, inv, False, EMULATE)
        p2 = _pairs(w2, inv, False, EMULATE)
        p3 = _pairs(w3, inv, False, EMULATE)
    r = bn * 128 + 4 * a  # [32, 1] rows of tile 0 in q
    qp = q_ptr + r * (K // 2) + bk * 64 + j
    tl.store(qp, p0.to(tl.int16))
    tl.store(qp + K // 2, p1.to(tl.int16))
    tl.store(qp + K, p2.to(tl.int16))
    tl.store(qp + 3 * (K // 2), p3.to(tl.int16))
    tl.store(s_ptr + bn * (K // 128) + bk, exp2_i(k))
    if TRANSPOSE:
        # W_e^T [K, N] as int32 words: row c = bk * 128 + 2j (+ 1), word (n0 + 4a) / 4 holds rows n0 + 4a .. + 3
        ev = (p0 & 0xFF) | ((p1 & 0xFF) << 8) | ((p2 & 0xFF) << 16) | (p3 << 24)
        od = (p0 >> 8) | (p1 & 0xFF00) | ((p2 & 0xFF00) << 8) | ((p3 & 0xFF00) << 16)
        tp = qt_ptr.to(tl.pointer_type(tl.int32)) + (e * K + bk * 128 + 2 * j) * (N // 4) + n0 // 4 + a
        tl.store(tp, ev)
        tl.store(tp + N // 4, od)
        tl.store(st_ptr + e * (K // 128) * (N // 128) + bk * (N // 128) + n0 // 128, exp2_i(k))
