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
    e2m1_value,
    e4m3_bits,
    e4m3x4,
    e8m0_value,
    exp2_i,
    fp8_exp_from_amax_bits,
    load_f32,
    prmt,
    smax16x2,
)

TILE_T = 128  # tokens per tile = one 1x128 scale group along tokens
TILE_FIELDS = 5


@triton.jit
def _quant_cols(v, amax_bias, AXIS: tl.constexpr = 0):
    """Per-channel FP8 quantization of float32 ``v`` (true value = v * 2**amax_bias; NaN marks non-finite),
    the 128 tokens along ``AXIS`` ([128, N] for AXIS 0, [N, 128] for AXIS 1): (values to cast, same shape,
    float32 with NaN kept; scale exponents [N] int32)."""
    if AXIS == 0:  # tokens spread over the warps: reduced in registers and shared memory
        ax = tl.abs(v)
        fin = ax < float("inf")
        amax = tl.max(tl.where(fin, ax, 0.0), axis=0)  # [N]
    else:
        # tokens across the lanes of a warp: the max of non-negative floats is the max of their bits, an integer
        # reduction (one REDUX per warp on Hopper, where a float max takes five shuffles)
        mag = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        fin = mag < 0x7F800000
        amax = tl.max(tl.where(fin, mag, 0), axis=1).to(tl.float32, bitcast=True)  # [N]
    safe = tl.where(amax > 0, amax, 1.0)
    k = ceil_log2_ratio(safe, 8, 0x600000) + amax_bias  # limit 448 = 1.75 * 2**8
    k = tl.minimum(tl.maximum(k, -126), 127)
    k = tl.where(amax > 0, k, 0)
    # q = v * 2**(amax_bias - k), in two exact factors to stay inside exp2_i's range
    sh = amax_bias - k
    f1 = exp2_i(tl.minimum(sh, 127))
    f2 = exp2_i(tl.maximum(sh - 127, 0))
    if AXIS == 0:
        q = v * f1[None, :] * f2[None, :]
    else:
        q = v * f1[:, None] * f2[:, None]
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
def _tile(tiles_ptr, FIELDS: tl.constexpr = 5):
    """This program's tile (``tl.program_id(1)``) of a table of FIELDS int32 per tile, the first five as the module
    docstring says: (rows [128, 1] int64, their mask, P_e, Mp_e, t0)."""
    t = tl.program_id(1)
    row0 = tl.load(tiles_ptr + t * FIELDS + 0).to(tl.int64)
    valid = tl.load(tiles_ptr + t * FIELDS + 1)
    # padded offsets and lengths are multiples of 128: tell the compiler, so that stores vectorize
    p_e = tl.multiple_of(tl.load(tiles_ptr + t * FIELDS + 2), 128).to(tl.int64)
    mp_e = tl.multiple_of(tl.load(tiles_ptr + t * FIELDS + 3), 128).to(tl.int64)
    tok0 = tl.multiple_of(tl.load(tiles_ptr + t * FIELDS + 4), 128).to(tl.int64)
    toks = tl.arange(0, 128)
    return row0 + toks.to(tl.int64)[:, None], (toks < valid)[:, None], p_e, mp_e, tok0


