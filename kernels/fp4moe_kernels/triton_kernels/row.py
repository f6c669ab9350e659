"""Row-wise conversion kernels: each program converts a ``[BM tokens, BK channels]`` tile in registers.

Kernels here never write an intermediate tensor: BF16ToFP4Row, FP4RowToFP8Row, FP8ToFP4, the fused
BF16 -> (MXFP4, FP8 row), MXFP4 -> BF16, BF16 -> FP8 row. Layouts are those of ``fp4moe_kernels.formats``.
Ragged segments only change where FP8 row scales go (segment-major); a per-row segment id is passed.
"""
import triton
import triton.language as tl

from .common import (
    e2m1_code,
    e2m1_value,
    e4m3_bits,
    e4m3_value,
    e8m0_value,
    bf16_bits_exact,
    load_f32,
    exp2_i,
    fp8_scale_exp,
    mx_scale_code,
)


@triton.jit
def _mxfp4_quant_tile(x, BM: tl.constexpr, BK: tl.constexpr, RULE_CEIL: tl.constexpr):
    """float32 [BM, BK] -> (packed codes [BM, BK/2] uint8, UE8M0 codes [BM, BK/32] uint8)."""
    xb = tl.reshape(x, (BM, BK // 32, 32))
    ax = tl.abs(xb)
    fin = ax < float("inf")  # False for +-Inf and NaN
    all_fin = tl.min(fin.to(tl.int32), axis=2) == 1
    amax = tl.max(tl.where(fin, ax, 0.0), axis=2)
    code = mx_scale_code(amax, all_fin, RULE_CEIL)  # [BM, BK/32] int32
    # |x| * 2**(127 - code), exact; 2**-127 (code 254) as 2**-126 * 0.5
    inv = exp2_i(tl.minimum(127 - code, 127) + tl.where(code >= 254, 1, 0))
    inv = tl.where(code >= 254, inv * 0.5, inv)
    q = ax * inv[:, :, None]
    mag = e2m1_code(tl.where(fin, q, 0.0))
    sign = tl.where(xb.to(tl.int32, bitcast=True) < 0, 8, 0)
    nib = tl.where(all_fin[:, :, None], mag | sign, 0)
    lo, hi = tl.split(tl.reshape(nib, (BM, BK // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    return packed, code.to(tl.uint8)


@triton.jit
def _fp8_row_quant_tile(x, BM: tl.constexpr, BK: tl.constexpr, EMULATE: tl.constexpr):
    """float32 [BM, BK] -> (E4M3 bits [BM, BK] uint8, scales [BM, BK/128] float32)."""
    xg = tl.reshape(x, (BM, BK // 128, 128))
    ax = tl.abs(xg)
    fin = ax < float("inf")
    amax = tl.max(tl.where(fin, ax, 0.0), axis=2)
    k = fp8_scale_exp(amax)  # [-126, 121] for finite float32 inputs
    q = xg * exp2_i(-k)[:, :, None]
    q = tl.where(fin, q, float("nan"))
    bits = tl.reshape(e4m3_bits(q, EMULATE), (BM, BK))
    return bits, exp2_i(k)


@triton.jit
def _row_scale_offsets(rows, pid_k, M, K, row_seg_ptr, seg_off_ptr, mask_m,
                       BK: tl.constexpr, SINGLE_SEGMENT: tl.constexpr):
    """int64 [BM, BK/128] offsets of the FP8 row scales of this tile in the segment-major buffer."""
    G = K // 128
    g = (pid_k * (BK // 128) + tl.arange(0, BK // 128)).to(tl.int64)
    r = rows.to(tl.int64)
    if SINGLE_SEGMENT:
        return g[None, :] * M + r[:, None]
    else:
        seg = tl.load(row_seg_ptr + rows, mask=mask_m, other=0)
        r0 = tl.load(seg_off_ptr + seg, mask=mask_m, other=0).to(tl.int64)
        r1 = tl.load(seg_off_ptr + seg + 1, mask=mask_m, other=0).to(tl.int64)
        return G * r0[:, None] + g[None, :] * (r1 - r0)[:, None] + (r - r0)[:, None]


@triton.jit
def bf16_to_fp4_row_kernel(x_ptr, q_ptr, s_ptr, M, K,
                           BM: tl.constexpr, BK: tl.constexpr, RULE_CEIL: tl.constexpr, X_BF16: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    mask = rows < M
    r = rows.to(tl.int64)[:, None]
    x = load_f32(x_ptr + r * K + (pid_k * BK + tl.arange(0, BK))[None, :], mask[:, None], X_BF16)
    packed, codes = _mxfp4_quant_tile(x, BM, BK, RULE_CEIL)
    tl.store(q_ptr + r * (K // 2) + (pid_k * (BK // 2) + tl.arange(0, BK // 2))[None, :], packed, mask=mask[:, None])
    tl.store(s_ptr + r * (K // 32) + (pid_k * (BK // 32) + tl.arange(0, BK // 32))[None, :], codes, mask=mask[:, None])


@triton.jit
def bf16_to_fp8_row_kernel(x_ptr, q_ptr, s_ptr, row_seg_ptr, seg_off_ptr, M, K,
                           BM: tl.constexpr, BK: tl.constexpr, SINGLE_SEGMENT: tl.constexpr,
                           EMULATE: tl.constexpr, X_BF16: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    mask = rows < M
    r = rows.to(tl.int64)[:, None]
    cols = (pid_k * BK + tl.arange(0, BK))[None, :]
    x = load_f32(x_ptr + r * K + cols, mask[:, None], X_BF16)
    bits, scale = _fp8_row_quant_tile(x, BM, BK, EMULATE)
    tl.store(q_ptr + r * K + cols, bits, mask=mask[:, None])
    so = _row_scale_offsets(rows, pid_k, M, K, row_seg_ptr, seg_off_ptr, mask, BK, SINGLE_SEGMENT)
    tl.store(s_ptr + so, scale, mask=mask[:, None])


@triton.jit
def bf16_to_fp4_and_fp8_row_kernel(x_ptr, q4_ptr, s4_ptr, q8_ptr, s8_ptr, row_seg_ptr, seg_off_ptr, M, K,
                                   BM: tl.constexpr, BK: tl.constexpr, RULE_CEIL: tl.constexpr,
                                   SINGLE_SEGMENT: tl.constexpr, EMULATE: tl.constexpr, X_BF16: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    mask = rows < M
    r = rows.to(tl.int64)[:, None]
    cols = (pid_k * BK + tl.arange(0, BK))[None, :]
    x = load_f32(x_ptr + r * K + cols, mask[:, None], X_BF16)
    packed, codes = _mxfp4_quant_tile(x, BM, BK, RULE_CEIL)
    tl.store(q4_ptr + r * (K // 2) + (pid_k * (BK // 2) + tl.arange(0, BK // 2))[None, :], packed, mask=mask[:, None])
    tl.store(s4_ptr + r * (K // 32) + (pid_k * (BK // 32) + tl.arange(0, BK // 32))[None, :], codes, mask=mask[:, None])
    bits, scale = _fp8_row_quant_tile(x, BM, BK, EMULATE)
    tl.store(q8_ptr + r * K + cols, bits, mask=mask[:, None])
    so = _row_scale_offsets(rows, pid_k, M, K, row_seg_ptr, seg_off_ptr, mask, BK, SINGLE_SEGMENT)
    tl.store(s8_ptr + so, scale, mask=mask[:, None])


@triton.jit
def _load_fp4_tile(q_ptr, s_ptr, r, pid_k, mask, K, BM: tl.constexpr, BK: tl.constexpr):
    """Load an MXFP4 tile: (4-bit codes [BM, BK] int32, UE8M0 codes [BM, BK/32] int32)."""
    packed = tl.load(q_ptr + r * (K // 2) + (pid_k * (BK // 2) + tl.arange(0, BK // 2))[None, :],
                     mask=mask[:, None], other=0).to(tl.int32)
    nib = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BM, BK))
    code = tl.load(s_ptr + r * (K // 32) + (pid_k * (BK // 32) + tl.arange(0, BK // 32))[None, :],
                   mask=mask[:, None], other=0).to(tl.int32)
    return nib, code


@triton.jit
def fp4_row_to_fp8_row_kernel(q_ptr, s_ptr, o_ptr, os_ptr, row_seg_ptr, seg_off_ptr, M, K,
                              BM: tl.constexpr, BK: tl.constexpr, SINGLE_SEGMENT: tl.constexpr,
                              EMULATE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    mask = rows < M
    r = rows.to(tl.int64)[:, None]
    nib, code = _load_fp4_tile(q_ptr, s_ptr, r, pid_k, mask, K, BM, BK)
    nan_blk = code == 255
    cg = tl.reshape(code, (BM, BK // 128, 4))
    emax = tl.max(tl.where(cg == 255, -1, cg), axis=2)
    g = tl.maximum(emax - 6, 1)  # [BM, BK/128] group code
    gb = tl.reshape(tl.broadcast_to(g[:, :, None], (BM, BK // 128, 4)), (BM, BK // 32))
    d = tl.maximum(tl.where(nan_blk, 0, code - gb), -126)  # <= 6; below -126 everything rounds to 0
    v = tl.reshape(e2m1_value(nib), (BM, BK // 32, 32)) * exp2_i(d)[:, :, None]
    v = tl.where(nan_blk[:, :, None], float("nan"), v)
    bits = tl.reshape(e4m3_bits(v, EMULATE), (BM, BK))
    tl.store(o_ptr + r * K + (pid_k * BK + tl.arange(0, BK))[None, :], bits, mask=mask[:, None])
    so = _row_scale_offsets(rows, pid_k, M, K, row_seg_ptr, seg_off_ptr, mask, BK, SINGLE_SEGMENT)
    tl.store(os_ptr + so, exp2_i(g - 127), mask=mask[:, None])


@triton.jit
def fp4_to_bf16_kernel(q_ptr, s_ptr, o_ptr, M, K, BM: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    mask = rows < M
    r = rows.to(tl.int64)[:, None]
    nib, code = _load_fp4_tile(q_ptr, s_ptr, r, pid_k, mask, K, BM, BK)
    v = tl.reshape(e2m1_value(nib), (BM, BK // 32, 32)) * e8m0_value(code)[:, :, None]
    v = tl.where((code == 255)[:, :, None], float("nan"), v)
    v = tl.reshape(v, (BM, BK))
    # fp4 * 2**(c-127) has 2 significant bits and lies inside BF16's range (denormals included), so the
    # top half of the float32 bits is the exact BF16 (overflow gives Inf, as a rounding cast would)
    tl.store(o_ptr + r * K + (pid_k * BK + tl.arange(0, BK))[None, :], bf16_bits_exact(v), mask=mask[:, None])


@triton.jit
def fp8_row_to_fp4_kernel(q_ptr, s_ptr, row_seg_ptr, seg_off_ptr, o_ptr, os_ptr, M, K,
                          BM: tl.constexpr, BK: tl.constexpr, RULE_CEIL: tl.constexpr,
                          SINGLE_SEGMENT: tl.constexpr, EMULATE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    mask = rows < M
    r = rows.to(tl.int64)[:, None]
    bits = tl.load(q_ptr + r * K + (pid_k * BK + tl.arange(0, BK))[None, :], mask=mask[:, None], other=0)
    so = _row_scale_offsets(rows, pid_k, M, K, row_seg_ptr, seg_off_ptr, mask, BK, SINGLE_SEGMENT)
    scale = tl.load(s_ptr + so, mask=mask[:, None], other=1.0)
    x = tl.reshape(e4m3_value(bits, EMULATE), (BM, BK // 128, 128)) * scale[:, :, None]
    packed, codes = _mxfp4_quant_tile(tl.reshape(x, (BM, BK)), BM, BK, RULE_CEIL)
    tl.store(o_ptr + r * (K // 2) + (pid_k * (BK // 2) + tl.arange(0, BK // 2))[None, :], packed, mask=mask[:, None])
    tl.store(os_ptr + r * (K // 32) + (pid_k * (BK // 32) + tl.arange(0, BK // 32))[None, :], codes, mask=mask[:, None])
