"""Reference implementation of every conversion: the executable specification (docs/formats.md).

Pure PyTorch, vectorised, runs on any device; computes in float64 so that every power-of-two scaling is
exact. GPU kernels must match these functions bit for bit (NaN payload bits excepted: NaN-ness must match).

Rules (where the paper is silent these are our decisions, docs/formats.md):

* UE8M0 block scale, rule "ceil" (default): code = 127 + ceil(log2(amax/6)), so amax/scale is in (3, 6]
  and nothing clips. Rule "floor" (OCP MX): code = 127 + floor(log2(amax)) - 2; values in (6, 8)*scale
  saturate to 6. Codes are clamped to [0, 254].
* All-zero block: code 0 (``E8M0_ZERO_BLOCK``), the smallest, so it never raises a group's exponent.
* A block holding any NaN or +-Inf gets code 255 (NaN) and element codes 0; it decodes to 32 NaNs and
  converts to FP8 NaN. Non-finite values are never turned into finite ones.
* E2M1 rounding: round-to-nearest-even on the magnitude, saturate at 6; the sign bit is kept (-0 exists).
* FP8 quantization from high precision (rows or columns): scale = 2**ceil(log2(amax/448)) over the finite
  values of the 128-group, exponent clamped to [-126, 127]; an all-zero group gets scale 1. Elements are
  x/scale rounded to E4M3 (RNE); NaN and +-Inf become E4M3 NaN.
* MXFP4 -> FP8 row (hierarchical alignment): per 128-group G = max(max finite sub-block code - 6, 1);
  scale 2**(G-127); element = fp4 * 2**(e_k - G) rounded to E4M3 (exact when the four codes of the group
  differ by at most 14; otherwise only what E4M3 cannot hold is lost, rounded to nearest even).
* MXFP4 -> FP8 column: the exact dequantized values, then the FP8 column quantizer.
* FP8 row -> MXFP4: the exact dequantized values, then the MXFP4 quantizer (== BF16ToFP4Row of them).
"""
from __future__ import annotations

import torch

from .constants import (
    E8M0_BIAS,
    E8M0_MAX_FINITE,
    E8M0_NAN,
    E8M0_ZERO_BLOCK,
    F4_E2M1_VALUES,
    F8_E4M3_MAX,
    FP4_TO_FP8_EXP_SHIFT,
    FP4_TO_FP8_MIN_GROUP_CODE,
    FP8_GROUP,
    FP8_SCALE_EXP_MAX,
    FP8_SCALE_EXP_MIN,
    MX_BLOCK,
    SCALE_RULES,
)
from .formats import FormatError, FP8ColTensor, FP8RowTensor, MXFP4Tensor, Segments, check_2d

_F64 = torch.float64
# High-precision inputs the reference quantizes (their values are taken exactly, in float64).
_HIGH_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check_high(x: torch.Tensor, k_multiple: int) -> torch.Tensor:
    """Validate a [M, K] float input (formats.check_2d: 2-D, float dtype, K % k_multiple == 0).

    Unlike the kernels, the reference accepts non-contiguous input (it is made contiguous first)."""
    if isinstance(x, torch.Tensor):
        x = x.contiguous()
    check_2d(x, "x", _HIGH_DTYPES, k_multiple)
    return x


def _e2m1_lut(device) -> torch.Tensor:
    """[16] float64: value of each 4-bit code (bit 3 = sign)."""
    mags = torch.tensor(F4_E2M1_VALUES, dtype=_F64, device=device)
    return torch.cat([mags, -mags])


def _exp2(e: torch.Tensor) -> torch.Tensor:
    """Exactly 2**e as float64 for integer ``e`` in [-1022, 1023], built from its bits.

    (``torch.ldexp`` multiplies by ``pow(2, e)``, which is not exact on CUDA: a value on a rounding tie
    then lands a hair off it and rounds the wrong way.)"""
    return ((e.to(torch.int64) + 1023) << 52).view(_F64)


