"""Column (transposed) FP8 kernels for wgrad: FP4RowToFP8Col and BF16 -> FP8 column.

One program owns a tile of 128 tokens x BN channels of one segment (expert). It loads the tile row-major
(coalesced along channels), dequantizes to float32 in registers, reduces the per-channel amax over the
128 tokens, quantizes, and stores the tile transposed (coalesced along tokens). The register transpose
(``tl.trans``) is lowered by Triton through shared memory with a swizzled layout, which avoids bank
conflicts; nothing is written to global memory but the FP8 output and its scales. MXFP4 input is handled
as even / odd channel halves (low / high nibbles), so no nibble interleaving is needed before the
transpose. The channel block is the fastest grid axis, so programs running together read neighbouring
bytes of the same rows (the UE8M0 scale bytes of a row are shared through L2).

Ragged segments: the host passes a tile table, one row per 128-token tile:
``(first input row, valid rows <= 128, segment padded offset P_e, segment padded length Mp_e,
token offset of the tile inside the segment)``. Tokens past the valid rows are written as zeros.
"""
import triton
import triton.language as tl

from .common import (
    ceil_log2_ratio,
    e2m1_to_e4m3_shifted,
    e2m1_value,
    e4m3_bits,
    e8m0_value,
    exp2_i,
    fp8_exp_from_amax_bits,
    load_f32,
)

TILE_T = 128  # tokens per tile = one 1x128 scale group along tokens
TILE_FIELDS = 5


@triton.jit
def _quant_cols(v, amax_bias):
    """Per-channel FP8 quantization of float32 ``v`` [128 tokens, N] (true value = v * 2**amax_bias; NaN
    marks non-finite): (values to cast [128, N] float32 with NaN kept, scale exponents [N] int32)."""
    ax = tl.abs(v)
    fin = ax < float("inf")
    amax = tl.max(tl.where(fin, ax, 0.0), axis=0)  # [N]
    safe = tl.where(amax > 0, amax, 1.0)
    k = ceil_log2_ratio(safe, 8, 0x600000) + amax_bias  # limit 448 = 1.75 * 2**8
    k = tl.minimum(tl.maximum(k, -126), 127)
    k = tl.where(amax > 0, k, 0)
    # q = v * 2**(amax_bias - k), in two exact factors to stay inside exp2_i's range
    sh = amax_bias - k
    q = v * exp2_i(tl.minimum(sh, 127))[None, :] * exp2_i(tl.maximum(sh - 127, 0))[None, :]
    return tl.where(fin, q, float("nan")), k


