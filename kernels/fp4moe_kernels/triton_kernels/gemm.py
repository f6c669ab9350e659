"""Grouped blockwise-FP8 GEMMs over ragged experts, one launch for all experts (DeepSeek-V3 scaling).

``grouped_rows_kernel`` (fprop / dgrad): for every expert e with rows ``r0_e .. r1_e`` of A::

    C[r, :] = sum_g (A[r, g*128:(g+1)*128] @ B_e[:, g*128:(g+1)*128]^T) * sa[r, g] * sb_e[n // 128, g]

A ``[T, Kc]`` E4M3 rows (an ``FP8RowTensor``: 1x128 scales in its segment-major buffer, expert e's block
``[Kc/128, m_e]`` at ``Kc/128 * r0_e``), B ``[E, N, Kc]`` E4M3 with 128x128 scales ``[E, N/128, Kc/128]``
(``quantize_experts_128x128``), C ``[T, N]`` bf16. Programs: one ``BM x BN`` output tile; the M tiles come from a
host-built table (``tiles``: int32 ``[n_tiles, 3]`` = expert, first row, rows in tile), so no tile straddles two
experts and empty experts have none.

``grouped_wgrad_kernel``: for every expert e, ``C_e [N, K] = sum over its tokens t of A[n, t] B[k, t]`` with both
operands ``FP8ColTensor`` columns (tokens padded to 128 per expert with zeros; 1x128 scales along tokens:
``[Mp/128, N]`` and ``[Mp/128, K]``); C ``[E, N, K]`` in the weight dtype. Empty experts get zeros. With
``ACCUMULATE``: ``C_e += ...`` instead, C_e the row-major ``[N, K]`` block at element offset ``coff[e]`` of C (e.g.
megatron's main-gradient views into its DDP buffer, float32 or bf16), the sum formed in float32 and rounded once to
C's dtype; empty experts' blocks are left as they are.

``grouped_wgrad_tma_kernel``: the same computation, bit for bit, with the FP8 tiles loaded by the Tensor Memory
Accelerator through two device-side descriptors per program (expert e's ``[N, Mp_e]`` and ``[K, Mp_e]`` blocks;
Hopper, ``tl.make_tensor_descriptor``, whose scratch the launcher allocates): 1.12x the pointer-load kernel at
DeepSeek-V3's shapes on an H200 (results/moe_layer/README.md, "The grouped wgrad").

Every 128-deep partial product is accumulated in FP32 by the tensor cores, then scaled and added to an FP32
accumulator (the promotion DeepSeek-V3 describes), so the result differs from ``F.scaled_mm`` only by FP32
summation order. Under the interpreter (``EMULATE``) the E4M3 operands are decoded to float32 first.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import bf16_rne_bits, e4m3_value


@triton.jit
def _load_fp8(ptrs, mask, EMULATE: tl.constexpr):
    """E4M3 tile (pointers to uint8 under EMULATE, to float8e4nv otherwise) -> dot operand."""
    if EMULATE:
        return e4m3_value(tl.load(ptrs, mask=mask, other=0), True)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _dot_t(a, b, EMULATE: tl.constexpr):
    """a @ b^T in FP32 (b given [n, 128], K-contiguous: the layout Hopper's FP8 wgmma wants)."""
    if EMULATE:
        return tl.dot(a, tl.trans(b), input_precision="ieee")
    return tl.dot(a, tl.trans(b))


@triton.jit
def grouped_rows_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, tiles_ptr, seg_off_ptr, N, n_tiles,
                        KC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
                        EMULATE: tl.constexpr):
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BN)
    # grouped ordering: GROUP_M consecutive M tiles sweep the N tiles together (L2 reuse of A and B)
    per_group = GROUP_M * n_blocks
    group = pid // per_group
    first = group * GROUP_M
    size = tl.minimum(n_tiles - first, GROUP_M)
    tm = first + (pid % per_group) % size
    tn = (pid % per_group) // size
    e = tl.load(tiles_ptr + tm * 3)
    row0 = tl.load(tiles_ptr + tm * 3 + 1)
    rows = tl.load(tiles_ptr + tm * 3 + 2)
    seg0 = tl.load(seg_off_ptr + e)
    m_e = tl.load(seg_off_ptr + e + 1) - seg0
    G: tl.constexpr = KC // 128
    rm = tl.arange(0, BM)
    rn = tn * BN + tl.arange(0, BN)
    rk = tl.arange(0, 128)
    mmask = rm < rows
    nmask = rn < N
    r = (row0 + rm).to(tl.int64)
    a_ptrs = a_ptr + r[:, None] * KC + rk[None, :]
    b_ptrs = b_ptr + (e.to(tl.int64) * N + rn[:, None]) * KC + rk[None, :]
    sa_ptrs = sa_ptr + seg0.to(tl.int64) * G + (r - seg0)  # + g * m_e
    sb_ptrs = sb_ptr + (e.to(tl.int64) * tl.cdiv(N, 128) + rn // 128) * G  # [BN], + g
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for g in range(0, G):
        a = _load_fp8(a_ptrs + g * 128, mmask[:, None], EMULATE)
        b = _load_fp8(b_ptrs + g * 128, nmask[:, None], EMULATE)
        part = _dot_t(a, b, EMULATE)
        sa = tl.load(sa_ptrs + g * m_e, mask=mmask, other=0.0)
        sb = tl.load(sb_ptrs + g, mask=nmask, other=0.0)
        acc += (part * sa[:, None]) * sb[None, :]
    c_ptrs = c_ptr + r[:, None] * N + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _promote(acc, a, b, j, live, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask, N, K, EMULATE: tl.constexpr):
    """acc + the partial product of token block j's tiles a ``[BN, 128]``, b ``[BK, 128]`` times their 1x128 scales
    (the promotion)."""
    part = _dot_t(a, b, EMULATE)
    sa = tl.load(sa_ptr + (p0 // 128 + j) * N + rn, mask=nmask & live, other=0.0)
    sb = tl.load(sb_ptr + (p0 // 128 + j) * K + rk, mask=kmask & live, other=0.0)
    return acc + (part * sa[:, None]) * sb[None, :]


@triton.jit
def _wgrad_step(acc, j, live, a_ptr, b_ptr, sa_ptr, sb_ptr, p0, mp, rn, rk, nmask, kmask, N, K, EMULATE: tl.constexpr):
    """acc + the scaled partial product of token block j (128 tokens) of one expert. Pointers are formed here
    from the index vectors (runtime row stride mp): precomputed [128, 128] pointer tiles would spill."""
    rt = j * 128 + tl.arange(0, 128)
    a = _load_fp8(a_ptr + N * p0 + rn[:, None].to(tl.int64) * mp + rt[None, :], nmask[:, None] & live, EMULATE)
    b = _load_fp8(b_ptr + K * p0 + rk[:, None].to(tl.int64) * mp + rt[None, :], kmask[:, None] & live, EMULATE)
    return _promote(acc, a, b, j, live, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask, N, K, EMULATE)


@triton.jit
def _wgrad_store(acc, c_ptr, coff_ptr, e, live, rn, rk, nmask, kmask, N, K, ACCUMULATE: tl.constexpr,
                 EMULATE: tl.constexpr):
    """Write expert e's tile: C[e] = acc, or with ACCUMULATE C_e += acc (C_e at element offset coff[e], float32 sum,
    one rounding to nearest-even; nothing read or written for an expert without tokens, ``live`` False). The
    interpreter's own BF16 cast truncates: under EMULATE a BF16 sum is rounded by ``common.bf16_rne_bits``."""
    mask = nmask[:, None] & kmask[None, :]
    if ACCUMULATE:
        mask = mask & live
        c_ptrs = c_ptr + tl.load(coff_ptr + e) + rn[:, None].to(tl.int64) * K + rk[None, :]
        total = tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32) + acc
        if EMULATE and c_ptr.dtype.element_ty == tl.bfloat16:
            out = bf16_rne_bits(total.to(tl.int32, bitcast=True)).to(tl.int16).to(tl.bfloat16, bitcast=True)
        else:
            out = total.to(c_ptr.dtype.element_ty)
        tl.store(c_ptrs, out, mask=mask)
    else:
        c_ptrs = c_ptr + (e.to(tl.int64) * N + rn[:, None]) * K + rk[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def grouped_wgrad_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, coff_ptr, poff_ptr, N, K, MAXJ: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, EMULATE: tl.constexpr, ACCUMULATE: tl.constexpr = False):
    e = tl.program_id(2)
    tn = tl.program_id(0)
    tk = tl.program_id(1)
    p0 = tl.multiple_of(tl.load(poff_ptr + e), 128).to(tl.int64)
    mp = tl.multiple_of(tl.load(poff_ptr + e + 1) - tl.load(poff_ptr + e), 128).to(tl.int64)
    rn = tn * BN + tl.arange(0, BN)
    rk = tk * BK + tl.arange(0, BK)
    nmask = rn < N
    kmask = rk < K
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    nj = mp // 128
    if EMULATE:  # the interpreter's range() needs a host int: loop to the largest expert (MAXJ), masked
        for j in range(0, MAXJ):
            acc = _wgrad_step(acc, j, j < nj, a_ptr, b_ptr, sa_ptr, sb_ptr, p0, mp, rn, rk, nmask, kmask, N, K, EMULATE)
    else:
        for j in range(0, nj):
            acc = _wgrad_step(acc, j, True, a_ptr, b_ptr, sa_ptr, sb_ptr, p0, mp, rn, rk, nmask, kmask, N, K, EMULATE)
    _wgrad_store(acc, c_ptr, coff_ptr, e, mp > 0, rn, rk, nmask, kmask, N, K, ACCUMULATE, EMULATE)


@triton.jit
def _dec(x, EMULATE: tl.constexpr):
    """A tile loaded through a descriptor -> dot operand (under EMULATE: uint8 bits decoded exactly)."""
    if EMULATE:
        return e4m3_value(x, True)
    return x


@triton.jit
def _wgrad_tma_step(acc, adesc, bdesc, j, live, sa_ptr, sb_ptr, p0, n0, k0, rn, rk, nmask, kmask, N, K,
                    EMULATE: tl.constexpr):
    """``_wgrad_step`` with the tiles of token block j loaded through the expert's descriptors."""
    a = _dec(adesc.load([n0, j * 128]), EMULATE)
    b = _dec(bdesc.load([k0, j * 128]), EMULATE)
    return _promote(acc, a, b, j, live, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask, N, K, EMULATE)


@triton.jit
def grouped_wgrad_tma_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, coff_ptr, poff_ptr, N, K, MAXJ: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, EMULATE: tl.constexpr,
                             ACCUMULATE: tl.constexpr = False):
    e = tl.program_id(2)
    n0 = tl.program_id(0) * BN
    k0 = tl.program_id(1) * BK
    p0 = tl.multiple_of(tl.load(poff_ptr + e), 128).to(tl.int64)
    mp = tl.multiple_of(tl.load(poff_ptr + e + 1) - tl.load(poff_ptr + e), 128).to(tl.int64)
    rn = n0 + tl.arange(0, BN)
    rk = k0 + tl.arange(0, BK)
    nmask = rn < N
    kmask = rk < K
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    nj = (mp // 128).to(tl.int32)
    if mp > 0:  # an empty expert gets no descriptor (a zero-sized box)
        # rows / tokens outside the block read as zero
        adesc = tl.make_tensor_descriptor(a_ptr + N * p0, shape=[N, mp.to(tl.int32)], strides=[mp, 1],
                                          block_shape=[BN, 128])
        bdesc = tl.make_tensor_descriptor(b_ptr + K * p0, shape=[K, mp.to(tl.int32)], strides=[mp, 1],
                                          block_shape=[BK, 128])
        if EMULATE:  # the interpreter's range() needs a host int: loop to the largest expert (MAXJ), masked
            for j in range(0, MAXJ):
                acc = _wgrad_tma_step(acc, adesc, bdesc, j, j < nj, sa_ptr, sb_ptr, p0, n0, k0, rn, rk, nmask, kmask,
                                      N, K, EMULATE)
        else:
            for j in range(0, nj):
                acc = _wgrad_tma_step(acc, adesc, bdesc, j, True, sa_ptr, sb_ptr, p0, n0, k0, rn, rk, nmask, kmask,
                                      N, K, EMULATE)
    _wgrad_store(acc, c_ptr, coff_ptr, e, mp > 0, rn, rk, nmask, kmask, N, K, ACCUMULATE, EMULATE)
