"""Row-wise conversion kernels over *flat* block sequences.

A row-major ``[M, K]`` tensor with K a multiple of 32 (128) is a flat sequence of 32-element MXFP4 blocks
(128-element FP8 groups): block b holds elements ``32b .. 32b+31``, group g elements ``128g .. 128g+127``,
row ``g // (K/128)``. Each program converts ``R`` consecutive blocks / groups, laid out as ``[R, 16]`` or
``[R, 64]`` element pairs, so every load and store is a contiguous run per row of the tile (wide vector
accesses) and every reduction is along the last axis. Nothing intermediate is written to memory.

Element pairs (2j, 2j+1) are the unit: one packed MXFP4 byte, one int32 word of two BF16, one int16 of two
E4M3 bytes (one ``cvt.rn.satfinite.e4m3x2.f32``). Ragged segments only change where FP8 row scales go
(segment-major, ``formats``); the row's segment comes from a per-row id table.
"""
import triton
import triton.language as tl

from .common import (
    bf16x2_fma,
    bf16x2_mul,
    e2m1_codes_from_bits,
    e4m3x2,
    e4m3x4_to_f16x2,
    exp2_i,
    f16x2_from_f32,
    fp8_exp_from_amax_bits,
    hfma2,
    hmul2,
    mx_code_from_amax_bits,
    prmt,
    umax16x2,
    umin16x2,
)

_MAG = tl.constexpr(0x7FFFFFFF)


@triton.jit
def _load_words(x_ptr, idx, n, mask, X_BF16: tl.constexpr):
    """float32 bits of element pairs: rows ``idx`` [R] of ``n`` pairs -> (even [R, n], odd [R, n]) int32.
    BF16 comes as int32 words (element 2j in the low half), widened exactly by shifts."""
    j = tl.arange(0, n)[None, :]
    if X_BF16:
        w = tl.load(x_ptr + idx[:, None] * n + j, mask=mask, other=0)
        return w << 16, w & -65536
    else:
        lo = tl.load(x_ptr + idx[:, None] * (2 * n) + 2 * j, mask=mask, other=0)
        hi = tl.load(x_ptr + idx[:, None] * (2 * n) + 2 * j + 1, mask=mask, other=0)
        return lo, hi


@triton.jit
def _mxfp4_blocks(lo, hi, RULE_CEIL: tl.constexpr):
    """float32 bits of 32-element blocks as pairs [R, 16] -> (packed bytes [R, 16] uint8, UE8M0 [R] uint8)."""
    return _mxfp4_blocks_shifted(lo, hi, 0, RULE_CEIL)  # the constant 0 folds away: the same code as before


@triton.jit
def _mxfp4_blocks_shifted(lo, hi, sh, RULE_CEIL: tl.constexpr):
    """``_mxfp4_blocks`` of values that the caller divided by ``2**sh`` (``sh`` [R] int32 >= 0, per block, or 0) to
    keep them inside float32: the blocks of ``x = v * 2**sh`` with ``v``'s float32 bits as pairs [R, 16]. Scaling by
    a power of two moves the UE8M0 code by ``sh`` and leaves every E2M1 code as it is, so the codes of ``v`` are taken
    with ``v``'s code capped at ``254 - sh`` (x's cap, 254: saturating elements at 6 there as the reference does)
    and ``sh`` added back; all-zero blocks keep code 0 and NaN blocks 255."""
    mlo = lo & _MAG
    mhi = hi & _MAG
    amax = tl.max(tl.maximum(mlo, mhi), axis=1)  # int32 bits; NaN/Inf sort above every finite value
    code = mx_code_from_amax_bits(amax, RULE_CEIL)
    code = tl.where(code < 255, tl.minimum(code, 254 - sh), 255)
    clo = e2m1_codes_from_bits(mlo, code) | ((lo >> 28) & 8)
    chi = e2m1_codes_from_bits(mhi, code) | ((hi >> 28) & 8)
    byte = tl.where((code < 255)[:, None], clo | (chi << 4), 0)
    code = tl.where((code < 255) & (amax > 0), code + sh, code)
    return byte.to(tl.uint8), code.to(tl.uint8)


@triton.jit
def _fp8_groups(lo, hi, EMULATE: tl.constexpr):
    """float32 bits of 128-element groups as pairs [R, 64] -> (E4M3 pairs [R, 64] int16, exponents [R] int32)."""
    mlo = lo & _MAG
    mhi = hi & _MAG
    fin_lo = mlo < 0x7F800000
    fin_hi = mhi < 0x7F800000
    amax = tl.max(tl.maximum(tl.where(fin_lo, mlo, 0), tl.where(fin_hi, mhi, 0)), axis=1)
    k = fp8_exp_from_amax_bits(amax)  # [-126, 121] for finite float32 inputs
    inv = exp2_i(-k)[:, None]
    qlo = tl.where(fin_lo, lo.to(tl.float32, bitcast=True) * inv, float("nan"))
    qhi = tl.where(fin_hi, hi.to(tl.float32, bitcast=True) * inv, float("nan"))
    return e4m3x2(qlo.to(tl.int32, bitcast=True), qhi.to(tl.int32, bitcast=True), EMULATE), k