@triton.jit
def fp4_row_to_fp8_col_kernel(q_ptr, s_ptr, o_ptr, os_ptr, tiles_ptr, K: tl.constexpr,
                              BN: tl.constexpr, EMULATE: tl.constexpr):
    pid_n = tl.program_id(0)
    r, mask, p_e, mp_e, tok0 = _tile(tiles_ptr)
    packed = tl.load(q_ptr + r * (K // 2) + (pid_n * (BN // 2) + tl.arange(0, BN // 2))[None, :], mask=mask, other=0)
    code = tl.load(s_ptr + r * (K // 32) + (pid_n * (BN // 32) + tl.arange(0, BN // 32))[None, :], mask=mask, other=0)
    # transpose the compact input (half a byte per element), not the FP8 output: channel-major [BN/2, 128]
    # tiles whose per-channel reductions run along each thread's own tokens and whose stores are token rows
    pt = tl.trans(packed).to(tl.int32)  # [BN/2, 128]: packed byte j (channels 2j, 2j+1) of every token
    ct = tl.trans(code).to(tl.int32)  # [BN/32, 128]
    e = tl.reshape(tl.broadcast_to(ct[:, None, :], (BN // 32, 16, 128)), (BN // 2, 128))
    lo_nib = pt & 0xF
    hi_nib = pt >> 4
    clo = pt & 7
    chi = hi_nib & 7
    # fast path, integer only. A nonzero element is E2M1(c) * 2**(e-127) with float32 exponent e - 127 + (c>>1) - 1
    # (mantissa 1.0 or 1.5, never above 448's 1.75), so the channel's FP8 scale exponent is
    # ceil(log2(amax/448)) = max over tokens of (e + (c>>1)) - 136, and the E4M3 byte is E2M1(c) re-biased by
    # d = e - 127 - k: exact while e >= 2 (normal float32 values) and d >= -5 (an E4M3 normal), else the
    # general path below
    nzlo = clo != 0
    nzhi = chi != 0
    klo = _fp8_exp_from_key(tl.max(tl.where(nzlo, e + (clo >> 1), 0), axis=1))  # [BN/2]
    khi = _fp8_exp_from_key(tl.max(tl.where(nzhi, e + (chi >> 1), 0), axis=1))
    min_lo = tl.min(tl.where(nzlo, e, 255), axis=1)  # smallest block code holding a nonzero element, per channel
    min_hi = tl.min(tl.where(nzhi, e, 255), axis=1)
    exact = (min_lo >= tl.maximum(klo + 122, 2)) & (min_hi >= tl.maximum(khi + 122, 2))
    if (tl.min(exact.to(tl.int32), axis=0) == 1) & (tl.max(tl.max(ct, axis=1), axis=0) < 255):
        e8 = e * 8
        blo = (_e4m3_mag(clo, e8 - (8 * (121 + klo))[:, None]) | ((pt & 8) << 4)).to(tl.uint8)
        bhi = (_e4m3_mag(chi, e8 - (8 * (121 + khi))[:, None]) | (pt & 0x80)).to(tl.uint8)
        kl = klo
        kh = khi
    else:
        # general path: exact float32 values (times 2**-8, which keeps 6 * 2**127 finite; the smallest,
        # 2**-136, is a float32 denormal), hardware E4M3 rounding
        f = tl.where(e == 255, float("nan"), e8m0_value(e) * 0.00390625)
        qlo, kl = _quant_cols(e2m1_value(lo_nib) * f, 8, 1)
        qhi, kh = _quant_cols(e2m1_value(hi_nib) * f, 8, 1)
        blo = e4m3_bits(qlo, EMULATE)
        bhi = e4m3_bits(qhi, EMULATE)
    ch = pid_n * BN + 2 * tl.arange(0, BN // 2)
    _store_rows(blo, kl, o_ptr, os_ptr, ch, p_e, mp_e, tok0, K)
    _store_rows(bhi, kh, o_ptr, os_ptr, ch + 1, p_e, mp_e, tok0, K)


@triton.jit
def _store_rows(bits, k, o_ptr, os_ptr, chs, p_e, mp_e, tok0, K: tl.constexpr):
    """Store E4M3 ``bits`` [N channels, 128 tokens] (uint8) as rows ``chs`` [N] of the segment's [K, Mp_e]
    block, and the scales 2**k [N]."""
    toks = tl.arange(0, 128)
    tl.store(o_ptr + K * p_e + chs.to(tl.int64)[:, None] * mp_e + tok0 + toks[None, :], bits)
    tl.store(os_ptr + ((p_e + tok0) // 128) * K + chs, exp2_i(k))


@triton.jit
def _fp8_exp_from_key(key):
    """FP8 scale exponent of a channel from its largest key e + (c>>1) (0: no nonzero element): key - 136
    clamped to [-126, 127], 0 for an all-zero channel (== fp8_exp_from_amax_bits of the amax's bits)."""
    return tl.where(key > 0, tl.minimum(tl.maximum(key - 136, -126), 127), 0)


@triton.jit
def _e4m3_mag(c, base):
    """E4M3 magnitude byte of E2M1 magnitude code ``c`` scaled so that 0.5 lands on the E4M3 byte ``base``
    (= 8 * (6 + d) for a factor 2**d): 4c + base for c >= 2, base for c = 1, 0 for c = 0."""
    return tl.where(c >= 2, 4 * c + base, tl.where(c == 1, base, 0))


@triton.jit
def _smax16x2(a, b):
    """``common.smax16x2`` as a reduction combine (two arguments): the PTX instruction."""
    return smax16x2(a, b, False)


@triton.jit
def _bf16_pairs_to_fp8_col(w_ptr, o_ptr, os_ptr, tiles_ptr, K: tl.constexpr, BN: tl.constexpr, EMULATE: tl.constexpr):
    """BF16 -> FP8 column on 32-bit words of two channels (2j in the low half, 2j+1 in the high half).

    Per word: m = |x| bits of both lanes (one LOP3); u = m + 0x0080 per lane (no carry between lanes: m <= 0x7FFF)
    maps the finite magnitudes 0..0x7F7F to 0x0080..0x7FFF and Inf/NaN (0x7F80..0x7FFF) to 0x8000..0x807F, negative
    as s16, so the per-channel finite amax + 0x80 is a ``max.s16x2`` reduction of u over the 128 tokens (the padding
    tokens load 0, a finite zero; a channel of only Inf/NaN gets a negative key, amax 0). u's lane sign bits also
    mark the non-finite lanes: one LOP3 clears the sign of those lanes in x, and each lane becomes float32 with one
    PRMT that fills the low 16 bits with copies of that mark (finite: the exact value; Inf/NaN: a positive NaN,
    which FMUL and ``cvt.rn.satfinite.e4m3x2`` keep a NaN, 0x7F, as the reference). The scaled float32 values of
    two consecutive tokens of one channel go through one ``cvt.rn.satfinite.e4m3x2.f32``, so that after the
    transpose (16-bit pairs, through shared memory) one PRMT joins two such pairs into the output word of four
    tokens."""
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    row0 = tl.load(tiles_ptr + t * 5 + 0).to(tl.int64)
    valid = tl.load(tiles_ptr + t * 5 + 1)
    p_e = tl.multiple_of(tl.load(tiles_ptr + t * 5 + 2), 128)
    mp_e = tl.multiple_of(tl.load(tiles_ptr + t * 5 + 3), 128)
    tok0 = tl.multiple_of(tl.load(tiles_ptr + t * 5 + 4), 128)
    # tokens 2i + p as [i, p, word]: each thread gets both tokens of a pair (Triton's load layout gives threads to
    # dimension 1 last)
    tp = tl.arange(0, 64)[:, None, None]
    par = tl.arange(0, 2)[None, :, None]
    words = pid_n * (BN // 2) + tl.arange(0, BN // 2)[None, None, :]
    tok = 2 * tp + par
    # one 64-bit base per program, 32-bit offsets inside the tile (128 * K/2 words)
    w = tl.load(w_ptr + row0 * (K // 2) + (tok * (K // 2) + words), mask=tok < valid, other=0)  # [64, 2, BN/2]
    m = w & 0x7FFF7FFF
    u = m + 0x00800080
    if EMULATE:  # the same per 16-bit lane with tl.max: the interpreter runs a custom combine once per scalar
        lo = tl.max(tl.max((u << 16) >> 16, 1), 0)
        hi = tl.max(tl.max(u >> 16, 1), 0)
        key = (lo & 0xFFFF) | (hi << 16)  # [BN/2]
    else:
        key = tl.reduce(tl.reduce(u, 1, _smax16x2), 0, _smax16x2)
    a_lo = tl.maximum(((key << 16) >> 16) - 0x80, 0) << 16  # float32 bits of channel 2j's finite amax
    a_hi = tl.maximum((key >> 16) - 0x80, 0) << 16
    k_lo = fp8_exp_from_amax_bits(a_lo)
    k_hi = fp8_exp_from_amax_bits(a_hi)
    wf = w & ~(u & -2147450880)  # 0x80008000: the sign bit of the non-finite lanes cleared
    lo = prmt(wf, u, 0x10DD, EMULATE).to(tl.float32, bitcast=True) * exp2_i(-k_lo)[None, None, :]
    hi = prmt(wf, u, 0x32FF, EMULATE).to(tl.float32, bitcast=True) * exp2_i(-k_hi)[None, None, :]
    lo0, lo1 = tl.split(tl.permute(lo.to(tl.int32, bitcast=True), (0, 2, 1)))  # [64, BN/2]: tokens 2i, 2i+1
    hi0, hi1 = tl.split(tl.permute(hi.to(tl.int32, bitcast=True), (0, 2, 1)))
    q = e4m3x4(lo0, lo1, hi0, hi1, EMULATE)  # [64, BN/2]: bytes (2j, 2i), (2j, 2i+1), (2j+1, 2i), (2j+1, 2i+1)
    qt = tl.trans(q)  # [BN/2, 64]
    q0, q1 = tl.split(tl.reshape(qt, (BN // 2, 32, 2)))
    out = tl.reshape(tl.permute(tl.join(prmt(q0, q1, 0x5410, EMULATE), prmt(q0, q1, 0x7632, EMULATE)), (0, 2, 1)),
                     (BN, 32))  # tokens 4i..4i+3 of one channel
    # the segment's [K, Mp_e] block, channel pid_n * BN, token tok0 (64-bit); BN rows of Mp_e bytes inside (32-bit)
    base = (K * p_e.to(tl.int64) + pid_n * BN * mp_e.to(tl.int64) + tok0) // 4
    tl.store(o_ptr + base + (tl.arange(0, BN)[:, None] * (mp_e // 4) + tl.arange(0, 32)[None, :]), out)
    tl.store(os_ptr + ((p_e + tok0) // 128) * K + pid_n * BN + 2 * tl.arange(0, BN // 2), exp2_i(k_lo))
    tl.store(os_ptr + ((p_e + tok0) // 128) * K + pid_n * BN + 2 * tl.arange(0, BN // 2) + 1, exp2_i(k_hi))


@triton.jit
def bf16_to_fp8_col_kernel(x_ptr, o_ptr, os_ptr, tiles_ptr, K: tl.constexpr, BN: tl.constexpr,
                           EMULATE: tl.constexpr, X_BF16: tl.constexpr):
    """X_BF16: ``x_ptr`` holds int32 words of two BF16 channels and ``o_ptr`` int32 words of four FP8 bytes
    (_bf16_pairs_to_fp8_col); else float inputs and uint8 output."""
    if X_BF16:
        _bf16_pairs_to_fp8_col(x_ptr, o_ptr, os_ptr, tiles_ptr, K, BN, EMULATE)
    else:
        pid_n = tl.program_id(0)
        r, mask, p_e, mp_e, tok0 = _tile(tiles_ptr)
        ch = pid_n * BN + tl.arange(0, BN)
        x = load_f32(x_ptr + r * K + ch[None, :], mask, False)
        q, k = _quant_cols(x, 0)
        _store_cols(e4m3_bits(q, EMULATE), k, o_ptr, os_ptr, ch, p_e, mp_e, tok0, K)


ROW_COL_TILE_FIELDS: tl.constexpr = tl.constexpr(6)  # the column tile table's five fields, then the segment's tokens


@triton.jit
def _load_x(x_ptr, p_ptr, r, ch, mask, K: tl.constexpr, X_BF16: tl.constexpr):
    """``row_col_tile``'s loader for an operand in memory: float32 ``[128, BN]`` of x ``[M, K]`` (BF16 as int16 bits
    when X_BF16, else float32) at rows ``r`` ``[128, 1]``, channels ``ch`` ``[BN]`` (``p_ptr`` unused)."""
    return load_f32(x_ptr + r * K + ch[None, :], mask, X_BF16)


@triton.jit
def finite_amax_bits(x):
    """Each row's largest finite magnitude of float32 ``x`` ``[128, N]``, as its float32 bits ``[128]`` (0 for none)."""
    mag = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.max(tl.where(mag < 0x7F800000, mag, 0), axis=1)


@triton.jit
def store_row_scales(qs_ptr, k_row, r, mask, s0, count, grp, K: tl.constexpr):
    """The FP8 row scales 2**k_row ``[128]`` of 128-channel group ``grp`` for rows ``r`` ``[128, 1]`` of the segment
    whose first row is ``s0`` and token count ``count``: its scales are ``[K/128, count]`` channel-group-major
    (``row._row_scale_offset``)."""
    tl.store(qs_ptr + (K // 128) * s0 + grp * count + (r - s0), exp2_i(k_row)[:, None], mask=mask)


@triton.jit
def store_row_col_chunk(x, k_row, q_ptr, o_ptr, os_ptr, r, ch, mask, p_e, mp_e, tok0, K: tl.constexpr,
                        COLS: tl.constexpr, EMULATE: tl.constexpr):
    """Store float32 ``x`` ``[128 tokens, BN channels]`` (channels ``ch`` of rows ``r``) as FP8 1x128 rows with the
    scale exponents ``k_row`` ``[128]`` (``[M, K]`` row-major), and, when COLS, as FP8 columns (per channel over the
    128 tokens, stored transposed with their scales: ``_store_cols``)."""
    fin = (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000
    q_row = tl.where(fin, x * exp2_i(-k_row)[:, None], float("nan"))
    tl.store(q_ptr + r * K + ch[None, :], e4m3_bits(q_row, EMULATE), mask=mask)
    if COLS:
        q_col, k_col = _quant_cols(x, 0)
        _store_cols(e4m3_bits(q_col, EMULATE), k_col, o_ptr, os_ptr, ch, p_e, mp_e, tok0, K)


@triton.jit
def row_col_tile_header(tiles_ptr):
    """This program's tile of a ``ROW_COL_TILE_FIELDS`` table: ``_tile``'s (rows [128, 1] int64, their mask, P_e,
    Mp_e, t0), then the segment's first row and its token count (where ``store_row_scales`` puts the row scales)."""
    r, mask, p_e, mp_e, tok0 = _tile(tiles_ptr, ROW_COL_TILE_FIELDS)
    s0 = tl.load(tiles_ptr + tl.program_id(1) * ROW_COL_TILE_FIELDS).to(tl.int64) - tok0
    count = tl.load(tiles_ptr + tl.program_id(1) * ROW_COL_TILE_FIELDS + 5).to(tl.int64)
    return r, mask, p_e, mp_e, tok0, s0, count


@triton.jit
def row_col_tile(src_ptr, p_ptr, q_ptr, qs_ptr, o_ptr, os_ptr, tiles_ptr, K: tl.constexpr, BN: tl.constexpr,
                 COLS: tl.constexpr, EMULATE: tl.constexpr, LOAD: tl.constexpr, FLAG: tl.constexpr):
    """One program of the FP8 row (+ column) quantizers: 128 tokens of one segment (a column tile,
    ``ROW_COL_TILE_FIELDS``) x the 128-channel group ``tl.program_id(0)`` of an operand ``[M, K]`` whose float32
    values ``LOAD(src_ptr, p_ptr, rows [128, 1], channels [BN], mask, K, FLAG)`` gives (``_load_x``: read from memory;
    ``fused_swiglu``: computed from the SwiGLU's input), in chunks of BN channels. A first pass over the chunks takes
    each token's amax (the row scales), a second loads each chunk again (from L1 / L2) and stores its row copy (and,
    when COLS, its column copy), so at most one ``[128, BN]`` float32 chunk is live (BN = 128: one pass over the
    whole tile in registers)."""
    pid_n = tl.program_id(0)
    r, mask, p_e, mp_e, tok0, s0, count = row_col_tile_header(tiles_ptr)
    # ---- the row scales: each token's finite amax over its 128-channel group
    amax = tl.zeros([128], dtype=tl.int32)
    for c in range(128 // BN):
        ch = pid_n * 128 + c * BN + tl.arange(0, BN)
        amax = tl.maximum(amax, finite_amax_bits(LOAD(src_ptr, p_ptr, r, ch, mask, K, FLAG)))
    k_row = fp8_exp_from_amax_bits(amax)  # [128]
    store_row_scales(qs_ptr, k_row, r, mask, s0, count, pid_n, K)
    # ---- per chunk: the row copy with those scales, the column copy (padding tokens load as zeros)
    for c in range(128 // BN):
        ch = pid_n * 128 + c * BN + tl.arange(0, BN)
        x = LOAD(src_ptr, p_ptr, r, ch, mask, K, FLAG)  # [128 tokens, BN channels]
        store_row_col_chunk(x, k_row, q_ptr, o_ptr, os_ptr, r, ch, mask, p_e, mp_e, tok0, K, COLS, EMULATE)


@triton.jit
def bf16_to_fp8_row_col_kernel(x_ptr, q_ptr, qs_ptr, o_ptr, os_ptr, tiles_ptr, K: tl.constexpr, BN: tl.constexpr,
                               EMULATE: tl.constexpr, X_BF16: tl.constexpr):
    """BF16 (or float32) -> FP8 1x128 rows and FP8 columns from one read of HBM: the FP8 recipe's two copies of an
    operand (fprop / dgrad rows, wgrad columns), by ``row_col_tile`` (one program: 128 tokens of one segment x one
    128-channel group, in chunks of BN channels); rows ``[M, K]`` row-major, scales segment-major as
    ``row._row_scale_offset``; columns as ``bf16_to_fp8_col_kernel``'s float path.
    Tile table: the column kernels' five fields, then the segment's token count (``ROW_COL_TILE_FIELDS``)."""
    row_col_tile(x_ptr, x_ptr, q_ptr, qs_ptr, o_ptr, os_ptr, tiles_ptr, K, BN, True, EMULATE, _load_x, X_BF16)