def _ldexp(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """x * 2**e, exact for float64 x and integer e with every result and 2**e normal."""
    return x * _exp2(e)


def ceil_log2_ratio(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """Smallest integer k with amax <= limit * 2**k, for amax > 0 (int64). ``limit`` is 6 or 448.

    Exact: compares mantissas instead of dividing (limit = m_l * 2**e_l with m_l in [1, 2))."""
    m_l, e_l = torch.frexp(torch.tensor(limit, dtype=_F64))
    m_a, e_a = torch.frexp(amax.to(_F64))  # amax = m_a * 2**e_a, m_a in [0.5, 1)
    return (e_a.to(torch.int64) - int(e_l)) + (m_a > m_l).to(torch.int64)


def floor_log2(amax: torch.Tensor) -> torch.Tensor:
    """floor(log2(amax)) for amax > 0 (int64), exact."""
    _, e = torch.frexp(amax.to(_F64))
    return e.to(torch.int64) - 1


# --------------------------------------------------------------------------------------------- MXFP4


def _mx_codes(amax: torch.Tensor, finite: torch.Tensor, rule: str) -> torch.Tensor:
    """UE8M0 codes (int64) for blocks with max magnitude ``amax`` (float64) and all-finite flag."""
    if rule not in SCALE_RULES:
        raise FormatError(f"scale rule must be one of {SCALE_RULES}, got {rule!r}")
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    if rule == "ceil":
        k = ceil_log2_ratio(safe, 6.0)
    else:
        k = floor_log2(safe) - 2
    code = (k + E8M0_BIAS).clamp(0, E8M0_MAX_FINITE)
    code = torch.where(amax > 0, code, torch.full_like(code, E8M0_ZERO_BLOCK))
    return torch.where(finite, code, torch.full_like(code, E8M0_NAN))


def e2m1_round(q: torch.Tensor) -> torch.Tensor:
    """Round magnitudes ``q >= 0`` (float64) to the E2M1 grid, nearest-even, saturating at 6 -> codes 0..7."""
    a = q.clamp(max=6.0)
    r = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    r = r.clamp(max=6.0)
    code = torch.where(r < 2, r * 2, torch.where(r < 4, r + 2, r / 2 + 4))
    return code.to(torch.uint8)


def quantize_mxfp4(x: torch.Tensor, rule: str = "ceil") -> MXFP4Tensor:
    """Any float [M, K] (K % 32 == 0) -> MXFP4Tensor. The values are taken exactly (float64)."""
    x = _check_high(x, MX_BLOCK)
    m, k = x.shape
    xb = x.to(_F64).reshape(m, k // MX_BLOCK, MX_BLOCK)
    finite = torch.isfinite(xb).all(dim=-1)
    amax = torch.where(torch.isfinite(xb), xb.abs(), torch.zeros_like(xb)).amax(dim=-1)
    code = _mx_codes(amax, finite, rule)  # [M, K/32]
    q = _ldexp(xb.abs(), (E8M0_BIAS - code).clamp(min=-E8M0_BIAS).unsqueeze(-1))
    mag = e2m1_round(torch.nan_to_num(q, nan=0.0, posinf=0.0))
    sign = torch.signbit(xb).to(torch.uint8) << 3
    nib = torch.where(finite.unsqueeze(-1), mag | sign, torch.zeros_like(mag)).reshape(m, k)
    data = (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous()
    return MXFP4Tensor(data, code.to(torch.uint8).contiguous(), (m, k))


def unpack_codes(a: MXFP4Tensor) -> torch.Tensor:
    """[M, K] uint8 4-bit codes (element 2j from the low nibble)."""
    lo = a.data & 0xF
    hi = a.data >> 4
    return torch.stack([lo, hi], dim=-1).reshape(a.shape)


def dequantize_mxfp4(a: MXFP4Tensor) -> torch.Tensor:
    """MXFP4Tensor -> float64 [M, K], exact. Blocks with scale 255 are NaN."""
    m, k = a.shape
    vals = _e2m1_lut(a.device)[unpack_codes(a).long()].reshape(m, k // MX_BLOCK, MX_BLOCK)
    code = a.scales.to(torch.int64)
    out = vals * _exp2(code - E8M0_BIAS).unsqueeze(-1)
    out = torch.where((code == E8M0_NAN).unsqueeze(-1), torch.full_like(out, float("nan")), out)
    return out.reshape(m, k)


# ----------------------------------------------------------------------------------------------- FP8


# E4M3: 3 mantissa bits, smallest normal exponent -6 (subnormal step 2**-9).
_E4M3_MANT_BITS = 3
_E4M3_MIN_NORMAL_EXP = -6


def _to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 values with |v| <= 448 (or non-finite) -> float8_e4m3fn, RNE; NaN/Inf -> NaN.

    Rounded once, exactly, in float64 (any float64 input, not only values with <= 24 significant bits):
    the quantum of v is 2**qe with qe = max(floor(log2|v|), -6) - 3, and round(v / 2**qe) * 2**qe
    (torch.round: half to even; power-of-two scalings are exact) is an E4M3 value, or -0/0; the float32
    and float8 casts of it are then exact. (|v| > 448 is outside the contract: the final cast saturates.)"""
    v = torch.where(torch.isfinite(v), v, torch.full_like(v, float("nan")))
    _, e = torch.frexp(v)  # v = m * 2**e, m in [0.5, 1): floor(log2|v|) = e - 1 (0 -> e = 0, harmless)
    qe = (e.to(torch.int64) - 1).clamp(min=_E4M3_MIN_NORMAL_EXP) - _E4M3_MANT_BITS
    r = _ldexp(torch.round(_ldexp(v, -qe)), qe)
    return r.to(torch.float32).to(torch.float8_e4m3fn)


def _fp8_group_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two FP8 scale exponent for groups with finite max magnitude ``amax`` (int64)."""
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    k = ceil_log2_ratio(safe, F8_E4M3_MAX).clamp(FP8_SCALE_EXP_MIN, FP8_SCALE_EXP_MAX)
    return torch.where(amax > 0, k, torch.zeros_like(k))


def _finite_amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax(dim=dim)


def _row_scales_segment_major(scale_mg: torch.Tensor, seg: Segments) -> torch.Tensor:
    """[M, K/128] scales -> flat segment-major float32 buffer (formats.FP8RowTensor)."""
    parts = [scale_mg[r0:r1].t().reshape(-1) for r0, r1 in zip(seg.offsets[:-1], seg.offsets[1:])]
    return torch.cat(parts).to(torch.float32).contiguous()


def quantize_fp8_row(x: torch.Tensor, counts=None) -> FP8RowTensor:
    """Any float [M, K] (K % 128 == 0) -> FP8RowTensor with 1x128 groups along K."""
    x = _check_high(x, FP8_GROUP)
    m, k = x.shape
    seg = Segments.of(counts, m)
    xg = x.to(_F64).reshape(m, k // FP8_GROUP, FP8_GROUP)
    e = _fp8_group_exponent(_finite_amax(xg, -1))  # [M, K/128]
    q = _to_e4m3(_ldexp(xg, (-e).unsqueeze(-1))).reshape(m, k)
    return FP8RowTensor(q, _row_scales_segment_major(_exp2(e), seg), seg)


def dequantize_fp8_row(f: FP8RowTensor) -> torch.Tensor:
    """FP8RowTensor -> float64 [M, K], exact."""
    m, k = f.shape
    s = f.scale_matrix().to(_F64).repeat_interleave(FP8_GROUP, dim=1)
    return f.data.to(_F64) * s


def quantize_fp8_col(x: torch.Tensor, counts=None) -> FP8ColTensor:
    """Any float [M, K] -> FP8ColTensor: per segment the transpose [K, m_e], zero-padded to 128 tokens,
    with one scale per (128-token group, channel). K % 128 == 0."""
    x = _check_high(x, FP8_GROUP)
    m, k = x.shape
    seg = Segments.of(counts, m)
    x64 = x.to(_F64)
    datas, scales = [], []
    for (r0, r1), mp in zip(zip(seg.offsets[:-1], seg.offsets[1:]), seg.padded_counts):
        if mp == 0:
            continue
        xs = torch.zeros(mp, k, dtype=_F64, device=x.device)
        xs[: r1 - r0] = x64[r0:r1]
        xt = xs.t().reshape(k, mp // FP8_GROUP, FP8_GROUP)  # [K, groups, 128]
        e = _fp8_group_exponent(_finite_amax(xt, -1))  # [K, groups]
        q = _to_e4m3(_ldexp(xt, (-e).unsqueeze(-1))).reshape(k, mp)
        datas.append(q.reshape(-1))
        scales.append(_exp2(e).t())  # [groups, K]
    data = torch.cat(datas) if datas else torch.empty(0, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.cat(scales).to(torch.float32) if scales else torch.empty(0, k, dtype=torch.float32, device=x.device)
    return FP8ColTensor(data.contiguous(), scale.contiguous(), seg, k)


def dequantize_fp8_col(f: FP8ColTensor) -> torch.Tensor:
    """FP8ColTensor -> float64 [M, K] (padding dropped), exact."""
    rows = []
    for e, c in enumerate(f.segments.counts):
        if c == 0:
            continue
        d, s = f.segment(e)  # [K, mp], [K, mp/128]
        v = d.to(_F64) * s.to(_F64).repeat_interleave(FP8_GROUP, dim=1)
        rows.append(v[:, :c].t())
    if not rows:
        return torch.empty(0, f.channels, dtype=_F64, device=f.data.device)
    return torch.cat(rows, dim=0)


# ------------------------------------------------------------------------------- the named conversions


def bf16_to_fp4_row(x: torch.Tensor, rule: str = "ceil") -> MXFP4Tensor:
    """BF16ToFP4Row: BF16 [M, K] -> MXFP4 rows."""
    return quantize_mxfp4(x, rule)


def fp4_to_bf16(a: MXFP4Tensor) -> torch.Tensor:
    """MXFP4 rows -> BF16 [M, K] (exact unless a value exceeds the BF16 range)."""
    return dequantize_mxfp4(a).to(torch.bfloat16)


def fp4_row_to_fp8_row(a: MXFP4Tensor, counts=None) -> FP8RowTensor:
    """FP4RowToFP8Row: hierarchical scale alignment of four 32-blocks into one 1x128 FP8 group."""
    m, k = a.shape
    if k % FP8_GROUP != 0:
        raise FormatError(f"FP4RowToFP8Row needs K a multiple of {FP8_GROUP}, got {k}")
    seg = Segments.of(counts, m)
    code = a.scales.to(torch.int64).reshape(m, k // FP8_GROUP, 4)
    finite = code != E8M0_NAN
    e_max = torch.where(finite, code, torch.full_like(code, -1)).amax(dim=-1)  # [M, K/128]
    g = (e_max - FP4_TO_FP8_EXP_SHIFT).clamp(min=FP4_TO_FP8_MIN_GROUP_CODE)
    vals = _e2m1_lut(a.device)[unpack_codes(a).long()].reshape(m, k // FP8_GROUP, 4, MX_BLOCK)
    shifted = _ldexp(vals, (code - g.unsqueeze(-1)).unsqueeze(-1))
    shifted = torch.where(finite.unsqueeze(-1), shifted, torch.full_like(shifted, float("nan")))
    q = _to_e4m3(shifted).reshape(m, k)
    return FP8RowTensor(q, _row_scales_segment_major(_exp2(g - E8M0_BIAS), seg), seg)


def fp4_row_to_fp8_col(a: MXFP4Tensor, counts=None) -> FP8ColTensor:
    """FP4RowToFP8Col: MXFP4 [M, K] -> FP8 [K, tokens] per segment, 1x128 scales along tokens."""
    if a.shape[1] % FP8_GROUP != 0:
        raise FormatError(f"FP4RowToFP8Col needs K a multiple of {FP8_GROUP}, got {a.shape[1]}")
    return quantize_fp8_col(dequantize_mxfp4(a), counts)


def fp8_row_to_fp4(f: FP8RowTensor, rule: str = "ceil") -> MXFP4Tensor:
    """FP8ToFP4: FP8 1x128 rows -> MXFP4 rows, straight from the exact FP8 values."""
    return quantize_mxfp4(dequantize_fp8_row(f), rule)


def bf16_to_fp8_row(x: torch.Tensor, counts=None) -> FP8RowTensor:
    """BF16 -> FP8 1x128 rows (the FP8 baseline's activation quantizer)."""
    return quantize_fp8_row(x, counts)


def bf16_to_fp8_col(x: torch.Tensor, counts=None) -> FP8ColTensor:
    """BF16 -> FP8 transposed columns (the FP8 baseline's wgrad quantizer)."""
    return quantize_fp8_col(x, counts)


def bf16_to_fp8_row_col(x: torch.Tensor, counts=None) -> tuple[FP8RowTensor, FP8ColTensor]:
    """Fused BF16 -> (FP8 1x128 rows, FP8 transposed columns): one read of x, both outputs as the separate ops."""
    x = _check_high(x, FP8_GROUP)
    return quantize_fp8_row(x, counts), quantize_fp8_col(x, counts)


def bf16_to_fp4_and_fp8_row(x: torch.Tensor, counts=None, rule: str = "ceil") -> tuple[MXFP4Tensor, FP8RowTensor]:
    """Fused BF16 -> (MXFP4 rows, FP8 1x128 rows): one read of x, both outputs as the separate ops."""
    x = _check_high(x, FP8_GROUP)  # K % 128 (the FP8 output's group), before either output is built
    return quantize_mxfp4(x, rule), quantize_fp8_row(x, counts)