@triton.jit
def _row_scale_offset(g, M, K: tl.constexpr, row_seg_ptr, seg_off_ptr, mask, SINGLE_SEGMENT: tl.constexpr):
    """int64 offset of the FP8 row scale of flat group ``g`` [R] in the segment-major buffer. An int32 ``g`` (the
    caller knows there are fewer than 2**31 groups) divides in int32, a few instructions instead of some 25.
    ``mask`` None: every ``g`` is in range (the segment tables are read unmasked)."""
    row = g // (K // 128)
    col = g - row * (K // 128)
    g = g.to(tl.int64)
    row = row.to(tl.int64)
    col = col.to(tl.int64)
    if SINGLE_SEGMENT:
        return col * M + row
    else:
        if mask is None:  # every g in range: unmasked loads
            seg = tl.load(row_seg_ptr + row)
            r0 = tl.load(seg_off_ptr + seg).to(tl.int64)
            r1 = tl.load(seg_off_ptr + seg + 1).to(tl.int64)
        else:
            seg = tl.load(row_seg_ptr + row, mask=mask, other=0)
            r0 = tl.load(seg_off_ptr + seg, mask=mask, other=0).to(tl.int64)
            r1 = tl.load(seg_off_ptr + seg + 1, mask=mask, other=0).to(tl.int64)
        return (K // 128) * r0 + col * (r1 - r0) + (row - r0)


@triton.jit
def _and_xor(a, m, k, EMULATE: tl.constexpr):
    """(a & m) ^ k as one ``lop3.b32`` (ptxas splits an AND and an XOR with two immediates into two LOP3)."""
    if EMULATE:
        return (a & m) ^ k
    else:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0x6A;", "=r,r,r,r",
                                         [a, tl.full(a.shape, m, tl.int32), tl.full(a.shape, k, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _bf16_e2m1_lanes(m, a2, RULE_CEIL: tl.constexpr, EMULATE: tl.constexpr):
    """E2M1 magnitude codes of two BF16 magnitudes ``m`` (a BF16x2 word, sign bits clear) of a block with BF16 scale
    ``a2`` = 2**(127-code) in both lanes -> each lane holds its code << 6 (0..7 << 6). Five instructions per
    pair (HMUL2, VIMNMX, LOP3, two HFMA2; six with the floor rule's cap).

    y = m * a2 is the element relative to the block scale (BF16: exact for every y >= 2**-126, so for every
    y >= 0.25 that can round above 0; a smaller y rounds to at most 0.25, which rounds to code 0 as it should);
    y < 8 for both rules (<= 6 for ceil). E2M1's step in y's binade [2**k, 2**(k+1)), k = clamp(floor(log2 y), 0, 2),
    is 2**(k-1), the BF16 ulp of 64 * 2**k: with t = max(y, 1.0) (``max.u16x2`` on the bits: t's exponent field is
    127 + k), y + 64 * 2**k rounds (one ``fma.rn.bf16x2``, nearest even; 64 * 2**k is an even multiple of the step
    and y + 64 * 2**k < 2**(k+7) stays in its binade) to 64 * 2**k + (y rounded to E2M1). The power of two is
    u = -2**(k-120) from t's bits by one LOP3: the exponent field 127 + k (k = 0, 1, 2: 0b0111_1111, 0b1000_0000,
    0b1000_0001) masked to its low four bits and XORed with 8 is 7 + k, plus the sign: u = (t & 0x0780) ^ 0x8400;
    u * -2**126 = 64 * 2**k. The second fma, r * 2**-126 + u, is (y rounded) * 2**-126 exactly, and every E2M1
    value v lands where BF16's encoding is E2M1's: v * 2**-126 has the bits code << 6 (0.5 is the subnormal 0x0040,
    1.0 the smallest normal 0x0080, ..., 6.0 = 0x01C0). The floor rule's y in [6, 8) can round to 8 (0x0200): capped
    at 6. NaN/Inf lanes give garbage lanes (each lane on its own), masked by the caller."""
    y = bf16x2_mul(m, a2, EMULATE)
    t = umax16x2(y, tl.full(y.shape, 0x3F803F80, tl.int32), EMULATE)
    u = _and_xor(t, 0x07800780, -2080340992, EMULATE)  # (t & 0x07800780) ^ 0x84008400: -2**(k-120) in both lanes
    r = bf16x2_fma(u, tl.full(y.shape, -25100672, tl.int32), y, EMULATE)  # 0xFE80FE80 = -2**126: y + 64 * 2**k
    z = bf16x2_fma(r, tl.full(y.shape, 0x00800080, tl.int32), u, EMULATE)  # r * 2**-126 + u
    if not RULE_CEIL:
        z = umin16x2(z, tl.full(y.shape, 0x01C001C0, tl.int32), EMULATE)
    return z


@triton.jit
def _mag(v):
    """|x| bits of the two BF16 in the low 32 bits of ``v`` (int64) as an int32 word."""
    return v.to(tl.int32) & 0x7FFF7FFF


@triton.jit
def _bf16_fp4_word(v, a2, keep, RULE_CEIL: tl.constexpr, EMULATE: tl.constexpr):
    """One output word (eight nibbles, elements 8i .. 8i+7) from the BF16 words of those elements as int64 pairs
    ``v`` [N, 2] (column 0: elements 0..3, column 1: 4..7). Per word of two elements, the code lanes (code << 6) get
    the signs at lane bit 9 (bit 15 >> 6); the low 64 bits of ``ce * (2**18 + 2**6) + co * (2**26 + 2**14)`` (ce:
    elements 0, 1; co: 2, 3; two ``IMAD.WIDE``) hold the four 4-bit fields at bits 24..39 (the shifted copies at
    12, 20, 40, 48 overlap nothing, so no carry), taken by a 64-bit shift; one ``prmt`` joins the two halves and
    ``keep`` (0 for a NaN block) clears NaN blocks."""
    we = v.to(tl.int32)
    wo = (v >> 32).to(tl.int32)
    ce = _bf16_e2m1_lanes(_mag(v), a2, RULE_CEIL, EMULATE) | ((we >> 6) & 0x02000200)
    co = _bf16_e2m1_lanes(_mag(v >> 32), a2, RULE_CEIL, EMULATE) | ((wo >> 6) & 0x02000200)
    x = (ce.to(tl.uint32, bitcast=True).to(tl.uint64) * 0x00040040
         + co.to(tl.uint32, bitcast=True).to(tl.uint64) * 0x04004000) >> 24
    p0, p1 = tl.split(x.to(tl.int32))
    return prmt(p0, p1, tl.full(p0.shape, 0x5410, tl.int32), EMULATE) & keep


@triton.jit
def _bf16_block_words(x_ptr, blk):
    """The 32 BF16 of blocks ``blk`` [N] (in range: no mask) as four int64 pairs [N, 2] of four BF16 each: four
    unmasked 16-byte loads (``x_ptr`` 8-byte aligned)."""
    j = tl.arange(0, 2)[None, :]
    p = x_ptr.to(tl.pointer_type(tl.int64)) + blk[:, None] * 8 + j
    return tl.load(p), tl.load(p + 2), tl.load(p + 4), tl.load(p + 6)


@triton.jit
def _bf16_mxfp4_encode(v0, v1, v2, v3, RULE_CEIL: tl.constexpr, EMULATE: tl.constexpr):
    """``_bf16_mxfp4_encode_amax`` without the block maxima."""
    o0, o1, o2, o3, code, amax = _bf16_mxfp4_encode_amax(v0, v1, v2, v3, RULE_CEIL, EMULATE)
    return o0, o1, o2, o3, code


@triton.jit
def _bf16_mxfp4_encode_amax(v0, v1, v2, v3, RULE_CEIL: tl.constexpr, EMULATE: tl.constexpr):
    """MXFP4 of blocks held as ``_bf16_block_words`` gives them -> four output words [N] each (int32, eight
    nibbles), the UE8M0 codes [N] int32 and the BF16 bits of the block maxima [N] int32 (>= 0x7F80 for a block with
    Inf/NaN). The block maximum is a ``max.u16x2`` chain on the |x| bits within the thread (NaN/Inf sort above every
    finite value)."""
    mx = umax16x2(umax16x2(umax16x2(_mag(v0), _mag(v0 >> 32), EMULATE), umax16x2(_mag(v1), _mag(v1 >> 32), EMULATE),
                           EMULATE),
                  umax16x2(umax16x2(_mag(v2), _mag(v2 >> 32), EMULATE), umax16x2(_mag(v3), _mag(v3 >> 32), EMULATE),
                           EMULATE), EMULATE)  # lane-wise max |x| bits (sign bits cleared first)
    m0, m1 = tl.split(mx)
    mx = umax16x2(m0, m1, EMULATE)
    amax = tl.maximum(mx & 0xFFFF, (mx >> 16) & 0xFFFF)  # BF16 bits of the block's max |x|
    if RULE_CEIL:  # 127 + ceil(log2(amax / 6)) = e - 2 + (significand > 1.5)
        code = ((amax + 0x3F) >> 7) - 2
    else:  # 127 + floor(log2(amax)) - 2
        code = (amax >> 7) - 2
    nan_blk = amax >= 0x7F80
    code = tl.where(nan_blk, 255, tl.maximum(code, 0))
    a2 = ((254 - code) * 0x00800080)[:, None]  # BF16 2**(127-code), both lanes
    keep = tl.where(nan_blk, 0, -1)
    o0 = _bf16_fp4_word(v0, a2, keep, RULE_CEIL, EMULATE)
    o1 = _bf16_fp4_word(v1, a2, keep, RULE_CEIL, EMULATE)
    o2 = _bf16_fp4_word(v2, a2, keep, RULE_CEIL, EMULATE)
    o3 = _bf16_fp4_word(v3, a2, keep, RULE_CEIL, EMULATE)
    return o0, o1, o2, o3, code, amax


@triton.jit
def _bf16_mxfp4_blocks(x_ptr, b, NB, RULE_CEIL: tl.constexpr, EMULATE: tl.constexpr):
    """Blocks ``b`` [N] (of ``NB``) of BF16 input (int32 words) -> four output words [N] each (int32, eight nibbles) and the
    UE8M0 codes [N] int32. Each thread holds whole blocks: four 16-byte loads of int64 pairs, so the block maximum
    is a ``max.u16x2`` chain on the |x| bits within the thread (NaN/Inf sort above every finite value)."""
    # rows past the end read the last block again (unmasked loads: no zero-fill of the destination registers)
    j = tl.arange(0, 2)[None, :]
    p = x_ptr.to(tl.pointer_type(tl.int64)) + tl.minimum(b, NB - 1)[:, None] * 8 + j
    v0 = tl.load(p)
    v1 = tl.load(p + 2)
    v2 = tl.load(p + 4)
    v3 = tl.load(p + 6)
    return _bf16_mxfp4_encode(v0, v1, v2, v3, RULE_CEIL, EMULATE)


@triton.jit
def bf16_to_fp4_row_kernel(x_ptr, q_ptr, s_ptr, NB, R: tl.constexpr, RULE_CEIL: tl.constexpr,
                           X_BF16: tl.constexpr, EMULATE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    mask = b < NB
    if X_BF16:
        o0, o1, o2, o3, code = _bf16_mxfp4_blocks(x_ptr, b, NB, RULE_CEIL, EMULATE)
        out = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (R, 4))  # [R, 2, 2]: [.., a, c] = o_(2a+c)
        tl.store(q_ptr.to(tl.pointer_type(tl.int32)) + b[:, None] * 4 + tl.arange(0, 4)[None, :], out,
                 mask=mask[:, None])
        tl.store(s_ptr + b, code.to(tl.uint8), mask=mask)
    else:
        lo, hi = _load_words(x_ptr, b, 16, mask[:, None], X_BF16)
        byte, code = _mxfp4_blocks(lo, hi, RULE_CEIL)
        tl.store(q_ptr + b[:, None] * 16 + tl.arange(0, 16)[None, :], byte, mask=mask[:, None])
        tl.store(s_ptr + b, code, mask=mask)


# BF16 bits of the E2M1 magnitudes v_c (c = 0..7: 0, .5, 1, 1.5, 2, 3, 4, 6) as prmt byte tables (entry c in byte c of
# the pair {lo, hi}): low bytes 00 00 80 C0 | 00 40 80 C0, high bytes 00 3F 3F 3F | 40 40 40 40
_E2M1_BF16_LO0 = tl.constexpr(-1065353216)  # 0xC0800000
_E2M1_BF16_LO1 = tl.constexpr(-1065336832)  # 0xC0804000
_E2M1_BF16_HI0 = tl.constexpr(0x3F3F3F00)
_E2M1_BF16_HI1 = tl.constexpr(0x40404040)


@triton.jit
def fp4_to_bf16_kernel(q_ptr, s_ptr, o_ptr, NB, R: tl.constexpr, EMULATE: tl.constexpr):
    """R blocks per program as 4R int32 words of eight E2M1 nibbles (element 8i + k of a block in nibble k of its word
    i); each thread decodes whole words (one word in, four BF16 pairs = one 128-bit store out, no layout conversion).

    Decode by byte permutes (SIMD within a register), as in ``fp4_row_to_fp8_row_kernel``: ``prmt`` with the
    nibbles' magnitude bits as selectors looks up the low bytes of four elements' BF16 ``v_c`` in a constant table,
    a second one their high bytes; two ``prmt`` per word move the sign bits (nibble bit 3) to byte bit 7, ORed into
    the high bytes; two ``prmt`` per output word interleave low and high bytes into two BF16 (element 2j in the low
    half). Then one ``mul.rn.bf16x2`` per output word by the block's scale 2**(code-127) in BF16 (code 0: the BF16
    denormal 2**-127; code 255: NaN): the product has at most 2 significant bits and is >= 2**-128, so it is exact
    inside BF16's range (denormals included) and Inf beyond it, as the reference's rounding cast gives; the sign
    rides through the multiply (-0 for code 8, -Inf), and a NaN scale makes the whole block NaN (0 * NaN too)."""
    pid = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, 4 * R)  # the program's words (int32 offsets from its base pointers): block j // 4
    mask = j < tl.minimum(4 * NB.to(tl.int64) - pid * (4 * R), 4 * R).to(tl.int32)
    # one 32-bit word per thread (contiguity 1 on purpose: a 128-bit load of a whole block would put its 16 output
    # words in one thread, which the 128-bit store layout then redistributes through shared memory)
    w = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + pid * (4 * R) + tl.max_contiguous(j, [1]), mask=mask, other=0)
    code = tl.load(s_ptr + pid * R + j // 4, mask=mask, other=0).to(tl.int32)  # the word's block code
    scale = code * 0x00800080 | tl.where((code == 0) | (code == 255), 0x00400040, 0)  # BF16 2**(code-127), twice
    l0 = tl.full(w.shape, _E2M1_BF16_LO0, tl.int32)
    l1 = tl.full(w.shape, _E2M1_BF16_LO1, tl.int32)
    h0 = tl.full(w.shape, _E2M1_BF16_HI0, tl.int32)
    h1 = tl.full(w.shape, _E2M1_BF16_HI1, tl.int32)
    s_even = tl.full(w.shape, 0x5140, tl.int32)
    s_odd = tl.full(w.shape, 0x7362, tl.int32)
    mag = w & 0x77777777
    mag_b = mag >> 16
    ws = w << 4  # even elements' sign bits (nibble bit 3) at byte bit 7; odd ones are there in w
    sgn = -2139062144  # 0x80808080
    lo_a = prmt(l0, l1, mag, EMULATE)  # low bytes of elements 0..3 of the word
    hi_a = prmt(h0, h1, mag, EMULATE) | (prmt(ws, w, s_even, EMULATE) & sgn)
    lo_b = prmt(l0, l1, mag_b, EMULATE)  # elements 4..7
    hi_b = prmt(h0, h1, mag_b, EMULATE) | (prmt(ws, w, s_odd, EMULATE) & sgn)
    o0 = bf16x2_mul(prmt(lo_a, hi_a, s_even, EMULATE), scale, EMULATE)  # elements 0, 1
    o1 = bf16x2_mul(prmt(lo_a, hi_a, s_odd, EMULATE), scale, EMULATE)
    o2 = bf16x2_mul(prmt(lo_b, hi_b, s_even, EMULATE), scale, EMULATE)
    o3 = bf16x2_mul(prmt(lo_b, hi_b, s_odd, EMULATE), scale, EMULATE)
    out = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (4 * R, 4))  # [4R, 2, 2]: [.., a, b] = o_(2a+b)
    tl.store(o_ptr + pid * (16 * R) + (j[:, None] * 4 + tl.arange(0, 4)[None, :]), out, mask=mask[:, None])


@triton.jit
def _fp8_row_program(x_ptr, q_ptr, s_ptr, row_seg_ptr, seg_off_ptr, M, K: tl.constexpr, R: tl.constexpr,
                     SINGLE_SEGMENT: tl.constexpr, EMULATE: tl.constexpr, X_BF16: tl.constexpr):
    """This program's R 128-groups -> FP8 1x128 rows (data and scales stored); returns the words it read (lo, hi:
    [R, 64] float32 bits of elements 2j, 2j+1), which the fused float32 path encodes to MXFP4 too."""
    g = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    mask = g < M * (K // 128)
    lo, hi = _load_words(x_ptr, g, 64, mask[:, None], X_BF16)
    pairs, k = _fp8_groups(lo, hi, EMULATE)
    tl.store(q_ptr + g[:, None] * 64 + tl.arange(0, 64)[None, :], pairs, mask=mask[:, None])
    so = _row_scale_offset(g, M, K, row_seg_ptr, seg_off_ptr, mask, SINGLE_SEGMENT)
    tl.store(s_ptr + so, exp2_i(k), mask=mask)
    return lo, hi


@triton.jit
def bf16_to_fp8_row_kernel(x_ptr, q_ptr, s_ptr, row_seg_ptr, seg_off_ptr, M, K: tl.constexpr, R: tl.constexpr,
                           SINGLE_SEGMENT: tl.constexpr, EMULATE: tl.constexpr, X_BF16: tl.constexpr):
    _fp8_row_program(x_ptr, q_ptr, s_ptr, row_seg_ptr, seg_off_ptr, M, K, R, SINGLE_SEGMENT, EMULATE, X_BF16)


@triton.jit
def bf16_to_fp4_and_fp8_row_kernel(x_ptr, q4_ptr, s4_ptr, q8_ptr, s8_ptr, row_seg_ptr, seg_off_ptr, M,
                                   K: tl.constexpr, R: tl.constexpr, RULE_CEIL: tl.constexpr,
                                   SINGLE_SEGMENT: tl.constexpr, EMULATE: tl.constexpr, X_BF16: tl.constexpr):
    """R 128-groups per program -> their 4R MXFP4 blocks and their FP8 1x128 rows (the BF16 path loads the input
    twice, the second time from L1; the float32 path once)."""
    b = tl.program_id(0).to(tl.int64) * (4 * R) + tl.arange(0, 4 * R)
    bmask = b < M * (K // 32)
    if X_BF16:  # the 4R MXFP4 blocks in the layout of BF16ToFP4Row (one thread per block); the FP8 part below reads
        # the same bytes again in its own layout (from L1)
        o0, o1, o2, o3, code = _bf16_mxfp4_blocks(x_ptr, b, M * (K // 32), RULE_CEIL, EMULATE)
        out = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (4 * R, 4))
        tl.store(q4_ptr.to(tl.pointer_type(tl.int32)) + b[:, None] * 4 + tl.arange(0, 4)[None, :], out,
                 mask=bmask[:, None])
        tl.store(s4_ptr + b, code.to(tl.uint8), mask=bmask)
    lo, hi = _fp8_row_program(x_ptr, q8_ptr, s8_ptr, row_seg_ptr, seg_off_ptr, M, K, R, SINGLE_SEGMENT, EMULATE, X_BF16)
    if not X_BF16:  # the same words seen as the 4R MXFP4 blocks of these groups: [R, 64] -> [4R, 16] is a pure reshape
        byte, code = _mxfp4_blocks(tl.reshape(lo, (4 * R, 16)), tl.reshape(hi, (4 * R, 16)), RULE_CEIL)
        tl.store(q4_ptr + b[:, None] * 16 + tl.arange(0, 16)[None, :], byte, mask=bmask[:, None])
        tl.store(s4_ptr + b, code, mask=bmask)


@triton.jit
def _fp4_group_code(sw):
    """FP8 group code G = max(max finite e_k - 6, 1) from the group's four UE8M0 codes as one int32 word
    ``sw`` (block 4g+k's code in byte k, little-endian); NaN codes (255) do not count. Every byte is first
    taken to (e_k + 1) mod 256 at once (a carry-free SIMD add: NaN becomes 0, below every finite code + 1)."""
    p = ((sw & 0x7F7F7F7F) + 0x01010101) ^ (sw & -2139062144)  # 0x80808080
    m = tl.maximum(tl.maximum(p & 0xFF, (p >> 8) & 0xFF), tl.maximum((p >> 16) & 0xFF, (p >> 24) & 0xFF))
    return tl.maximum(m - 7, 1)


@triton.jit
def fp4_row_to_fp8_row_kernel(q_ptr, s_ptr, o_ptr, os_ptr, row_seg_ptr, seg_off_ptr, M, K: tl.constexpr,
                              R: tl.constexpr, SINGLE_SEGMENT: tl.constexpr, EMULATE: tl.constexpr):
    """R groups = 4R blocks per program, each block as four int32 words of eight E2M1 nibbles.

    Per block, the eight E4M3 magnitudes ``e4m3(v_c * 2**(e_k - G))`` of the E2M1 magnitude codes c = 0..7 are a
    byte table in two registers (four exact ``cvt.rn.satfinite.e4m3x2`` per 32 elements: subnormals, underflow
    to zero and nearest-even included, for any code spread); a NaN block's table is all 0x7F. Each input word then
    becomes two output words by byte permutes (SIMD within a register): ``prmt`` with the nibbles' magnitude
    bits as selectors looks up four elements at once, two more ``prmt`` move the sign bits (nibble bit 3) to
    byte bit 7. The group's four codes come as one 32-bit word (all four threads of a group load the same word)."""
    h = tl.program_id(0).to(tl.int64) * (8 * R) + tl.arange(0, 8 * R)  # flat half-blocks of 16 elements
    g = h // 8
    mask = g < M * (K // 128)
    w = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + h[:, None] * 2 + tl.arange(0, 2)[None, :],
                mask=mask[:, None], other=0)  # [8R, 2]: element 8i + n in nibble n of word i
    sw = tl.load(s_ptr.to(tl.pointer_type(tl.int32)) + g, mask=mask, other=0)
    gcode = _fp4_group_code(sw)
    code = (sw >> (8 * ((h // 2) % 4).to(tl.int32))) & 0xFF
    nan_blk = code == 255
    # element = v_c * 2**(e_k - G): exact in float32; below 2**-126 everything rounds to 0 in E4M3
    # (a NaN block's f is NaN: its whole table, the entry of code 0 included (NaN * 0), is 0x7F)
    f = tl.where(nan_blk, float("nan"), exp2_i(tl.maximum(code - gcode, -126)))
    fb = f.to(tl.int32, bitcast=True)
    t0 = (e4m3x2((f * 0.0).to(tl.int32, bitcast=True), (f * 0.5).to(tl.int32, bitcast=True), EMULATE).to(tl.int32)
          & 0xFFFF) | (
        e4m3x2(fb, (f * 1.5).to(tl.int32, bitcast=True), EMULATE).to(tl.int32) << 16)
    t1 = (e4m3x2((f * 2.0).to(tl.int32, bitcast=True), (f * 3.0).to(tl.int32, bitcast=True), EMULATE).to(tl.int32)
          & 0xFFFF) | (e4m3x2((f * 4.0).to(tl.int32, bitcast=True), (f * 6.0).to(tl.int32, bitcast=True),
                              EMULATE).to(tl.int32) << 16)
    t0 = tl.broadcast_to(t0[:, None], (8 * R, 2))
    t1 = tl.broadcast_to(t1[:, None], (8 * R, 2))
    sgn = tl.where(nan_blk, 0, -2139062144)[:, None]  # 0x80808080; a NaN block's bytes are all 0x7F
    mag = w & 0x77777777
    lo = prmt(t0, t1, mag, EMULATE)  # elements 0..3 of the word
    hi = prmt(t0, t1, mag >> 16, EMULATE)  # elements 4..7
    ws = w << 4  # even elements' sign bits (nibble bit 3) at byte bit 7; odd ones are there in w
    lo = lo | (prmt(ws, w, tl.full(w.shape, 0x5140, tl.int32), EMULATE) & sgn)
    hi = hi | (prmt(ws, w, tl.full(w.shape, 0x7362, tl.int32), EMULATE) & sgn)
    out = tl.reshape(tl.join(lo, hi), (8 * R, 4))
    tl.store(o_ptr.to(tl.pointer_type(tl.int32)) + h[:, None] * 4 + tl.arange(0, 4)[None, :], out,
             mask=mask[:, None])
    gg = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    gmask = gg < M * (K // 128)
    gsw = tl.load(s_ptr.to(tl.pointer_type(tl.int32)) + gg, mask=gmask, other=0)
    so = _row_scale_offset(gg, M, K, row_seg_ptr, seg_off_ptr, gmask, SINGLE_SEGMENT)
    tl.store(os_ptr + so, exp2_i(_fp4_group_code(gsw) - 127), mask=gmask)


@triton.jit
def _e2m1_lanes(x, s2, CAP: tl.constexpr, EMULATE: tl.constexpr):
    """E2M1 magnitude codes of two f16 magnitudes ``x`` (f16x2 in an int32, exact E4M3 values) of a block with f16
    scale ``s2`` = 2**(-d-14) in both lanes -> each lane holds its code << 9 (0..7 << 9). Five instructions per pair.

    y = x * s2 is the element's magnitude relative to the block scale, times 2**-14 (exact, 4 significant bits,
    wherever it matters: below 2**-16, i.e. 0.25 * 2**-14, it only rounds to values that round to code 0 anyway).
    E2M1's step in y's binade [2**e, 2**(e+1)) is 2**(e-1) (for e >= -14; 2**-15 below, f16 subnormals), the ulp of
    M = 512 * t with t = max(y, 2**-14): t is a power of two for subnormal y, else y itself, whose 4-bit significand
    keeps y + M = 513 y inside M's binade and M's last significand bit even, so the rounding of y + M (one
    ``fma.rn.f16x2``) is y's rounding to the step, nearest even, shifted by M, and (y + M) - M (another, exact) is
    the rounded y. Scaled by 2**-14, every E2M1 value v lands where f16's encoding is E2M1's: v = 0.5 is the
    subnormal 0x0200, 1.0 the smallest normal 0x0400, ..., 6.0 = 0x0E00, so the f16 bits are code << 9 (nothing
    below bit 9). With ``CAP``, values from 8 up (saturating blocks) are capped at 0x0E00 (6.0); without, the caller
    knows y <= 6 * 2**-14 in every finite block (NaN lanes are garbage, dropped by ``_fp4_word``). Checked for every
    E4M3 magnitude and every d in [-11, 7] against ``reference.e2m1_round`` (results/kernels/README.md, 2026-12-04)."""
    y = hmul2(x, s2, EMULATE)
    t = umax16x2(y, tl.full(y.shape, 0x04000400, tl.int32), EMULATE)
    r = hfma2(t, tl.full(y.shape, 0x60006000, tl.int32), y, EMULATE)  # y + 512 t
    z = hfma2(t, tl.full(y.shape, -536813568, tl.int32), r, EMULATE)  # 0xE000E000: r - 512 t
    if CAP:
        z = umin16x2(z, tl.full(y.shape, 0x0E000E00, tl.int32), EMULATE)
    return z


@triton.jit
def _mul_wide2_hi(a, b, m_a, m_b, EMULATE: tl.constexpr):
    """High word of ``a * m_a + b * m_b`` (int32 tensors read as unsigned, 64-bit products and sum, mod 2**64): one
    ``mul.wide.u32`` and one ``mad.wide.u32`` (two IMAD.WIDE) also when the multipliers are registers."""
    if EMULATE:
        u = (a.to(tl.uint32, bitcast=True).to(tl.uint64) * m_a.to(tl.uint32, bitcast=True).to(tl.uint64)
             + b.to(tl.uint32, bitcast=True).to(tl.uint64) * m_b.to(tl.uint32, bitcast=True).to(tl.uint64))
        return (u >> 32).to(tl.uint32).to(tl.int32, bitcast=True)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b64 p; .reg .b32 l; mul.wide.u32 p, $1, $3; mad.wide.u32 p, $2, $4, p; mov.b64 {l, $0}, p; }",
            "=r,r,r,r,r", [a, b, m_a, m_b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _fp4_word(ca, cb, cc, cd, we, wo, m_a, m_b, sgn_e, sgn_o, EMULATE: tl.constexpr):
    """One output word (eight nibbles) from the code lanes of elements (0, 1), (2, 3), (4, 5), (6, 7) and the E4M3
    words ``we`` (elements 0..3) and ``wo`` (4..7) that carry the signs. The high word of
    ``ca * m_a + cb * m_b`` with m_a = 2**23 + 2**11, m_b = 2**31 + 2**19 holds codes 0..3 in its nibbles 0..3 (the
    shifted copies that land elsewhere overlap nothing, so no carry disturbs them; two ``IMAD.WIDE``); ``prmt``
    joins the two halves, two sign-replicating ``prmt`` take the E4M3 sign bits to nibble bit 3 (masks ``sgn_e`` =
    0x08080808, ``sgn_o`` = 0x80808080). A NaN block passes zero multipliers and masks: its word is 0 whatever its
    code lanes hold, without a select."""
    lo = _mul_wide2_hi(ca, cb, m_a, m_b, EMULATE)
    hi = _mul_wide2_hi(cc, cd, m_a, m_b, EMULATE)
    out = prmt(lo, hi, tl.full(lo.shape, 0x5410, tl.int32), EMULATE)
    out = out | (prmt(we, wo, tl.full(we.shape, 0xECA8, tl.int32), EMULATE) & sgn_e)  # elements 0, 2, 4, 6
    return out | (prmt(we, wo, tl.full(we.shape, 0xFDB9, tl.int32), EMULATE) & sgn_o)  # elements 1, 3, 5, 7


@triton.jit
def _fp4_block(v0, v1, k, lo_d, hi_d, RULE_CEIL: tl.constexpr, CAP: tl.constexpr, EMULATE: tl.constexpr):
    """One 32-block per row: its 32 E4M3 bytes as int64 pairs of words ``v0`` (words 0..3) and ``v1`` (4..7), [N, 2],
    under FP8 scale 2**k ([N]) -> (output words 0, 1 [N, 2], output words 2, 3 [N, 2], UE8M0 code [N] int32).

    Never forms E4M3 * 2**k: the group's scale only moves the block code. With d = code - 127 - k, the block's
    elements are |e| * 2**-d, so the E2M1 rounding runs on f16x2 pairs straight from ``cvt.rn.f16x2.e4m3x2``
    (``_e2m1_lanes``), two elements per instruction; the block's max magnitude is a lane-wise ``max.u16x2`` of the
    same f16 bits (NaN above all). From its f16 exponent e (plus 1 when the rule is ceil and the significand passes
    1.5), d = clamp(e - 17, lo_d, hi_d): e - 17 is in [-11, 7] for every finite nonzero block (E4M3 2**-9 .. 448),
    and the bounds lo_d = max(-127 - k, -11), hi_d = min(127 - k, 7) are the codes 0 and 254 (tighter than
    [-11, 7] only when they bind; zero and NaN blocks land inside [-11, 7] too, their elements are masked)."""
    we0 = v0.to(tl.int32)
    wo0 = (v0 >> 32).to(tl.int32)
    we1 = v1.to(tl.int32)
    wo1 = (v1 >> 32).to(tl.int32)
    a0, a1 = e4m3x4_to_f16x2(we0 & 0x7F7F7F7F, EMULATE)  # magnitudes
    a2, a3 = e4m3x4_to_f16x2(wo0 & 0x7F7F7F7F, EMULATE)
    a4, a5 = e4m3x4_to_f16x2(we1 & 0x7F7F7F7F, EMULATE)
    a6, a7 = e4m3x4_to_f16x2(wo1 & 0x7F7F7F7F, EMULATE)
    m = umax16x2(umax16x2(umax16x2(umax16x2(umax16x2(umax16x2(umax16x2(a0, a1, EMULATE), a2, EMULATE), a3, EMULATE),
                                            a4, EMULATE), a5, EMULATE), a6, EMULATE), a7, EMULATE)  # a chain: VIMNMX3
    m0, m1 = tl.split(m)
    m = umax16x2(m0, m1, EMULATE)
    amax = tl.maximum(m & 0xFFFF, (m.to(tl.uint32, bitcast=True) >> 16).to(tl.int32))  # f16 bits of max |E4M3|
    if RULE_CEIL:  # 127 + k + ceil(log2(amax / 6)), amax = (1 + f/1024) * 2**(e - 15): e - 17 + (f > 512)
        e = (amax + 0x1FF) >> 10
    else:  # 127 + k + floor(log2(amax)) - 2
        e = amax >> 10
    d = tl.minimum(tl.maximum(e - 17, lo_d), hi_d)
    s2 = f16x2_from_f32(((113 - d) << 23).to(tl.float32, bitcast=True),
                        ((113 - d) << 23).to(tl.float32, bitcast=True), EMULATE)[:, None]  # 2**(-d-14), both lanes
    nan_blk = amax >= 0x7C00
    m_a = tl.where(nan_blk, 0, 0x00800800)[:, None]
    m_b = tl.where(nan_blk, 0, -2146959360)[:, None]  # 0x80080000
    sgn_e = tl.where(nan_blk, 0, 0x08080808)[:, None]
    sgn_o = tl.where(nan_blk, 0, -2139062144)[:, None]  # 0x80808080
    out0 = _fp4_word(_e2m1_lanes(a0, s2, CAP, EMULATE), _e2m1_lanes(a1, s2, CAP, EMULATE),
                     _e2m1_lanes(a2, s2, CAP, EMULATE), _e2m1_lanes(a3, s2, CAP, EMULATE), we0, wo0, m_a, m_b, sgn_e,
                     sgn_o, EMULATE)
    out1 = _fp4_word(_e2m1_lanes(a4, s2, CAP, EMULATE), _e2m1_lanes(a5, s2, CAP, EMULATE),
                     _e2m1_lanes(a6, s2, CAP, EMULATE), _e2m1_lanes(a7, s2, CAP, EMULATE), we1, wo1, m_a, m_b, sgn_e,
                     sgn_o, EMULATE)
    code = tl.where(nan_blk, 255, tl.where(amax > 0, d + 127 + k, 0))
    return out0, out1, code


@triton.jit
def _fp8_row_to_fp4_groups(v0, v1, v2, v3, v4, v5, v6, v7, op, sp, mask, k, lo_d, hi_d, RULE_CEIL: tl.constexpr,
                           CAP: tl.constexpr, EMULATE: tl.constexpr):
    """The four 32-blocks of each thread's group, loaded as eight [R, 2] int64 pairs ``v0`` .. ``v7``: four 16-byte
    stores at ``op`` ([R, 4] int32 pointers), the four codes as one word at ``sp`` ([R])."""
    a0, a1, c0 = _fp4_block(v0, v1, k, lo_d, hi_d, RULE_CEIL, CAP, EMULATE)
    b0, b1, c1 = _fp4_block(v2, v3, k, lo_d, hi_d, RULE_CEIL, CAP, EMULATE)
    d0, d1, c2 = _fp4_block(v4, v5, k, lo_d, hi_d, RULE_CEIL, CAP, EMULATE)
    e0, e1, c3 = _fp4_block(v6, v7, k, lo_d, hi_d, RULE_CEIL, CAP, EMULATE)
    R: tl.constexpr = v0.shape[0]
    m2 = mask[:, None]
    tl.store(op, tl.reshape(tl.permute(tl.join(a0, a1), (0, 2, 1)), (R, 4)), mask=m2)  # block 4g: words 0..3
    tl.store(op + 4, tl.reshape(tl.permute(tl.join(b0, b1), (0, 2, 1)), (R, 4)), mask=m2)
    tl.store(op + 8, tl.reshape(tl.permute(tl.join(d0, d1), (0, 2, 1)), (R, 4)), mask=m2)
    tl.store(op + 12, tl.reshape(tl.permute(tl.join(e0, e1), (0, 2, 1)), (R, 4)), mask=m2)
    tl.store(sp, c0 | (c1 << 8) | (c2 << 16) | (c3 << 24), mask=mask)


@triton.jit
def fp8_row_to_fp4_kernel(q_ptr, s_ptr, row_seg_ptr, seg_off_ptr, o_ptr, os_ptr, M, K: tl.constexpr,
                          R: tl.constexpr, RULE_CEIL: tl.constexpr, SINGLE_SEGMENT: tl.constexpr,
                          EMULATE: tl.constexpr):
    """R groups per program, one group per thread: its four 32-blocks as eight 16-byte loads (``_fp4_block`` per
    block), one scale load, four 16-byte data stores and one 4-byte code store. A tail program's threads past the end
    read the last group again (unmasked loads: no zero fill) and store nothing.

    Saturation: under the ceil rule an element exceeds 6 times its block scale only where the block code is held at
    254, which needs a group scale above 2**120; a program without such a group (one reduction over its R scales,
    a uniform branch) skips the per-pair cap at 6. The floor rule always caps (its y in [6, 8) may round to 8)."""
    g = tl.program_id(0) * R + tl.arange(0, R)  # int32: the launcher checks M * K/128 < 2**31
    mask = g < M * (K // 128)
    gc = tl.minimum(g, M * (K // 128) - 1)
    so = _row_scale_offset(gc, M, K, row_seg_ptr, seg_off_ptr, None, SINGLE_SEGMENT)
    sbits = tl.load(s_ptr.to(tl.pointer_type(tl.int32)) + so)
    k = ((sbits >> 23) & 0xFF) - 127  # scales are powers of two 2**k, k in [-126, 127]
    lo_d = tl.maximum(-127 - k, -11)  # block offsets d of codes 0 and 254 (_fp4_block)
    hi_d = tl.minimum(127 - k, 7)
    qp = q_ptr.to(tl.pointer_type(tl.int64)) + gc.to(tl.int64)[:, None] * 16 + tl.arange(0, 2)[None, :]
    op = o_ptr.to(tl.pointer_type(tl.int32)) + g.to(tl.int64)[:, None] * 16 + tl.arange(0, 4)[None, :]
    sp = os_ptr.to(tl.pointer_type(tl.int32)) + g
    # all data loads before the branch: in flight while the program's scales are reduced
    v0, v1, v2, v3 = tl.load(qp), tl.load(qp + 2), tl.load(qp + 4), tl.load(qp + 6)
    v4, v5, v6, v7 = tl.load(qp + 8), tl.load(qp + 10), tl.load(qp + 12), tl.load(qp + 14)
    if RULE_CEIL:
        if tl.max(k, axis=0) > 120:
            _fp8_row_to_fp4_groups(v0, v1, v2, v3, v4, v5, v6, v7, op, sp, mask, k, lo_d, hi_d, RULE_CEIL, True,
                                   EMULATE)
        else:
            _fp8_row_to_fp4_groups(v0, v1, v2, v3, v4, v5, v6, v7, op, sp, mask, k, lo_d, hi_d, RULE_CEIL, False,
                                   EMULATE)
    else:
        _fp8_row_to_fp4_groups(v0, v1, v2, v3, v4, v5, v6, v7, op, sp, mask, k, lo_d, hi_d, RULE_CEIL, True, EMULATE)