@triton.jit
def _store_cols(bits, k, o_ptr, os_ptr, chs, p_e, mp_e, tok0, K: tl.constexpr):
    """Store E4M3 ``bits`` [128 tokens, N] (uint8) transposed as rows ``chs`` [N] of the segment's
    [K, Mp_e] block, and the scales 2**k [N]."""
    bits = tl.trans(bits)  # [N, 128]
    toks = tl.arange(0, 128)
    tl.store(o_ptr + K * p_e + chs.to(tl.int64)[:, None] * mp_e + tok0 + toks[None, :], bits)
    tl.store(os_ptr + ((p_e + tok0) // 128) * K + chs, exp2_i(k))


@triton.jit
def _tile(tiles_ptr):
    t = tl.program_id(1)
    row0 = tl.load(tiles_ptr + t * 5 + 0).to(tl.int64)
    valid = tl.load(tiles_ptr + t * 5 + 1)
    # padded offsets and lengths are multiples of 128: tell the compiler, so that stores vectorize
    p_e = tl.multiple_of(tl.load(tiles_ptr + t * 5 + 2), 128).to(tl.int64)
    mp_e = tl.multiple_of(tl.load(tiles_ptr + t * 5 + 3), 128).to(tl.int64)
    tok0 = tl.multiple_of(tl.load(tiles_ptr + t * 5 + 4), 128).to(tl.int64)
    toks = tl.arange(0, 128)
    return row0 + toks.to(tl.int64)[:, None], (toks < valid)[:, None], p_e, mp_e, tok0


@triton.jit
def fp4_row_to_fp8_col_kernel(q_ptr, s_ptr, o_ptr, os_ptr, tiles_ptr, K: tl.constexpr,
                              BN: tl.constexpr, EMULATE: tl.constexpr):
    pid_n = tl.program_id(0)
    r, mask, p_e, mp_e, tok0 = _tile(tiles_ptr)
    packed = tl.load(q_ptr + r * (K // 2) + (pid_n * (BN // 2) + tl.arange(0, BN // 2))[None, :],
                     mask=mask, other=0).to(tl.int32)
    code = tl.load(s_ptr + r * (K // 32) + (pid_n * (BN // 32) + tl.arange(0, BN // 32))[None, :],
                   mask=mask, other=0).to(tl.int32)
    p3 = tl.reshape(packed, (128, BN // 32, 16))
    lo_nib = p3 & 0xF
    hi_nib = p3 >> 4
    e = code[:, :, None]
    # fast path: |value| bits built by integer arithmetic (exact while e >= 2: normal float32), per-channel
    # amax as an integer max, and the E4M3 byte by re-biasing (exact while it is an E4M3 normal)
    vlo = _mag_bits(lo_nib, e)
    vhi = _mag_bits(hi_nib, e)
    klo = fp8_exp_from_amax_bits(tl.max(vlo, axis=0))  # [BN/32, 16]
    khi = fp8_exp_from_amax_bits(tl.max(vhi, axis=0))
    dlo = e - 127 - klo[None, :, :]
    dhi = e - 127 - khi[None, :, :]
    slow = ((((lo_nib & 7) != 0) & ((e < 2) | (dlo < -5))) | (((hi_nib & 7) != 0) & ((e < 2) | (dhi < -5)))
            | (e == 255))
    if tl.max(slow.to(tl.int32)) == 0:
        blo = tl.reshape(e2m1_to_e4m3_shifted(lo_nib, dlo), (128, BN // 2)).to(tl.uint8)
        bhi = tl.reshape(e2m1_to_e4m3_shifted(hi_nib, dhi), (128, BN // 2)).to(tl.uint8)
        kl = tl.reshape(klo, (BN // 2,))
        kh = tl.reshape(khi, (BN // 2,))
    else:
        # general path: exact float32 values (times 2**-8, which keeps 6 * 2**127 finite; the smallest,
        # 2**-136, is a float32 denormal), hardware E4M3 rounding
        f = tl.where(code == 255, float("nan"), e8m0_value(code) * 0.00390625)[:, :, None]
        qlo, kl = _quant_cols(tl.reshape(e2m1_value(lo_nib) * f, (128, BN // 2)), 8)
        qhi, kh = _quant_cols(tl.reshape(e2m1_value(hi_nib) * f, (128, BN // 2)), 8)
        blo = e4m3_bits(qlo, EMULATE)
        bhi = e4m3_bits(qhi, EMULATE)
    ch = pid_n * BN + 2 * tl.arange(0, BN // 2)
    _store_cols(blo, kl, o_ptr, os_ptr, ch, p_e, mp_e, tok0, K)
    _store_cols(bhi, kh, o_ptr, os_ptr, ch + 1, p_e, mp_e, tok0, K)


@triton.jit
def _mag_bits(nib, e):
    """float32 bits of |E2M1 code| * 2**(e-127) (int32), exact for e >= 2; 0 for a zero code."""
    c = nib & 7
    fb = tl.where(c >= 2, (c + 252) << 22, 252 << 22)  # 1.0..6.0, or 0.5 for c == 1
    return tl.where(c == 0, 0, fb + ((e - 127) << 23))


@triton.jit
def bf16_to_fp8_col_kernel(x_ptr, o_ptr, os_ptr, tiles_ptr, K: tl.constexpr, BN: tl.constexpr,
                           EMULATE: tl.constexpr, X_BF16: tl.constexpr):
    pid_n = tl.program_id(0)
    r, mask, p_e, mp_e, tok0 = _tile(tiles_ptr)
    ch = pid_n * BN + tl.arange(0, BN)
    x = load_f32(x_ptr + r * K + ch[None, :], mask, X_BF16)
    q, k = _quant_cols(x, 0)
    _store_cols(e4m3_bits(q, EMULATE), k, o_ptr, os_ptr, ch, p_e, mp_e, tok0, K)
