"""Device functions shared by the conversion kernels (element codecs, exact power-of-two scale rules).

All arithmetic is exact FP32/int32 so that results match ``fp4moe_kernels.reference`` bit for bit.
FP8 values move as raw uint8 bits. On the GPU they are produced/consumed by the hardware E4M3
conversions (``cvt.rn.satfinite``: nearest-even); under ``TRITON_INTERPRET=1`` (CPU tests) the
interpreter's own float8 casts are wrong, so the kernels' ``EMULATE`` flag switches to an exact integer
emulation (with the float rounding trick ``rne_int``, exact under numpy). The E2M1 encoder rounds with the
same trick on the GPU too: a float add of 2**(22+k) rounds to the E2M1 step of binade k, nearest-even in
hardware as in numpy (``e2m1_codes_from_bits``).
"""
import os

import triton
import triton.language as tl

# Read once at import, like triton.jit itself: kernels are interpreted iff this is set.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (x + M) - M rounds |x| < 2**22 to an integer, ties to even


@triton.jit
def rne_int(x):
    """Round float32 ``0 <= x < 2**22`` to the nearest integer, ties to even (result float32)."""
    return (x + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def exp2_i(e):
    """2**e as float32 for int32 ``-126 <= e <= 127`` (built from bits: exact, no libdevice)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def ceil_log2_ratio(amax, LIMIT_EXP: tl.constexpr, LIMIT_MANT: tl.constexpr):
    """Smallest int k with ``amax <= limit * 2**k`` where limit = (1 + LIMIT_MANT/2**23) * 2**LIMIT_EXP.

    ``amax`` float32 > 0. FP32 denormals are treated as exponent -127 (all callers clamp the result
    far above that)."""
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    m = bits & 0x7FFFFF
    return e - LIMIT_EXP + (m > LIMIT_MANT).to(tl.int32)


@triton.jit
def load_f32(ptrs, mask, IS_BF16: tl.constexpr):
    """Load float32 values; BF16 inputs arrive as int16 bits and are widened by a shift (exact, also for
    BF16 denormals, which the Triton interpreter's own bf16 conversion flushes)."""
    if IS_BF16:
        b = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        return ((b & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def with_sign(mag, negative):
    """Set the sign bit of float32 ``mag >= 0`` where ``negative`` (keeps -0.0, unlike ``0 - x``)."""
    return (mag.to(tl.int32, bitcast=True) | tl.where(negative, -2147483648, 0)).to(tl.float32, bitcast=True)


@triton.jit
def mx_code_from_amax_bits(amax_bits, RULE_CEIL: tl.constexpr):
    """UE8M0 code (int32) of a 32-block from the int32 bits of its max magnitude (>= 0x7F800000 when the
    block holds NaN/Inf): reference._mx_codes. Zero and FP32-denormal maxima clamp to code 0."""
    e = amax_bits >> 23
    if RULE_CEIL:
        code = e - 2 + ((amax_bits & 0x7FFFFF) > 0x400000).to(tl.int32)  # 127 + ceil(log2(amax / 6))
    else:
        code = e - 2  # 127 + floor(log2(amax)) - 2
    code = tl.minimum(tl.maximum(code, 0), 254)
    return tl.where(amax_bits < 0x7F800000, code, 255)


@triton.jit
def e2m1_codes_from_bits(b, code):
    """E2M1 magnitude codes 0..7 (int32) of magnitudes with float32 bits ``b`` ([R, E] int32) in blocks
    with UE8M0 codes ``code`` ([R], 0..254; 255 blocks give garbage the callers mask): nearest-even on the
    grid {0,.5,1,1.5,2,3,4,6} x 2**(code-127), saturating at 6.

    y = |x| * 2**(127-code) is exact (a power-of-two factor 2**-126..2**127; y < 8 for both scale rules;
    a y that would be an FP32 denormal is far below the first threshold 0.25, whether flushed or not). The
    grid step in binade k = clamp(floor(log2 y), 0, 2) is 2**(k-1), the ulp of M = 2**(22+k), so the
    hardware's nearest-even float add y + M leaves n = round_even(y / 2**(k-1)) in M's low mantissa bits.
    Within a binade E2M1's code parity is n's parity, so the code is n + 2k (n = 4 is the next binade's
    first code), capped at 7 (6.0). About 9 instructions per element, against 7 threshold compares plus
    their accumulation before; exact for every input (the interpreter's numpy add rounds the same way)."""
    c = tl.minimum(code, 253)[:, None]
    y = b.to(tl.float32, bitcast=True) * ((254 - c) << 23).to(tl.float32, bitcast=True)  # 2**(127-code)
    k = tl.minimum(tl.maximum((y.to(tl.int32, bitcast=True) >> 23) - 127, 0), 2)
    mb = (k + 149) << 23  # float32 bits of 2**(22+k)
    n = (y + mb.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - mb
    return tl.minimum(n + 2 * k, 7)


@triton.jit
def fp8_exp_from_amax_bits(amax_bits):
    """Power-of-two FP8 scale exponent (int32) from the bits of a group's finite max magnitude:
    ceil(log2(amax/448)) clamped to [-126, 127]; 0 for an all-zero group (reference._fp8_group_exponent)."""
    k = (amax_bits >> 23) - 135 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # 448 = 1.75 * 2**8
    k = tl.minimum(tl.maximum(k, -126), 127)
    return tl.where(amax_bits > 0, k, 0)


@triton.jit
def e4m3x2(lo, hi, EMULATE: tl.constexpr):
    """Two tensors of float32 bits (int32; values |v| <= 448 or NaN) -> int16 holding their E4M3 bytes (lo in
    the low byte), nearest-even. One ``cvt.rn.satfinite.e4m3x2.f32`` per pair on the GPU."""
    if EMULATE:
        blo = e4m3_bits(lo.to(tl.float32, bitcast=True), True).to(tl.int32)
        bhi = e4m3_bits(hi.to(tl.float32, bitcast=True), True).to(tl.int32)
        return (blo | (bhi << 8)).to(tl.int16)
    else:
        return tl.inline_asm_elementwise(
            "cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,r,r", [lo, hi],
            dtype=tl.int16, is_pure=True, pack=1)


@triton.jit
def e2m1_value(nib):
    """float32 value of 4-bit codes ``nib`` (int32, bit 3 = sign); -0 for code 8. Built from bits (integer
    ops only, no int->float conversion): magnitude code c >= 2 is (c + 252) << 22 (1.0 .. 6.0), c = 1 is
    0.5 (0x3F000000), c = 0 is 0."""
    c = nib & 7
    mag = tl.where(c >= 2, (c + 252) << 22, tl.where(c == 1, 0x3F000000, 0))
    return (mag | ((nib & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_value(code):
    """float32 2**(code-127) for UE8M0 codes 0..254 (code 0 is the FP32 denormal 2**-127)."""
    return ((code << 23) | tl.where(code == 0, 0x400000, 0)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(v, EMULATE: tl.constexpr):
    """float32 ``v`` with |v| <= 448, or NaN -> E4M3 bits (uint8), nearest-even. NaN -> NaN.

    Callers map +-Inf to NaN before (satfinite would clamp it to 448)."""
    if EMULATE:
        a = tl.abs(v)
        bits = a.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127
        qe = tl.maximum(e, -6) - 3  # exponent of one E4M3 step at this magnitude
        r = rne_int(a * exp2_i(-qe)) * exp2_i(qe)  # exact: rounded to a multiple of 2**qe
        rb = r.to(tl.int32, bitcast=True)
        normal = (((((rb >> 23) & 0xFF) - 127 + 7) << 3) | ((rb >> 20) & 7))
        sub = (r * 512.0).to(tl.int32)
        out = tl.where(r >= 0.015625, normal, sub)
        out = out | tl.where(v.to(tl.int32, bitcast=True) < 0, 0x80, 0)
        out = tl.where(v != v, 0x7F, out)
        return out.to(tl.uint8)
    else:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def e4m3_value(b, EMULATE: tl.constexpr):
    """E4M3 bits (uint8) -> float32 (exact). NaN bits -> NaN."""
    if EMULATE:
        bi = b.to(tl.int32)
        e = (bi >> 3) & 0xF
        m = (bi & 7).to(tl.float32)
        mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * exp2_i(tl.maximum(e, 1) - 10))
        mag = tl.where((bi & 0x7F) == 0x7F, float("nan"), mag)
        return with_sign(mag, (bi & 0x80) != 0)
    else:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def prmt(a, b, sel, EMULATE: tl.constexpr):
    """PTX ``prmt.b32`` (default mode) on int32 tensors: output byte i is byte ``s & 7`` of the eight bytes
    {b, a} (a's bytes 0..3, b's 4..7) for the selector nibble ``s = (sel >> 4i) & 15`` (only sel's low 16 bits
    count); ``s & 8`` replicates that byte's sign bit instead. One ``PRMT`` on the GPU; the interpreter runs
    the same definition with shifts and selects."""
    if EMULATE:
        out = tl.zeros_like(a)
        for i in tl.static_range(4):
            s = (sel >> (4 * i)) & 15
            idx = s & 7
            byte = (tl.where(idx < 4, a, b) >> (8 * (idx & 3))) & 255
            byte = tl.where(s >= 8, tl.where(byte >= 128, 255, 0), byte)
            out = out | (byte << (8 * i))
        return out
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def bf16_rne_bits(x):
    """float32 bits (int32) -> BF16 bits (int32, 0..0xFFFF), nearest-even; NaN -> 0x7FFF (a quiet NaN; the rounding add
    alone would carry a GPU's NaN, 0x7FFFFFFF, into -0.0)."""
    r = ((x + 0x7FFF + ((x >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where((x & 0x7FFFFFFF) > 0x7F800000, 0x7FFF, r)


@triton.jit
def bf16x2_mul(a, b, EMULATE: tl.constexpr):
    """PTX ``mul.rn.bf16x2`` (sm_90) on int32 tensors holding two BF16 each (low and high half): the two products,
    each rounded to nearest-even BF16, subnormals kept (no flush), NaN for a NaN operand or 0 * Inf. One ``HMUL2.BF16``
    on the GPU. The interpreter multiplies the two BF16 widened to float32 (a product of two 8-bit significands is
    exact there down to 2**-134) and rounds to BF16 nearest-even: the PTX result for every product >= 2**-134 in
    magnitude, zero, Inf and NaN (below that the float32 product is rounded once before; callers here never get so low)."""
    if EMULATE:
        lo = ((a << 16).to(tl.float32, bitcast=True) * (b << 16).to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
        hi = ((a & -65536).to(tl.float32, bitcast=True) * (b & -65536).to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
        return bf16_rne_bits(lo) | (bf16_rne_bits(hi) << 16)
    else:
        return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.int32, is_pure=True, pack=1)


# ------------------------------------------------------------------------------------------------------------------
# Packed 16-bit lanes (SIMD within a register): int32 tensors holding two 16-bit lanes, lane 0 in bits 0..15. Each
# helper is one standard sm_90 PTX instruction on the GPU; under EMULATE the interpreter runs the PTX ISA's
# definition of that instruction lane by lane (f16 lanes through float64, where the products and sums these kernels
# form are exact, so the only rounding is the final one to f16, nearest-even, subnormals kept, as in PTX without .ftz).


@triton.jit
def _f16_lane(x, LANE: tl.constexpr):
    """float64 value of f16 lane ``LANE`` of int32 ``x``."""
    return ((x >> (16 * LANE)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float64)


@triton.jit
def _f16_bits(v):
    """float64 ``v`` rounded to f16 (nearest-even) -> its 16 bits in an int32 (0..0xFFFF)."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def e4m3x4_to_f16x2(w, EMULATE: tl.constexpr):
    """int32 word of four E4M3 bytes -> (f16x2 of bytes 0, 1; f16x2 of bytes 2, 3): two exact ``cvt.rn.f16x2.e4m3x2``
    (the byte in bits 8..15 of the .b16 source goes to the upper f16 lane). NaN bytes (0x7F, 0xFF) give f16 NaNs."""
    if EMULATE:
        f0 = _f16_bits(e4m3_value((w & 0xFF).to(tl.uint8), True).to(tl.float64))
        f1 = _f16_bits(e4m3_value(((w >> 8) & 0xFF).to(tl.uint8), True).to(tl.float64))
        f2 = _f16_bits(e4m3_value(((w >> 16) & 0xFF).to(tl.uint8), True).to(tl.float64))
        f3 = _f16_bits(e4m3_value(((w >> 24) & 0xFF).to(tl.uint8), True).to(tl.float64))
        return f0 | (f1 << 16), f2 | (f3 << 16)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
            "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def hmul2(a, b, EMULATE: tl.constexpr):
    """``mul.rn.f16x2``: lane-wise f16 product, rounded to nearest even (subnormals kept)."""
    if EMULATE:
        return _f16_bits(_f16_lane(a, 0) * _f16_lane(b, 0)) | (_f16_bits(_f16_lane(a, 1) * _f16_lane(b, 1)) << 16)
    else:
        return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                         pack=1)


@triton.jit
def hfma2(a, b, c, EMULATE: tl.constexpr):
    """``fma.rn.f16x2``: lane-wise a * b + c rounded once to f16, nearest even (subnormals kept). The twin forms
    a * b + c in float64, exact whenever it fits 53 bits (always for the kernels here: a power-of-two factor and
    addends within 2**30 of each other)."""
    if EMULATE:
        lo = _f16_bits(_f16_lane(a, 0) * _f16_lane(b, 0) + _f16_lane(c, 0))
        hi = _f16_bits(_f16_lane(a, 1) * _f16_lane(b, 1) + _f16_lane(c, 1))
        return lo | (hi << 16)
    else:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def umax16x2(a, b, EMULATE: tl.constexpr):
    """``max.u16x2``: lane-wise unsigned 16-bit maximum."""
    if EMULATE:
        lo = tl.maximum(a & 0xFFFF, b & 0xFFFF)
        hi = tl.maximum((a >> 16) & 0xFFFF, (b >> 16) & 0xFFFF)
        return lo | (hi << 16)
    else:
        return tl.inline_asm_elementwise("max.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                         pack=1)


@triton.jit
def umin16x2(a, b, EMULATE: tl.constexpr):
    """``min.u16x2``: lane-wise unsigned 16-bit minimum."""
    if EMULATE:
        lo = tl.minimum(a & 0xFFFF, b & 0xFFFF)
        hi = tl.minimum((a >> 16) & 0xFFFF, (b >> 16) & 0xFFFF)
        return lo | (hi << 16)
    else:
        return tl.inline_asm_elementwise("min.u16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                         pack=1)


@triton.jit
def f16x2_from_f32(hi, lo, EMULATE: tl.constexpr):
    """``cvt.rn.f16x2.f32 d, hi, lo``: two float32 tensors -> f16x2 in an int32 (``lo`` in bits 0..15), each rounded
    to nearest even, f16 subnormals kept."""
    if EMULATE:
        return _f16_bits(lo.to(tl.float64)) | (_f16_bits(hi.to(tl.float64)) << 16)
    else:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,r,r", [hi, lo], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def bf16x2_fma(a, b, c, EMULATE: tl.constexpr):
    """PTX ``fma.rn.bf16x2`` (sm_80+) on int32 tensors holding two BF16 each: a * b + c lane-wise, rounded once to
    nearest-even BF16, subnormals kept. One ``HFMA2.BF16_V2`` on the GPU. The interpreter forms a * b + c in float32
    and rounds that to BF16: the PTX result whenever a * b is exact in float32 and the sum either is too or lies far
    from a BF16 rounding boundary (the E2M1 rounding in ``row._bf16_e2m1_lanes``: a power-of-two product plus an
    addend whose bits below 2**-17 cannot move a result that is a multiple of 2**-1 away from its BF16 tie points)."""
    if EMULATE:
        lo = ((a << 16).to(tl.float32, bitcast=True) * (b << 16).to(tl.float32, bitcast=True)
              + (c << 16).to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
        hi = ((a & -65536).to(tl.float32, bitcast=True) * (b & -65536).to(tl.float32, bitcast=True)
              + (c & -65536).to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
        return bf16_rne_bits(lo) | (bf16_rne_bits(hi) << 16)
    else:
        return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def smax16x2(a, b, EMULATE: tl.constexpr):
    """``max.s16x2``: lane-wise signed 16-bit maximum."""
    if EMULATE:
        lo = tl.maximum((a << 16) >> 16, (b << 16) >> 16)
        hi = tl.maximum(a >> 16, b >> 16)
        return (lo & 0xFFFF) | (hi << 16)
    else:
        return tl.inline_asm_elementwise("max.s16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                         pack=1)


@triton.jit
def e4m3x4(a, b, c, d, EMULATE: tl.constexpr):
    """Four tensors of float32 bits (int32; values |v| <= 448 or NaN) -> int32 holding their E4M3 bytes (a in byte 0
    .. d in byte 3), nearest-even. Two ``cvt.rn.satfinite.e4m3x2.f32`` into the halves of one register."""
    if EMULATE:
        return (e4m3x2(a, b, True).to(tl.int32) & 0xFFFF) | (e4m3x2(c, d, True).to(tl.int32) << 16)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; cvt.rn.satfinite.e4m3x2.f32 l, $2, $1; cvt.rn.satfinite.e4m3x2.f32 h, $4, $3; "
            "mov.b32 $0, {l, h}; }", "=r,r,r,r,r", [a, b, c, d], dtype=tl.int32, is_pure=True, pack=1)
