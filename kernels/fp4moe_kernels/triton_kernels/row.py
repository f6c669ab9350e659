"""Row-wise conversion kernels: each program converts ``BM`` whole rows, ``BK`` channels at a time.

Kernels here never write an intermediate tensor: BF16ToFP4Row, FP4RowToFP8Row, FP8ToFP4, the fused
BF16 -> (MXFP4, FP8 row), MXFP4 -> BF16, BF16 -> FP8 row. Layouts are those of ``fp4moe_kernels.formats``.

Everything works on element *pairs* (2j, 2j+1): one packed MXFP4 byte, one int32 word of two BF16, one
int16 of two E4M3 bytes. So packing never needs a register shuffle, loads and stores are wide, and the
E4M3 conversion is one ``cvt.rn.satfinite.e4m3x2.f32`` per pair. Ragged segments only change where FP8
row scales go (segment-major); a per-row segment id is passed.
"""
import triton
import triton.language as tl

from .common import (
    e2m1_codes_from_bits,
    e2m1_value,
    e4m3_value,
    e4m3x2,
    exp2_i,
    fp8_exp_from_amax_bits,
    load_pairs,
    mx_code_from_amax_bits,
)

_MAG = 0x7FFFFFFF


@triton.jit
def _mxfp4_pairs(lo, hi, BM: tl.constexpr, BK: tl.constexpr, RULE_CEIL: tl.constexpr):
    """float32 bits of element pairs [BM, BK/2] -> (packed bytes [BM, BK/2] uint8, UE8M0 [BM, BK/32] uint8)."""
    lo3 = tl.reshape(lo, (BM, BK // 32, 16))
    hi3 = tl.reshape(hi, (BM, BK // 32, 16))
    mlo = lo3 & _MAG
    mhi = hi3 & _MAG
    amax = tl.max(tl.maximum(mlo, mhi), axis=2)  # int32 bits; NaN/Inf sort above every finite value
    code = mx_code_from_amax_bits(amax, RULE_CEIL)
    clo = e2m1_codes_from_bits(mlo, code) | ((lo3 >> 28) & 8)
    chi = e2m1_codes_from_bits(mhi, code) | ((hi3 >> 28) & 8)
    byte = tl.where((code < 255)[:, :, None], clo | (chi << 4), 0)
    return tl.reshape(byte, (BM, BK // 2)).to(tl.uint8), code.to(tl.uint8)


@triton.jit
def _fp8_row_pairs(lo, hi, BM: tl.constexpr, BK: tl.constexpr, EMULATE: tl.constexpr):
    """float32 bits of element pairs [BM, BK/2] -> (E4M3 pairs [BM, BK/2] int16, scales [BM, BK/128] float32)."""
    lo3 = tl.reshape(lo, (BM, BK // 128, 64))
    hi3 = tl.reshape(hi, (BM, BK // 128, 64))
    mlo = lo3 & _MAG
    mhi = hi3 & _MAG
    fin_lo = mlo < 0x7F800000
    fin_hi = mhi < 0x7F800000
    amax = tl.max(tl.maximum(tl.where(fin_lo, mlo, 0), tl.where(fin_hi, mhi, 0)), axis=2)
    k = fp8_exp_from_amax_bits(amax)  # [-126, 121] for finite float32 inputs
    inv = exp2_i(-k)[:, :, None]
    qlo = tl.where(fin_lo, lo3.to(tl.float32, bitcast=True) * inv, float("nan"))
    qhi = tl.where(fin_hi, hi3.to(tl.float32, bitcast=True) * inv, float("nan"))
    pairs = e4m3x2(qlo.to(tl.int32, bitcast=True), qhi.to(tl.int32, bitcast=True), EMULATE)
    return tl.reshape(pairs, (BM, BK // 2)), exp2_i(k)


@triton.jit
def _row_scale_offsets(rows, g0, M, K, row_seg_ptr, seg_off_ptr, mask_m,
                       NG: tl.constexpr, SINGLE_SEGMENT: tl.constexpr):
    """int64 [BM, NG] offsets of FP8 row scales (groups g0 .. g0+NG) in the segment-major buffer."""
    g = (g0 + tl.arange(0, NG)).to(tl.int64)
    r = rows.to(tl.int64)
    if SINGLE_SEGMENT:
        return g[None, :] * M + r[:, None]
    else:
        seg = tl.load(row_seg_ptr + rows, mask=mask_m, other=0)
        r0 = tl.load(seg_off_ptr + seg, mask=mask_m, other=0).to(tl.int64)
        r1 = tl.load(seg_off_ptr + seg + 1, mask=mask_m, other=0).to(tl.int64)
        return (K // 128) * r0[:, None] + g[None, :] * (r1 - r0)[:, None] + (r - r0)[:, None]


@triton.jit
def bf16_to_fp4_row_kernel(x_ptr, q_ptr, s_ptr, M, K: tl.constexpr,
                           BM: tl.constexpr, BK: tl.constexpr, RULE_CEIL: tl.constexpr, X_BF16: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    mask = (rows < M)[:, None]
    r = rows.to(tl.int64)[:, None]
    for c0 in range(0, K, BK):
        lo, hi = load_pairs(x_ptr, r, c0, K, mask, BM, BK, X_BF16)
        packed, codes = _mxfp4_pairs(lo, hi, BM, BK, RULE_CEIL)
        tl.store(q_ptr + r * (K // 2) + (c0 // 2 + tl.arange(0, BK // 2))[None, :], packed, mask=mask)
        tl.store(s_ptr + r * (K // 32) + (c0 // 32 + tl.arange(0, BK // 32))[None, :], codes, mask=mask)


@triton.jit
def bf16_to_fp8_row_kernel(x_ptr, q_ptr, s_ptr, row_seg_ptr, seg_off_ptr, M, K: tl.constexpr,
                           BM: tl.constexpr, BK: tl.constexpr, SINGLE_SEGMENT: tl.constexpr,
                           EMULATE: tl.constexpr, X_BF16: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    mask_m = rows < M
    mask = mask_m[:, None]
    r = rows.to(tl.int64)[:, None]
    for c0 in range(0, K, BK):
        lo, hi = load_pairs(x_ptr, r, c0, K, mask, BM, BK, X_BF16)
        pairs, scale = _fp8_row_pairs(lo, hi, BM, BK, EMULATE)
        tl.store(q_ptr + r * (K // 2) + (c0 // 2 + tl.arange(0, BK // 2))[None, :], pairs, mask=mask)
        so = _row_scale_offsets(rows, c0 // 128, M, K, row_seg_ptr, seg_off_ptr, mask_m, BK // 128, SINGLE_SEGMENT)
        tl.store(s_ptr + so, scale, mask=mask)


@triton.jit
def bf16_to_fp4_and_fp8_row_kernel(x_ptr, q4_ptr, s4_ptr, q8_ptr, s8_ptr, row_seg_ptr, seg_off_ptr, M, K: tl.constexpr,
                                   BM: tl.constexpr, BK: tl.constexpr, RULE_CEIL: tl.constexpr,
                                   SINGLE_SEGMENT: tl.constexpr, EMULATE: tl.constexpr, X_BF16: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    mask_m = rows < M
    mask = mask_m[:, None]
    r = rows.to(tl.int64)[:, None]
    for c0 in range(0, K, BK):
        lo, hi = load_pairs(x_ptr, r, c0, K, mask, BM, BK, X_BF16)
        packed, codes = _mxfp4_pairs(lo, hi, BM, BK, RULE_CEIL)
        tl.store(q4_ptr + r * (K // 2) + (c0 // 2 + tl.arange(0, BK // 2))[None, :], packed, mask=mask)
        tl.store(s4_ptr + r * (K // 32) + (c0 // 32 + tl.arange(0, BK // 32))[None, :], codes, mask=mask)
        pairs, scale = _fp8_row_pairs(lo, hi, BM, BK, EMULATE)
        tl.store(q8_ptr + r * (K // 2) + (c0 // 2 + tl.arange(0, BK // 2))[None, :], pairs, mask=mask)
        so = _row_scale_offsets(rows, c0 // 128, M, K, row_seg_ptr, seg_off_ptr, mask_m, BK // 128, SINGLE_SEGMENT)
        tl.store(s8_ptr + so, scale, mask=mask)


@triton.jit
def _load_fp4_pairs(q_ptr, s_ptr, r, c0, mask, K, BM: tl.constexpr, BK: tl.constexpr):
    """Packed MXFP4 bytes [BM, BK/32, 16] (int32) and their UE8M0 codes [BM, BK/32] (int32)."""
    packed = tl.load(q_ptr + r * (K // 2) + (c0 // 2 + tl.arange(0, BK // 2))[None, :], mask=mask, other=0)
    code = tl.load(s_ptr + r * (K // 32) + (c0 // 32 + tl.arange(0, BK // 32))[None, :], mask=mask, other=0)
    return tl.reshape(packed.to(tl.int32), (BM, BK // 32, 16)), code.to(tl.int32)


@triton.jit
def fp4_row_to_fp8_row_kernel(q_ptr, s_ptr, o_ptr, os_ptr, row_seg_ptr, seg_off_ptr, M, K: tl.constexpr,
                              BM: tl.constexpr, BK: tl.constexpr, SINGLE_SEGMENT: tl.constexpr,
                              EMULATE: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    mask_m = rows < M
    mask = mask_m[:, None]
    r = rows.to(tl.int64)[:, None]
    for c0 in range(0, K, BK):
        packed, code = _load_fp4_pairs(q_ptr, s_ptr, r, c0, mask, K, BM, BK)
        nan_blk = (code == 255)[:, :, None]
        cg = tl.reshape(code, (BM, BK // 128, 4))
        g = tl.maximum(tl.max(tl.where(cg == 255, -1, cg), axis=2) - 6, 1)  # [BM, BK/128] group code
        gb = tl.reshape(tl.broadcast_to(g[:, :, None], (BM, BK // 128, 4)), (BM, BK // 32))
        # element = fp4 * 2**(e_k - G): exact in float32; below 2**-126 everything rounds to 0 in E4M3
        f = exp2_i(tl.maximum(tl.where(code == 255, 0, code - gb), -126))[:, :, None]
        vlo = tl.where(nan_blk, float("nan"), e2m1_value(packed & 0xF) * f)
        vhi = tl.where(nan_blk, float("nan"), e2m1_value(packed >> 4) * f)
        pairs = e4m3x2(vlo.to(tl.int32, bitcast=True), vhi.to(tl.int32, bitcast=True), EMULATE)
        tl.store(o_ptr + r * (K // 2) + (c0 // 2 + tl.arange(0, BK // 2))[None, :],
                 tl.reshape(pairs, (BM, BK // 2)), mask=mask)
        so = _row_scale_offsets(rows, c0 // 128, M, K, row_seg_ptr, seg_off_ptr, mask_m, BK // 128, SINGLE_SEGMENT)
        tl.store(os_ptr + so, exp2_i(g - 127), mask=mask)


@triton.jit
def fp4_to_bf16_kernel(q_ptr, s_ptr, o_ptr, M, K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    mask = (rows < M)[:, None]
    r = rows.to(tl.int64)[:, None]
    for c0 in range(0, K, BK):
        packed, code = _load_fp4_pairs(q_ptr, s_ptr, r, c0, mask, K, BM, BK)
        # fp4 * 2**(c-127) has 2 significant bits and lies inside BF16's range (denormals included), so the
        # top half of its float32 bits is the exact BF16 (overflow gives Inf, as a rounding cast would)
        f = ((code << 23) | tl.where(code == 0, 0x400000, 0)).to(tl.float32, bitcast=True)[:, :, None]
        vlo = (e2m1_value(packed & 0xF) * f).to(tl.int32, bitcast=True)
        vhi = (e2m1_value(packed >> 4) * f).to(tl.int32, bitcast=True)
        word = ((vlo >> 16) & 0xFFFF) | (vhi & -65536)
        word = tl.where((code == 255)[:, :, None], 0x7FC07FC0, word)  # NaN block -> two BF16 NaNs
        tl.store(o_ptr + r * (K // 2) + (c0 // 2 + tl.arange(0, BK // 2))[None, :],
                 tl.reshape(word, (BM, BK // 2)), mask=mask)


@triton.jit
def fp8_row_to_fp4_kernel(q_ptr, s_ptr, row_seg_ptr, seg_off_ptr, o_ptr, os_ptr, M, K: tl.constexpr,
                          BM: tl.constexpr, BK: tl.constexpr, RULE_CEIL: tl.constexpr,
                          SINGLE_SEGMENT: tl.constexpr, EMULATE: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    mask_m = rows < M
    mask = mask_m[:, None]
    r = rows.to(tl.int64)[:, None]
    for c0 in range(0, K, BK):
        pair = tl.load(q_ptr + r * (K // 2) + (c0 // 2 + tl.arange(0, BK // 2))[None, :], mask=mask, other=0)
        pair = pair.to(tl.int32)
        so = _row_scale_offsets(rows, c0 // 128, M, K, row_seg_ptr, seg_off_ptr, mask_m, BK // 128, SINGLE_SEGMENT)
        scale = tl.load(s_ptr + so, mask=mask, other=1.0)[:, :, None]
        p3 = tl.reshape(pair, (BM, BK // 128, 64))
        # exact: E4M3 (4 significant bits) * 2**k with k >= -126 stays >= 2**-135, inside float32
        lo = e4m3_value((p3 & 0xFF).to(tl.uint8), EMULATE) * scale
        hi = e4m3_value(((p3 >> 8) & 0xFF).to(tl.uint8), EMULATE) * scale
        packed, codes = _mxfp4_pairs(tl.reshape(lo.to(tl.int32, bitcast=True), (BM, BK // 2)),
                                     tl.reshape(hi.to(tl.int32, bitcast=True), (BM, BK // 2)), BM, BK, RULE_CEIL)
        tl.store(o_ptr + r * (K // 2) + (c0 // 2 + tl.arange(0, BK // 2))[None, :], packed, mask=mask)
        tl.store(os_ptr + r * (K // 32) + (c0 // 32 + tl.arange(0, BK // 32))[None, :], codes, mask=mask)
