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

The routed experts' FP8 GEMMs take z (fc2's input) and dh (fc1's output gradient) as FP8 1x128 rows and FP8 columns
per expert; ``swiglu_fwd_fp8`` / ``swiglu_bwd_fp8`` write those copies instead of z / dh (``kernels.fused_swiglu_fp8``):
one program per 128 tokens of an expert x 128 channels of z, as ``col.row_col_tile``, bit for bit the kernels above
followed by ``bf16_to_fp8_row`` / ``bf16_to_fp8_col``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..formats import FP8ColTensor, FP8RowTensor, Segments
from . import launchers
from .col import finite_amax_bits, row_col_tile, row_col_tile_header, store_row_col_chunk, store_row_scales
from .common import INTERPRET, bf16_rne_bits, e2m1_value, e8m0_value, fp8_exp_from_amax_bits
from .row import _bf16_block_words, _bf16_mxfp4_encode

# (rows per program, columns per program, num_warps); forward tiles are 2-D, backward programs own whole rows
# (they sum dprobs over F) and loop over the columns.
FWD_TILE = (32, 128, 4)
BWD_TILE = (16, 128, 4)
# the FP4-storing forward: (32-column blocks per program, num_warps), the fastest of six in the H200 sweep
# (results/kernels/swiglu_h200_2026-12-01_fused-fwd-fp4.md)
FWD_FP4_TILE = (32, 1)
# the backward from MXFP4 (whole-block tiles): (blocks per tile, rows per program, num_warps); 70-75 % of the copy
# bandwidth on an H200 against 44-50 % for the 2-D tiles it replaced (results/kernels/swiglu_h200_2026-12-01_831ae2f.md)
BWD_FP4_BLOCKS_TILE = (32, 4, 4)
# the SwiGLU with its output's (forward) or its input gradient's (backward) FP8 copies: (BN channels per chunk,
# num_warps) of a program that owns 128 tokens x one 128-channel group of z (``col.row_col_tile``); the forward's
# chunks as the fused row + column quantizer's. Not measured on a GPU yet (``fp4moe.bench.swiglu_fusion --fp8-tiles``)
FWD_FP8_TILE = (32, 4)
BWD_FP8_TILE = (32, 4)


@triton.jit
def _bf16_bits(x):
    """float32 -> the int16 bits of its BF16 rounding, nearest-even (as torch's ``.to(torch.bfloat16)``; NaN stays NaN),
    by integer arithmetic (``common.bf16_rne_bits``): the same on the GPU and under the interpreter (whose own BF16
    cast does not round to nearest)."""
    return bf16_rne_bits(x.to(tl.int32, bitcast=True)).to(tl.int16)


@triton.jit
def _swiglu_grads(g, u, a):
    """(dg, du, silu(g)) of z = silu(g) * u in float32 for the upstream gradient ``a`` (dz, times the row's routing
    probability when weighted)."""
    s = 1.0 / (1.0 + tl.exp(-g))
    silu = g * s
    return a * u * (s * (1.0 + g * (1.0 - s))), a * silu, silu


@triton.jit
def _fwd_tile(T, F: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr):
    """This program's forward tile: rows [BT], columns [BF] of z, their masks, and the offsets of g in h [T, 2F]."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BF + tl.arange(0, BF)
    rmask = rows < T
    mask = rmask[:, None] & (cols[None, :] < F)
    return rows, cols, rmask, mask, rows.to(tl.int64)[:, None] * (2 * F) + cols[None, :]


@triton.jit
def _store_z(g, u, z_ptr, p_ptr, rows, cols, rmask, mask, F: tl.constexpr, HAS_P: tl.constexpr):
    """z = silu(g) * u (* the row's probability) in float32, stored as BF16 bits (nearest-even)."""
    p = 0.0
    if HAS_P:
        p = tl.load(p_ptr + rows, mask=rmask, other=0.0)[:, None]
    tl.store(z_ptr + rows.to(tl.int64)[:, None] * F + cols[None, :], _z_bits(g, u, p, HAS_P).to(tl.int16), mask=mask)


@triton.jit
def _swiglu_fwd_kernel(h_ptr, p_ptr, z_ptr, T, F: tl.constexpr, HAS_P: tl.constexpr, BT: tl.constexpr, BF: tl.constexpr):
    rows, cols, rmask, mask, base = _fwd_tile(T, F, BT, BF)
    g = tl.load(h_ptr + base, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + base + F, mask=mask, other=0.0).to(tl.float32)
    _store_z(g, u, z_ptr, p_ptr, rows, cols, rmask, mask, F, HAS_P)


@triton.jit
def _bwd_rows(p_ptr, T, HAS_P: tl.constexpr, BT: tl.constexpr):
    """A backward program's rows [BT], their mask, int64 rows [BT, 1], their routing probabilities (0.0 without)
    and the float32 dprobs accumulator [BT]."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    p = 0.0
    if HAS_P:
        p = tl.load(p_ptr + rows, mask=rmask, other=0.0)
    return rows, rmask, rows.to(tl.int64)[:, None], p, tl.zeros((BT,), dtype=tl.float32)


@triton.jit
def _bwd_tile(g, u, dz, p, acc, dh_ptrs, mask, F: tl.constexpr, HAS_P: tl.constexpr):
    """One backward tile: dg at ``dh_ptrs`` and du F columns after it (BF16 bits); returns ``acc`` plus the tile's
    dprobs terms sum_f dz * silu(g) * u (unchanged without probabilities)."""
    if HAS_P:
        dg, du, silu = _swiglu_grads(g, u, dz * p[:, None])
        acc += tl.sum(dz * silu * u, axis=1)
    else:
        dg, du, silu = _swiglu_grads(g, u, dz)
    tl.store(dh_ptrs, _bf16_bits(dg), mask=mask)
    tl.store(dh_ptrs + F, _bf16_bits(du), mask=mask)
    return acc


@triton.jit
def _swiglu_bwd_kernel(h_ptr, dz_ptr, p_ptr, dh_ptr, dp_ptr, T, F: tl.constexpr, HAS_P: tl.constexpr, BT: tl.constexpr,
                       BF: tl.constexpr):
    rows, rmask, r64, p, acc = _bwd_rows(p_ptr, T, HAS_P, BT)
    for c0 in range(0, F, BF):
        cols = c0 + tl.arange(0, BF)
        mask = rmask[:, None] & (cols[None, :] < F)
        hb = r64 * (2 * F) + cols[None, :]
        g = tl.load(h_ptr + hb, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + hb + F, mask=mask, other=0.0).to(tl.float32)
        dz = tl.load(dz_ptr + r64 * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = _bwd_tile(g, u, dz, p, acc, dh_ptr + hb, mask, F, HAS_P)
    if HAS_P:
        tl.store(dp_ptr + rows, acc, mask=rmask)


@triton.jit
def _z_bits(g, u, p, HAS_P: tl.constexpr):
    """BF16 bits (int32, low half) of z = silu(g) * u (* p), the float32 operations of ``_store_z``."""
    z = g / (1.0 + tl.exp(-g)) * u
    if HAS_P:
        z = z * p
    return _bf16_bits(z).to(tl.int32) & 0xFFFF


@triton.jit
def _z_word(g, u, p, HAS_P: tl.constexpr):
    """Two z BF16 (int32 word) from the int32 words ``g``, ``u`` of the two gate / up BF16."""
    f32: tl.constexpr = tl.float32
    zlo = _z_bits((g << 16).to(f32, bitcast=True), (u << 16).to(f32, bitcast=True), p, HAS_P)
    zhi = _z_bits((g & -65536).to(f32, bitcast=True), (u & -65536).to(f32, bitcast=True), p, HAS_P)
    return zlo | (zhi << 16)


@triton.jit
def _z_pairs(gv, uv, p, HAS_P: tl.constexpr):
    """Four z BF16 (int64) from the int64 words ``gv``, ``uv`` of four gate / up BF16."""
    ze = _z_word(gv.to(tl.int32), uv.to(tl.int32), p, HAS_P)
    zo = _z_word((gv >> 32).to(tl.int32), (uv >> 32).to(tl.int32), p, HAS_P)
    return ze.to(tl.uint32, bitcast=True).to(tl.int64) | (zo.to(tl.int64) << 32)


@triton.jit
def _swiglu_fwd_fp4_kernel(h_ptr, p_ptr, z_ptr, q_ptr, s_ptr, NB, F: tl.constexpr, HAS_P: tl.constexpr,
                           RULE_CEIL: tl.constexpr, R: tl.constexpr, EMULATE: tl.constexpr):
    """The forward, plus h's MXFP4 copy (what ``bf16_to_fp4_row(h)`` returns) from the same registers: h is read
    once for both. A program owns ``R`` blocks of 32 gate columns (flat index b over T x F/32: row b // (F/32)) and
    the matching up blocks, one whole block pair per thread as the BF16 row encoder holds them
    (``row._bf16_block_words``: four unmasked 16-byte loads per block, int64 words of four BF16; h, z and the
    MXFP4 data 8-byte aligned): MXFP4 by ``row._bf16_mxfp4_encode`` (packed BF16x2 lanes, the BF16ToFP4Row
    encoder), z per element by the float32 formula of ``_z_bits`` on the same words. Blocks past the end re-read
    the last block (stores masked). In h's block numbering (F/16 blocks a row) the gate block is
    b + row * F/32 and the up block F/32 after it; the MXFP4 data (16 bytes a block) and scales take the same
    numbering, z (F/32 blocks a row) is numbered b."""
    b = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    mask = b < NB
    bc = tl.minimum(b, NB - 1)
    row = bc // (F // 32)
    bg = bc + row * (F // 32)  # gate block in h [T, 2F] as 32-element blocks; up block: bg + F/32
    g0, g1, g2, g3 = _bf16_block_words(h_ptr, bg)
    u0, u1, u2, u3 = _bf16_block_words(h_ptr, bg + F // 32)
    p = 0.0
    if HAS_P:
        p = tl.load(p_ptr + row)[:, None]
    j = tl.arange(0, 2)[None, :]
    zp = z_ptr.to(tl.pointer_type(tl.int64)) + b[:, None] * 8 + j
    m2 = mask[:, None]
    tl.store(zp, _z_pairs(g0, u0, p, HAS_P), mask=m2)
    tl.store(zp + 2, _z_pairs(g1, u1, p, HAS_P), mask=m2)
    tl.store(zp + 4, _z_pairs(g2, u2, p, HAS_P), mask=m2)
    tl.store(zp + 6, _z_pairs(g3, u3, p, HAS_P), mask=m2)
    qp = q_ptr.to(tl.pointer_type(tl.int32)) + bg[:, None] * 4 + tl.arange(0, 4)[None, :]
    o0, o1, o2, o3, code = _bf16_mxfp4_encode(g0, g1, g2, g3, RULE_CEIL, EMULATE)
    tl.store(qp, tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (R, 4)), mask=m2)
    tl.store(s_ptr + bg, code.to(tl.uint8), mask=mask)
    o0, o1, o2, o3, code = _bf16_mxfp4_encode(u0, u1, u2, u3, RULE_CEIL, EMULATE)
    tl.store(qp + F // 8, tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (R, 4)), mask=m2)
    tl.store(s_ptr + bg + F // 32, code.to(tl.uint8), mask=mask)


@triton.jit
def _swiglu_bwd_fp4_kernel(q_ptr, s_ptr, dz_ptr, p_ptr, dh_ptr, dp_ptr, T, F: tl.constexpr, HAS_P: tl.constexpr,
                           BT: tl.constexpr, BF: tl.constexpr):
    """The backward from h's MXFP4 copy (data [T, F] bytes, scales [T, F/16]), decoded in registers to the values
    ``fp4_to_bf16`` gives: the same tiles and float32 math as ``_swiglu_bwd_kernel`` on the decoded h."""
    rows, rmask, r64, p, acc = _bwd_rows(p_ptr, T, HAS_P, BT)
    nb: tl.constexpr = BF // 32
    for c0 in range(0, F, BF):
        cols = c0 + tl.arange(0, BF)
        mask = rmask[:, None] & (cols[None, :] < F)
        bcol = c0 // 2 + tl.arange(0, BF // 2)
        pmask = rmask[:, None] & (bcol[None, :] < F // 2)
        scol = c0 // 32 + tl.arange(0, nb)
        smask = rmask[:, None] & (scol[None, :] < F // 32)
        g = _decode_tile(q_ptr + r64 * F + bcol[None, :], s_ptr + r64 * (F // 16) + scol[None, :], pmask, smask, BT, BF)
        u = _decode_tile(q_ptr + r64 * F + F // 2 + bcol[None, :], s_ptr + r64 * (F // 16) + F // 32 + scol[None, :],
                         pmask, smask, BT, BF)
        dz = tl.load(dz_ptr + r64 * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = _bwd_tile(g, u, dz, p, acc, dh_ptr + r64 * (2 * F) + cols[None, :], mask, F, HAS_P)
    if HAS_P:
        tl.store(dp_ptr + rows, acc, mask=rmask)


@triton.jit
def _bf16x2_bits(lo, hi):
    """int32 words of two BF16 (nearest-even): ``lo`` in the low half, ``hi`` in the high half (float32 inputs)."""
    return (_bf16_bits(lo).to(tl.int32) & 0xFFFF) | (_bf16_bits(hi).to(tl.int32) << 16)


@triton.jit
def _decode_blocks(q_ptrs, s_ptrs, bmask, m2):
    """float32 values (even channel, odd channel) ``[CB, 16]`` of MXFP4 blocks: bytes at ``q_ptrs`` ``[CB, 16]``,
    one UE8M0 code per block at ``s_ptrs`` ``[CB]`` (NaN blocks -> NaN), broadcast along the block's 16 bytes."""
    code = tl.load(s_ptrs, mask=bmask, other=127).to(tl.int32)
    f = tl.where(code == 255, float("nan"), e8m0_value(code))[:, None]
    packed = tl.load(q_ptrs, mask=m2, other=0).to(tl.int32)
    return e2m1_value(packed & 0xF) * f, e2m1_value(packed >> 4) * f


@triton.jit
def _swiglu_bwd_fp4_blocks_kernel(q_ptr, s_ptr, dz_ptr, p_ptr, dh_ptr, dp_ptr, T, F: tl.constexpr,
                                  HAS_P: tl.constexpr, CB: tl.constexpr, RPP: tl.constexpr):
    """The backward from h's MXFP4 copy (data [T, F] bytes, scales [T, F/16]) in word space, tiled by whole MXFP4
    blocks: a program owns ``RPP`` rows, each as tiles of ``CB`` blocks x 16 (byte w of a block: channels 2w, 2w+1;
    word w of dz and of each half of dh: the same two).
    A block's UE8M0 code is one value per tile row, broadcast along it (no per-element code load), and the 16
    columns are declared contiguous in fours, so the byte loads and the 32-bit word loads and stores get the same
    register layout (4 per thread). dh: bit for bit ``_swiglu_bwd_kernel`` on the decoded h; dprobs: the same terms
    summed in another order."""
    f32: tl.constexpr = tl.float32
    nblk: tl.constexpr = F // 32
    j = tl.max_contiguous(tl.arange(0, 16), 4)
    for r in range(RPP):
        row = tl.program_id(0) * RPP + r
        live = row < T
        r64 = row.to(tl.int64)
        p = 0.0
        if HAS_P:
            p = tl.load(p_ptr + row, mask=live, other=0.0)
        acc = 0.0
        for c0 in range(0, nblk, CB):
            cb = c0 + tl.arange(0, CB)
            bmask = (cb < nblk) & live
            m2 = bmask[:, None]
            col = (cb * 16)[:, None] + j[None, :]  # byte of a half, word of dz, word of a half of dh
            qg = q_ptr + r64 * F + col
            sg = s_ptr + r64 * (F // 16) + cb
            g0, g1 = _decode_blocks(qg, sg, bmask, m2)
            u0, u1 = _decode_blocks(qg + F // 2, sg + F // 32, bmask, m2)
            dzw = tl.load(dz_ptr + r64 * (F // 2) + col, mask=m2, other=0)
            dz0, dz1 = (dzw << 16).to(f32, bitcast=True), (dzw & -65536).to(f32, bitcast=True)
            a0, a1 = (dz0 * p, dz1 * p) if HAS_P else (dz0, dz1)
            dg0, du0, silu0 = _swiglu_grads(g0, u0, a0)
            dg1, du1, silu1 = _swiglu_grads(g1, u1, a1)
            if HAS_P:
                acc += tl.sum(dz0 * silu0 * u0 + dz1 * silu1 * u1)
            dh = dh_ptr + r64 * F + col
            tl.store(dh, _bf16x2_bits(dg0, dg1), mask=m2)
            tl.store(dh + F // 2, _bf16x2_bits(du0, du1), mask=m2)
        if HAS_P:
            tl.store(dp_ptr + row, acc, mask=live)


@triton.jit
def _decode_tile(q_ptrs, s_ptrs, pmask, smask, BT: tl.constexpr, BF: tl.constexpr):
    """float32 [BT, BF] values of MXFP4 bytes [BT, BF/2] and their UE8M0 codes [BT, BF/32] (NaN blocks -> NaN)."""
    packed = tl.load(q_ptrs, mask=pmask, other=0).to(tl.int32)
    code = tl.load(s_ptrs, mask=smask, other=127).to(tl.int32)
    code2 = tl.reshape(tl.broadcast_to(code[:, :, None], (BT, BF // 32, 16)), (BT, BF // 2))
    f = tl.where(code2 == 255, float("nan"), e8m0_value(code2))
    v = tl.join(e2m1_value(packed & 0xF) * f, e2m1_value(packed >> 4) * f)  # [BT, BF/2, 2]: even, odd channel
    return tl.reshape(v, (BT, BF))


@triton.jit
def _load_z(h_ptr, p_ptr, r, ch, mask, F: tl.constexpr, HAS_P: tl.constexpr):
    """``col.row_col_tile``'s loader for the SwiGLU's output: float32 ``[128, BN]`` of z = silu(g) * u (* p) at rows
    ``r`` ``[128, 1]``, channels ``ch`` ``[BN]``, rounded to BF16 as ``_swiglu_fwd_kernel`` stores it (the same loads
    and float32 operations), from h ``[T, 2F]`` bf16 and probs ``[T]`` float32; masked rows give 0."""
    hb = r * (2 * F) + ch[None, :]
    g = tl.load(h_ptr + hb, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + hb + F, mask=mask, other=0.0).to(tl.float32)
    p = 0.0
    if HAS_P:
        p = tl.load(p_ptr + r, mask=mask, other=0.0)
    return (_z_bits(g, u, p, HAS_P) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _swiglu_fp8_kernel(h_ptr, p_ptr, q_ptr, qs_ptr, o_ptr, os_ptr, tiles_ptr, F: tl.constexpr, BN: tl.constexpr,
                       HAS_P: tl.constexpr, COLS: tl.constexpr, EMULATE: tl.constexpr):
    """z's FP8 1x128 rows (and, when COLS, its FP8 columns) straight from h: ``swiglu_fwd`` then
    ``bf16_to_fp8_row`` / ``bf16_to_fp8_col`` bit for bit, z never in memory. Grid (F/128, column tiles)."""
    row_col_tile(h_ptr, p_ptr, q_ptr, qs_ptr, o_ptr, os_ptr, tiles_ptr, F, BN, COLS, EMULATE, _load_z, HAS_P)


@triton.jit
def _dh_chunk(h_ptr, hs_ptr, dz_ptr, p, r, z0, mask, F: tl.constexpr, BN: tl.constexpr, HAS_P: tl.constexpr,
              H_FP4: tl.constexpr):
    """(dg, du: float32 ``[128, BN]`` of their BF16 roundings, as ``_bwd_tile`` stores them; the dprobs terms
    dz * silu(g) * u) for z channels ``z0 .. z0 + BN`` of rows ``r`` ``[128, 1]``; ``p`` ``[128, 1]`` their routing
    probabilities. h: ``[T, 2F]`` bf16 at ``h_ptr``, or (H_FP4) its MXFP4 copy, data ``[T, F]`` bytes at ``h_ptr`` and
    scales ``[T, F/16]`` at ``hs_ptr``, decoded as ``_decode_tile`` (``fp4_to_bf16``'s values)."""
    zc = z0 + tl.arange(0, BN)
    if H_FP4:
        bcol = z0 // 2 + tl.arange(0, BN // 2)
        scol = z0 // 32 + tl.arange(0, BN // 32)
        g = _decode_tile(h_ptr + r * F + bcol[None, :], hs_ptr + r * (F // 16) + scol[None, :], mask, mask, 128, BN)
        u = _decode_tile(h_ptr + r * F + F // 2 + bcol[None, :], hs_ptr + r * (F // 16) + F // 32 + scol[None, :],
                         mask, mask, 128, BN)
    else:
        hb = r * (2 * F) + zc[None, :]
        g = tl.load(h_ptr + hb, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + hb + F, mask=mask, other=0.0).to(tl.float32)
    dz = tl.load(dz_ptr + r * F + zc[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_P:
        dg, du, silu = _swiglu_grads(g, u, dz * p)
    else:
        dg, du, silu = _swiglu_grads(g, u, dz)
    f32: tl.constexpr = tl.float32
    return ((_bf16_bits(dg).to(tl.int32) << 16).to(f32, bitcast=True),
            (_bf16_bits(du).to(tl.int32) << 16).to(f32, bitcast=True), dz * silu * u)


@triton.jit
def _swiglu_bwd_fp8_kernel(h_ptr, hs_ptr, dz_ptr, p_ptr, q_ptr, qs_ptr, o_ptr, os_ptr, dp_ptr, tiles_ptr, T,
                           F: tl.constexpr, BN: tl.constexpr, HAS_P: tl.constexpr, H_FP4: tl.constexpr,
                           COLS: tl.constexpr, EMULATE: tl.constexpr):
    """dh's FP8 1x128 rows (and, when COLS, its FP8 columns) straight from h (or its MXFP4 copy) and dz:
    ``swiglu_bwd`` (``swiglu_bwd_fp4``) then ``bf16_to_fp8_row`` / ``bf16_to_fp8_col`` bit for bit, dh never in
    memory. A program owns 128 tokens of one segment (a column tile) x the z channels ``128 * pid .. + 128``, i.e.
    dh's 128-channel groups ``pid`` (gate) and ``F/128 + pid`` (up), in chunks of BN channels, two passes as
    ``col.row_col_tile``; the first also sums the dprobs terms of its channels into ``dp_ptr`` ``[F/128, T]``
    float32 (the launcher adds the F/128 partial sums). Grid (F/128, column tiles)."""
    pid = tl.program_id(0)
    r, mask, p_e, mp_e, tok0, s0, count = row_col_tile_header(tiles_ptr)
    p = 0.0
    if HAS_P:
        p = tl.load(p_ptr + r, mask=mask, other=0.0)
    amax_g = tl.zeros([128], dtype=tl.int32)
    amax_u = tl.zeros([128], dtype=tl.int32)
    acc = tl.zeros([128], dtype=tl.float32)
    for c in range(128 // BN):
        dg, du, terms = _dh_chunk(h_ptr, hs_ptr, dz_ptr, p, r, pid * 128 + c * BN, mask, F, BN, HAS_P, H_FP4)
        amax_g = tl.maximum(amax_g, finite_amax_bits(dg))
        amax_u = tl.maximum(amax_u, finite_amax_bits(du))
        if HAS_P:
            acc += tl.sum(terms, axis=1)
    k_g = fp8_exp_from_amax_bits(amax_g)
    k_u = fp8_exp_from_amax_bits(amax_u)
    store_row_scales(qs_ptr, k_g, r, mask, s0, count, pid, 2 * F)
    store_row_scales(qs_ptr, k_u, r, mask, s0, count, F // 128 + pid, 2 * F)
    for c in range(128 // BN):
        z0 = pid * 128 + c * BN
        dg, du, terms = _dh_chunk(h_ptr, hs_ptr, dz_ptr, p, r, z0, mask, F, BN, HAS_P, H_FP4)
        ch = z0 + tl.arange(0, BN)
        store_row_col_chunk(dg, k_g, q_ptr, o_ptr, os_ptr, r, ch, mask, p_e, mp_e, tok0, 2 * F, COLS, EMULATE)
        store_row_col_chunk(du, k_u, q_ptr, o_ptr, os_ptr, r, F + ch, mask, p_e, mp_e, tok0, 2 * F, COLS, EMULATE)
    if HAS_P:
        tl.store(dp_ptr + pid * T + r, acc[:, None], mask=mask)


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


def swiglu_fwd_fp4(h: torch.Tensor, probs: Optional[torch.Tensor] = None, rule: str = "ceil", tile=None):
    """(z ``[T, F]`` bf16, h's MXFP4 ``(data [T, F] uint8, scales [T, F/16] uint8)``) from h ``[T, 2F]`` bf16
    contiguous, F a multiple of 32: ``swiglu_fwd(h, probs)`` and ``bf16_to_fp4_row(h, rule)`` in one pass over h.
    ``tile`` (blocks per program, num_warps) overrides ``FWD_FP4_TILE`` (benchmark sweeps)."""
    t, f2 = h.shape
    f = f2 // 2
    if f % 32:
        raise ValueError(f"swiglu_fwd_fp4 needs F (= {f}) a multiple of 32 (whole MXFP4 blocks per half)")
    z = torch.empty(t, f, dtype=torch.bfloat16, device=h.device)
    q = torch.empty(t, f, dtype=torch.uint8, device=h.device)
    sc = torch.empty(t, f // 16, dtype=torch.uint8, device=h.device)
    if t and f:
        r, warps = tile or FWD_FP4_TILE
        nb = t * (f // 32)
        if h.data_ptr() % 8:  # the kernel reads blocks as int64 words: 8-byte aligned
            h = h.clone()
        _swiglu_fwd_fp4_kernel[(triton.cdiv(nb, r),)](h.view(torch.int32), probs if probs is not None else h,
                                                       z.view(torch.int32), q, sc, nb, f, HAS_P=probs is not None,
                                                       RULE_CEIL=rule == "ceil", R=r, EMULATE=INTERPRET,
                                                       num_warps=warps)
    return z, (q, sc)


def swiglu_bwd_fp4(data: torch.Tensor, scales: torch.Tensor, dz: torch.Tensor, probs: Optional[torch.Tensor] = None,
                   tile=None):
    """``swiglu_bwd(fp4_to_bf16(h4), dz, probs)`` with h4 = (data ``[T, F]`` uint8, scales ``[T, F/16]`` uint8) the
    MXFP4 copy of h ``[T, 2F]`` (F a multiple of 32), decoded in registers instead of through a BF16 h in memory:
    dh bit for bit; dprobs within float32 rounding (the same terms summed in another order). ``tile``: None (the
    whole-block kernel at ``BWD_FP4_BLOCKS_TILE``), ``("blocks", blocks per tile, rows per program, num_warps)``, or
    ``"tiles"``: the previous default, 2-D tiles decoded with a join and reshape (dprobs bit for bit
    ``swiglu_bwd``'s; 44-50 % of the copy bandwidth on an H200 against 70-75 %), kept for benchmarks."""
    t, f = data.shape
    if f % 32 or tuple(scales.shape) != (t, f // 16):
        raise ValueError(f"swiglu_bwd_fp4: data [T, F] with F a multiple of 32 and scales [T, F/16], got "
                         f"{tuple(data.shape)} and {tuple(scales.shape)}")
    if dz.dtype != torch.bfloat16 or tuple(dz.shape) != (t, f) or not dz.is_contiguous():
        raise ValueError(f"swiglu_bwd_fp4: dz must be contiguous bfloat16 [T, F] = {(t, f)}, got {dz.dtype} "
                         f"{tuple(dz.shape)}{'' if dz.is_contiguous() else ' (not contiguous)'}")
    dh = torch.empty(t, 2 * f, dtype=torch.bfloat16, device=data.device)
    dp = torch.empty(t, dtype=torch.float32, device=data.device) if probs is not None else None
    if t and f and tile == "tiles":
        bt, bf, warps = BWD_TILE
        _swiglu_bwd_fp4_kernel[(triton.cdiv(t, bt),)](data, scales, dz, probs if probs is not None else dz,
                                                      dh.view(torch.int16), dp if dp is not None else dh, t, f,
                                                      HAS_P=probs is not None, BT=bt, BF=bf, num_warps=warps)
    elif t and f:
        cb, rpp, warps = BWD_FP4_BLOCKS_TILE if tile is None else tile[1:]
        cb = min(cb, triton.next_power_of_2(f // 32))
        _swiglu_bwd_fp4_blocks_kernel[(triton.cdiv(t, rpp),)](data, scales, dz.view(torch.int32),
                                                              probs if probs is not None else dz, dh.view(torch.int32),
                                                              dp if dp is not None else dh, t, f, HAS_P=probs is not None,
                                                              CB=cb, RPP=rpp, num_warps=warps)
    elif dp is not None:
        dp.zero_()
    return dh, dp


def _check_fp8(name: str, t: int, f: int, seg: Segments) -> None:
    if f % 128:
        raise ValueError(f"{name} needs F (= {f}) a multiple of 128 (whole FP8 1x128 groups per half)")
    if seg.total != t:
        raise ValueError(f"{name}: the segments count {seg.total} rows, h has {t}")


def swiglu_fwd_fp8(h: torch.Tensor, probs: Optional[torch.Tensor], seg: Segments, cols: bool = True, tile=None):
    """(z's FP8 1x128 rows ``FP8RowTensor`` ``[T, F]``, z's FP8 columns ``FP8ColTensor`` or None without ``cols``)
    for z = ``swiglu_fwd(h, probs)``, from h ``[T, 2F]`` bf16 contiguous (F a multiple of 128; probs ``[T]``
    float32 contiguous or None) over the experts' rows ``seg``: bit for bit ``bf16_to_fp8_row(z, seg)`` /
    ``bf16_to_fp8_col(z, seg)``, with z never written (one read of h instead of z's write and two reads).
    ``tile`` (BN, num_warps) overrides ``FWD_FP8_TILE`` (benchmark sweeps)."""
    t, f2 = h.shape
    f = f2 // 2
    _check_fp8("swiglu_fwd_fp8", t, f, seg)
    q, qs, o, s = launchers.fp8_row_col_outputs(t, f, seg, cols, h.device)
    tiles = launchers._col_tiles(seg, h.device, with_count=True)
    if tiles.shape[0] and f:
        bn, warps = tile or FWD_FP8_TILE
        _swiglu_fp8_kernel[(f // 128, tiles.shape[0])](
            h, probs if probs is not None else h, q.view(torch.uint8), qs, o.view(torch.uint8), s, tiles, f, BN=bn,
            HAS_P=probs is not None, COLS=cols, EMULATE=INTERPRET, num_warps=warps)
    return FP8RowTensor(q, qs, seg), (FP8ColTensor(o, s, seg, f) if cols else None)


def swiglu_bwd_fp8(h, dz: torch.Tensor, probs: Optional[torch.Tensor], seg: Segments, cols: bool = True, tile=None):
    """(dh's FP8 1x128 rows ``FP8RowTensor`` ``[T, 2F]``, dh's FP8 columns ``FP8ColTensor`` or None without
    ``cols``, dprobs ``[T]`` float32 or None without probs) for dh, dprobs = ``swiglu_bwd(h, dz, probs)``; h is
    ``[T, 2F]`` bf16 contiguous, or its MXFP4 copy as ``(data [T, F] uint8, scales [T, F/16] uint8)`` (then
    ``swiglu_bwd_fp4``'s); dz ``[T, F]`` bf16 contiguous, F a multiple of 128, over the experts' rows ``seg``.
    dh's copies bit for bit ``bf16_to_fp8_row(dh, seg)`` / ``bf16_to_fp8_col(dh, seg)``, dh never written (h and dz
    read once instead of dh's write and two reads); dprobs: the same terms summed in another order (within float32
    rounding). ``tile`` (BN, num_warps) overrides ``BWD_FP8_TILE``."""
    fp4 = isinstance(h, tuple)
    data, scales = h if fp4 else (h, h)
    t = data.shape[0]
    f = data.shape[1] if fp4 else data.shape[1] // 2
    _check_fp8("swiglu_bwd_fp8", t, f, seg)
    if fp4 and tuple(scales.shape) != (t, f // 16):
        raise ValueError(f"swiglu_bwd_fp8: MXFP4 h needs data [T, F] and scales [T, F/16], got {tuple(data.shape)} "
                         f"and {tuple(scales.shape)}")
    if dz.dtype != torch.bfloat16 or tuple(dz.shape) != (t, f) or not dz.is_contiguous():
        raise ValueError(f"swiglu_bwd_fp8: dz must be contiguous bfloat16 [T, F] = {(t, f)}, got {dz.dtype} "
                         f"{tuple(dz.shape)}{'' if dz.is_contiguous() else ' (not contiguous)'}")
    q, qs, o, s = launchers.fp8_row_col_outputs(t, 2 * f, seg, cols, data.device)
    part = torch.zeros(f // 128, t, dtype=torch.float32, device=data.device) if probs is not None else None
    tiles = launchers._col_tiles(seg, data.device, with_count=True)
    bn, warps = tile or BWD_FP8_TILE
    if fp4 and bn < 32:
        raise ValueError(f"swiglu_bwd_fp8: MXFP4 h is decoded in whole 32-element blocks: BN {bn} must be >= 32")
    if tiles.shape[0] and f:
        _swiglu_bwd_fp8_kernel[(f // 128, tiles.shape[0])](
            data, scales, dz, probs if probs is not None else dz, q.view(torch.uint8), qs, o.view(torch.uint8), s,
            part if part is not None else dz, tiles, t, f, BN=bn, HAS_P=probs is not None, H_FP4=fp4, COLS=cols,
            EMULATE=INTERPRET, num_warps=warps)
    dp = part.sum(0) if part is not None else None
    return FP8RowTensor(q, qs, seg), (FP8ColTensor(o, s, seg, 2 * f) if cols else None), dp


__all__ = ["swiglu_fwd", "swiglu_bwd", "swiglu_fwd_fp4", "swiglu_bwd_fp4", "swiglu_fwd_fp8", "swiglu_bwd_fp8", "FWD_TILE",
           "BWD_TILE", "FWD_FP4_TILE", "BWD_FP4_BLOCKS_TILE", "FWD_FP8_TILE", "BWD_FP8_TILE"]
