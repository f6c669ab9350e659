"""Column (transposed) FP8 kernels for wgrad: FP4RowToFP8Col and BF16 -> FP8 column.

One program owns a tile of 128 tokens x BN channels of one segment (expert). It loads the tile row-major
(coalesced along channels), dequantizes to float32 in registers, reduces the per-channel amax over the
128 tokens, quantizes, and stores the tile transposed (coalesced along tokens). The register transpose
(``tl.trans``) is lowered by Triton through shared memory with a swizzled layout, which avoids bank
conflicts; nothing is written to global memory but the FP8 output and its scales.

Ragged segments: the host passes a tile table, one row per 128-token tile:
``(first input row, valid rows <= 128, segment padded offset P_e, segment padded length Mp_e,
token offset of the tile inside the segment)``. Tokens past the valid rows are written as zeros.
"""
import triton
import triton.language as tl

from .common import load_f32, ceil_log2_ratio, e2m1_value, e4m3_bits, e8m0_value, exp2_i

TILE_T = 128  # tokens per tile = one 1x128 scale group along tokens
TILE_FIELDS = 5


@triton.jit
def _store_col_tile(v, o_ptr, os_ptr, tiles_ptr, t, pid_n, K, amax_bias,
                    BN: tl.constexpr, EMULATE: tl.constexpr):
    """Quantize float32 ``v`` [128 tokens, BN] (true value = v * 2**amax_bias; NaN marks non-finite)
    per channel and store it transposed into the segment's ``[K, Mp_e]`` block with its scales."""
    p_e = tl.load(tiles_ptr + t * 5 + 2).to(tl.int64)
    mp_e = tl.load(tiles_ptr + t * 5 + 3).to(tl.int64)
    tok0 = tl.load(tiles_ptr + t * 5 + 4).to(tl.int64)
    ax = tl.abs(v)
    fin = ax < float("inf")
    amax = tl.max(tl.where(fin, ax, 0.0), axis=0)  # [BN]
    safe = tl.where(amax > 0, amax, 1.0)
    k = ceil_log2_ratio(safe, 8, 0x600000) + amax_bias  # limit 448 = 1.75 * 2**8
    k = tl.minimum(tl.maximum(k, -126), 127)
    k = tl.where(amax > 0, k, 0)
    # q = v * 2**(amax_bias - k), split in two exact factors to stay inside exp2_i's range
    sh = amax_bias - k
    q = v * exp2_i(tl.minimum(sh, 127))[None, :] * exp2_i(tl.maximum(sh - 127, 0))[None, :]
    q = tl.where(fin, q, float("nan"))
    bits = tl.trans(e4m3_bits(q, EMULATE))  # [BN, 128]
    chs = pid_n * BN + tl.arange(0, BN)
    toks = tl.arange(0, 128)
    out = o_ptr + K * p_e + chs.to(tl.int64)[:, None] * mp_e + tok0 + toks[None, :]
    tl.store(out, bits)
    tl.store(os_ptr + ((p_e + tok0) // 128) * K + chs, exp2_i(k))


@triton.jit
def fp4_row_to_fp8_col_kernel(q_ptr, s_ptr, o_ptr, os_ptr, tiles_ptr, K,
                              BN: tl.constexpr, EMULATE: tl.constexpr):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    row0 = tl.load(tiles_ptr + t * 5 + 0).to(tl.int64)
    valid = tl.load(tiles_ptr + t * 5 + 1)
    toks = tl.arange(0, 128)
    mask = (toks < valid)[:, None]
    r = row0 + toks.to(tl.int64)[:, None]
    packed = tl.load(q_ptr + r * (K // 2) + (pid_n * (BN // 2) + tl.arange(0, BN // 2))[None, :],
                     mask=mask, other=0).to(tl.int32)
    nib = tl.reshape(tl.join(packed & 0xF, packed >> 4), (128, BN))
    code = tl.load(s_ptr + r * (K // 32) + (pid_n * (BN // 32) + tl.arange(0, BN // 32))[None, :],
                   mask=mask, other=0).to(tl.int32)
    # value * 2**-8: keeps 6 * 2**127 finite in float32; exact (smallest 2**-136 is a float32 denormal)
    v = tl.reshape(e2m1_value(nib) * 0.00390625, (128, BN // 32, 32)) * e8m0_value(code)[:, :, None]
    v = tl.where((code == 255)[:, :, None], float("nan"), v)
    _store_col_tile(tl.reshape(v, (128, BN)), o_ptr, os_ptr, tiles_ptr, t, pid_n, K, 8, BN, EMULATE)


@triton.jit
def bf16_to_fp8_col_kernel(x_ptr, o_ptr, os_ptr, tiles_ptr, K, BN: tl.constexpr, EMULATE: tl.constexpr,
                           X_BF16: tl.constexpr):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    row0 = tl.load(tiles_ptr + t * 5 + 0).to(tl.int64)
    valid = tl.load(tiles_ptr + t * 5 + 1)
    toks = tl.arange(0, 128)
    mask = (toks < valid)[:, None]
    r = row0 + toks.to(tl.int64)[:, None]
    x = load_f32(x_ptr + r * K + (pid_n * BN + tl.arange(0, BN))[None, :], mask, X_BF16)
    _store_col_tile(x, o_ptr, os_ptr, tiles_ptr, t, pid_n, K, 0, BN, EMULATE)
