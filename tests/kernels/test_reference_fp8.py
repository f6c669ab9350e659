"""FP8 E4M3 conversions of the reference (BF16 -> FP8 row/col, MXFP4 -> FP8 row/col, FP8 -> MXFP4, fused)
checked against independent oracles: ``ml_dtypes.float8_e4m3fn`` casts, an exact nearest-even search over
the E4M3 grid, exact scale exponents, and hand dequantization (bits -> ml_dtypes value * scale)."""
from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fp4moe_kernels import reference as R
from fp4moe_kernels.formats import FormatError, FP8ColTensor, FP8RowTensor, MXFP4Tensor, Segments
from oracles import (PROFILE, ceil_log2_ratio_exact, ceil_log2_ratio_np, hand_decode, nibbles_of, oracle_mxfp4,
                     rand_bf16, rne_index, to64)

F8 = ml_dtypes.float8_e4m3fn
E4M3_GRID = np.arange(127, dtype=np.uint8).view(F8).astype(np.float64)  # codes 0..126: 0 .. 448 ascending


# ----------------------------------------------------------------------------------------------- oracles


def e4m3_bits(q: np.ndarray, how: str = "ml_dtypes") -> np.ndarray:
    """float64 (finite, |q| <= 448) -> E4M3 bit patterns, RNE, sign kept."""
    assert np.all(np.abs(q) <= 448.0)
    if how == "ml_dtypes":
        return q.astype(F8).view(np.uint8)
    return (rne_index(np.abs(q), E4M3_GRID) | (np.signbit(q).astype(np.int64) << 7)).astype(np.uint8)


def oracle_fp8_groups(v: np.ndarray, how: str = "ml_dtypes"):
    """float64 [..., 128] -> (bits, nan mask, scale exponent [...]) by docs/formats.md: scale
    2^ceil(log2(amax/448)) over the finite values, exponent clamped to [-126, 127], all-zero group -> 2^0;
    NaN/Inf -> NaN."""
    fin = np.isfinite(v)
    amax = np.where(fin, np.abs(np.where(fin, v, 0.0)), 0.0).max(-1, initial=0.0)
    pos = amax > 0
    e = np.where(pos, np.clip(ceil_log2_ratio_np(np.where(pos, amax, 1.0), 448.0), -126, 127), 0)
    q = np.ldexp(np.where(fin, v, 0.0), -e[..., None])
    return e4m3_bits(q, how), ~fin, e


def oracle_fp8_row(x: np.ndarray, how: str = "ml_dtypes"):
    m, k = x.shape
    bits, nan, e = oracle_fp8_groups(x.reshape(m, k // 128, 128), how)
    return bits.reshape(m, k), nan.reshape(m, k), e


def oracle_fp8_col_segment(x: np.ndarray, how: str = "ml_dtypes"):
    """Rows [m, K] of one segment -> (bits [K, Mp], nan [K, Mp], e [K, Mp/128]), tokens padded with zeros."""
    m, k = x.shape
    mp = -(-m // 128) * 128
    xs = np.zeros((mp, k))
    xs[:m] = x
    bits, nan, e = oracle_fp8_groups(xs.T.reshape(k, mp // 128, 128), how)
    return bits.reshape(k, mp), nan.reshape(k, mp), e


def make_mx(nib: np.ndarray, codes: np.ndarray) -> MXFP4Tensor:
    nib = nib.astype(np.uint8)
    data = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    return MXFP4Tensor(torch.from_numpy(data.copy()), torch.from_numpy(codes.astype(np.uint8).copy()), nib.shape)


def fp8_bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def fp8_nan(t: torch.Tensor) -> np.ndarray:
    return np.isnan(fp8_bits(t).view(F8).astype(np.float32))


def fp8_value(t: torch.Tensor) -> np.ndarray:
    """Hand decode of E4M3 bits (ml_dtypes), float64."""
    return fp8_bits(t).view(F8).astype(np.float64)


def assert_fp8_equal(t: torch.Tensor, bits: np.ndarray, nan: np.ndarray, what: str = ""):
    gb, gn = fp8_bits(t), fp8_nan(t)
    np.testing.assert_array_equal(gn, nan, err_msg=f"{what}: NaN positions differ")
    bad = np.argwhere((gb != bits) & ~nan)
    assert bad.size == 0, (
        f"{what}: {len(bad)} FP8 bytes differ, first at {bad[:4].tolist()}: "
        f"got {gb[tuple(bad[0])]:#04x} want {bits[tuple(bad[0])]:#04x}"
    )


def row_scale_matrix_by_hand(f: FP8RowTensor) -> np.ndarray:
    """[M, K/128] from the flat segment-major buffer, decoded by hand from the documented layout."""
    m, k = f.shape
    g = k // 128
    flat = f.scales.numpy().astype(np.float64)
    out = np.empty((m, g))
    r0 = 0
    for c in f.segments.counts:
        out[r0 : r0 + c] = flat[g * r0 : g * (r0 + c)].reshape(g, c).T
        r0 += c
    return out


def rand_mxfp4_row(rng, m, k, spread, *, lo=0, hi=254, p_zero_nib=0.15, p_zero_block=0.0, p_nan_block=0.0):
    """Random nibbles; per 128-group the four UE8M0 codes span exactly ``spread`` (max - min)."""
    ng = k // 128
    nib = rng.integers(0, 16, (m, k))
    z = rng.random((m, k)) < p_zero_nib
    nib[z] = rng.choice([0, 8], int(z.sum()))
    top = rng.integers(lo + spread, hi + 1, (m, ng))
    c = top[..., None] - rng.integers(0, spread + 1, (m, ng, 4))
    perm = np.argsort(rng.random((m, ng, 4)), axis=-1)
    np.put_along_axis(c, perm[..., :1], top[..., None], axis=-1)
    np.put_along_axis(c, perm[..., 1:2], (top - spread)[..., None], axis=-1)
    c = c.reshape(m, k // 32)
    zb = rng.random(c.shape) < p_zero_block
    c[zb] = 0
    nib.reshape(m, k // 32, 32)[zb] = rng.choice([0, 8])
    c[rng.random(c.shape) < p_nan_block] = 255
    return nib.astype(np.uint8), c.astype(np.uint8)


def oracle_fp4_to_fp8_row(nib: np.ndarray, codes: np.ndarray):
    """FP4RowToFP8Row (docs/formats.md): G = max(max finite code - 6, 1); element = RNE_E4M3(value * 2^-(G-127))."""
    m, k = nib.shape
    val = hand_decode(nib, codes).reshape(m, k // 128, 128)
    c = codes.astype(np.int64).reshape(m, k // 128, 4)
    emax = np.where(c != 255, c, -1).max(-1, initial=-1)
    g = np.maximum(emax - 6, 1)
    q = np.ldexp(val, (127 - g)[..., None])
    nan = np.isnan(q)
    bits = e4m3_bits(np.where(nan, 0.0, q))
    return bits.reshape(m, k), nan.reshape(m, k), g


# -------------------------------------------------------------------------------- oracle self-check


def test_e4m3_oracles_agree():
    rng = np.random.default_rng(0)
    v = np.concatenate([
        rng.uniform(-448, 448, 20000), np.exp2(rng.uniform(-14, 8.8, 20000)) * rng.choice([-1, 1], 20000),
        (E4M3_GRID[:-1] + E4M3_GRID[1:]) / 2, -(E4M3_GRID[:-1] + E4M3_GRID[1:]) / 2, [0.0, -0.0, 448.0],
    ]).astype(np.float32).astype(np.float64)
    v = v[np.abs(v) <= 448]
    np.testing.assert_array_equal(e4m3_bits(v, "exact"), e4m3_bits(v, "ml_dtypes"))
    # torch's own cast agrees with ml_dtypes on float32 values (uint8 views)
    t = torch.from_numpy(v.astype(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(t, e4m3_bits(v))


# ------------------------------------------------------------------------------------- BF16 -> FP8 row


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(0, 200), g=st.integers(1, 3),
       p_nonfinite=st.sampled_from([0.0, 0.0, 0.003, 0.03]), exp_span=st.sampled_from([0.0, 3.0, 60.0, 125.0]))
def test_bf16_to_fp8_row_matches_oracle(seed, m, g, p_nonfinite, exp_span):
    rng = np.random.default_rng(seed)
    x = rand_bf16(rng, m, 128 * g, exp_lo=-exp_span, exp_hi=exp_span, p_nonfinite=p_nonfinite)
    f = R.bf16_to_fp8_row(x)
    assert f.data.dtype == torch.float8_e4m3fn and f.shape == (m, 128 * g)
    assert f.scales.dtype == torch.float32 and tuple(f.scales.shape) == (m * g,)
    bits, nan, e = oracle_fp8_row(to64(x))
    assert_fp8_equal(f.data, bits, nan, "bf16->fp8 row")
    np.testing.assert_array_equal(row_scale_matrix_by_hand(f), np.ldexp(1.0, e))
    # single segment: the flat buffer is the plain [K/128, M] layout
    np.testing.assert_array_equal(f.scales.numpy().reshape(g, m).T, np.ldexp(1.0, e))


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 100), exp_span=st.sampled_from([2.0, 40.0, 126.0]))
def test_bf16_to_fp8_row_error_bound_and_scale_range(seed, m, exp_span):
    rng = np.random.default_rng(seed)
    x = rand_bf16(rng, m, 256, exp_lo=-exp_span, exp_hi=exp_span, p_zero_block=0.05)
    x[0, :3] = torch.tensor([3.3895313892515355e38, -2.0**-133, 2.0**-126], dtype=torch.bfloat16)  # bf16 max etc.
    f = R.bf16_to_fp8_row(x)
    x64 = to64(x)
    s = np.repeat(row_scale_matrix_by_hand(f), 128, axis=1)
    deq = fp8_value(f.data) * s
    v = x64 / s
    normal = np.abs(v) >= 2.0**-6
    assert np.all(np.abs(deq - x64)[normal] <= 2.0**-4 * np.abs(x64)[normal])
    assert np.all(np.abs(deq - x64)[~normal] <= 2.0**-10 * s[~normal])
    sm = row_scale_matrix_by_hand(f)
    np.testing.assert_array_equal(f.scale_matrix().numpy(), sm)
    mant, _ = np.frexp(sm)
    assert np.all(mant == 0.5), "scales must be powers of two"
    amax = np.abs(x64).reshape(m, 2, 128).max(-1)
    for (i, j), a in np.ndenumerate(amax):
        sc = Fraction(float(sm[i, j]))
        if a == 0:
            assert sc == 1
        elif Fraction(float(a)) > 448 * Fraction(2) ** -126:
            assert 224 < Fraction(float(a)) / sc <= 448, (a, sc)
        else:
            assert sc == Fraction(2) ** -126


def test_bf16_to_fp8_row_scale_edges():
    amaxes = [448.0, 448.0 * 2**-3, 450.0, 446.0, 224.0, 225.0, 1.0,
              2.0**-117, 448.0 * 2**-126, 448.0 * 2**-127, 2.0**-133, 3.3895313892515355e38, 0.0]
    x = torch.zeros(len(amaxes), 128, dtype=torch.bfloat16)
    x[:, 3] = torch.tensor(amaxes, dtype=torch.float64).to(torch.bfloat16)
    assert x[:, 3].to(torch.float64).tolist() == amaxes
    f = R.bf16_to_fp8_row(x)
    got = f.scale_matrix()[:, 0].to(torch.float64).tolist()
    want = [1.0 if a == 0 else 2.0 ** min(max(ceil_log2_ratio_exact(a, 448.0), -126), 127) for a in amaxes]
    assert got == want
    assert got[:4] == [1.0, 2.0**-3, 2.0, 1.0] and got[4:7] == [0.5, 1.0, 2.0**-8]


# -------------------------------------------------------------------------------------- BF16 -> FP8 col


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), k=st.sampled_from([128, 256]),
       counts=st.lists(st.one_of(st.sampled_from([0, 1, 127, 128, 129]), st.integers(0, 300)), min_size=1, max_size=4),
       p_nonfinite=st.sampled_from([0.0, 0.003]))
def test_bf16_to_fp8_col_matches_oracle_and_layout(seed, k, counts, p_nonfinite):
    rng = np.random.default_rng(seed)
    m = sum(counts)
    x = rand_bf16(rng, m, k, p_nonfinite=p_nonfinite)
    f = R.bf16_to_fp8_col(x, counts)
    x64 = to64(x)
    seg = f.segments
    assert seg.counts == tuple(counts)
    assert all(p % 128 == 0 and c <= p < c + 128 for c, p in zip(counts, seg.padded_counts))
    mp = sum(seg.padded_counts)
    assert tuple(f.data.shape) == (k * mp,) and tuple(f.scales.shape) == (mp // 128, k)
    r0 = 0
    for e, c in enumerate(counts):
        d, s = f.segment(e)
        p = seg.padded_counts[e]
        assert tuple(d.shape) == (k, p) and tuple(s.shape) == (k, p // 128)
        if p:
            assert s.stride() == (1, k)
        bits, nan, ex = oracle_fp8_col_segment(x64[r0 : r0 + c])
        assert_fp8_equal(d, bits, nan, f"col segment {e}")
        assert (fp8_bits(d)[:, c:] == 0).all(), "padding tokens must be +0"
        np.testing.assert_array_equal(s.numpy().astype(np.float64), np.ldexp(1.0, ex))
        r0 += c
    deq = R.dequantize_fp8_col(f).numpy()
    assert deq.shape == (m, k)


# ------------------------------------------------------------------------------------- non-finite inputs


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_fp8_quantizers_never_make_nonfinite_finite(bad):
    rng = np.random.default_rng(3)
    clean = rand_bf16(rng, 130, 256, p_zero_block=0.0)
    x = clean.clone()
    pos = [(0, 0), (5, 127), (5, 128), (129, 255), (64, 40)]
    for i, j in pos:
        x[i, j] = bad
    want_nan = np.zeros((130, 256), dtype=bool)
    for i, j in pos:
        want_nan[i, j] = True
    zeroed = x.clone()
    zeroed[torch.from_numpy(want_nan)] = 0.0

    f, g = R.bf16_to_fp8_row(x), R.bf16_to_fp8_row(zeroed)
    np.testing.assert_array_equal(fp8_nan(f.data), want_nan)
    np.testing.assert_array_equal(fp8_bits(f.data)[~want_nan], fp8_bits(g.data)[~want_nan])
    assert torch.equal(f.scales, g.scales)  # scales come from the finite values only

    c, d = R.bf16_to_fp8_col(x, [100, 30]), R.bf16_to_fp8_col(zeroed, [100, 30])
    deq_nan = np.isnan(R.dequantize_fp8_col(c).numpy())
    np.testing.assert_array_equal(deq_nan, want_nan)
    cb, dbits = fp8_bits(c.data), fp8_bits(d.data)
    assert fp8_nan(c.data).sum() == len(pos)
    np.testing.assert_array_equal(cb[~fp8_nan(c.data)], dbits[~fp8_nan(c.data)])
    assert torch.equal(c.scales, d.scales)

    a = R.bf16_to_fp4_row(x)
    for conv in (R.fp4_row_to_fp8_row(a).data, R.fp4_row_to_fp8_col(a).data):
        assert fp8_nan(conv).sum() == 32 * len(pos)  # the whole 32-block of each bad element
    assert np.isnan(R.fp4_to_bf16(a).float().numpy()).sum() == 32 * len(pos)
    back = R.fp8_row_to_fp4(f)
    assert (back.scales.numpy() == 255).sum() == len(pos)


# ---------------------------------------------------------------------------------- FP4 -> FP8 row


@pytest.mark.parametrize("spread", list(range(0, 31)))
def test_fp4_to_fp8_row_zeros_stay_zero(spread):
    """Regression for the authors' release, which turned some zeros into +-448."""
    rng = np.random.default_rng(spread)
    m, k = 8, 256
    nib = rng.integers(0, 16, (m, k)).astype(np.uint8)
    codes = np.empty((m, 8), dtype=np.int64)
    tops = np.array([200, 150, 40, 31, 7, 254, 100, 60])
    for i, top in enumerate(tops):
        low = max(top - spread, 0)
        codes[i] = [top, low, low, top, low, top, low, low]
    # the low blocks hold exact +0 and -0 codes, including a whole zero block
    for b in (1, 2, 4, 6, 7):
        nib[:, 32 * b : 32 * b + 32 : 3] = 0
        nib[:, 32 * b + 1 : 32 * b + 32 : 3] = 8
    nib[:, 32 * 6 : 32 * 7] = 0
    nib[:, 0:32:5] = 0
    nib[:, 2:32:5] = 8
    a = make_mx(nib, codes)
    f = R.fp4_row_to_fp8_row(a)
    b = fp8_bits(f.data)
    assert (b[nib == 0] == 0x00).all(), f"+0 nibbles became {np.unique(b[nib == 0])}"
    assert (b[nib == 8] == 0x80).all(), f"-0 nibbles became {np.unique(b[nib == 8])}"
    assert not (np.abs(fp8_value(f.data)) == 448).any()
    bits, nan, _ = oracle_fp4_to_fp8_row(nib, codes)
    assert_fp8_equal(f.data, bits, nan, "fp4->fp8 row")


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(0, 150), g=st.integers(1, 3), spread=st.integers(0, 14),
       hi=st.sampled_from([254, 254, 30, 20]), p_nan_block=st.sampled_from([0.0, 0.0, 0.05]))
def test_fp4_to_fp8_row_lossless_up_to_spread_14(seed, m, g, spread, hi, p_nan_block):
    rng = np.random.default_rng(seed)
    k = 128 * g
    nib, codes = rand_mxfp4_row(rng, m, k, spread, hi=hi, p_nan_block=p_nan_block)
    f = R.fp4_row_to_fp8_row(make_mx(nib, codes))
    bits, nan, gexp = oracle_fp4_to_fp8_row(nib, codes)
    assert_fp8_equal(f.data, bits, nan, "fp4->fp8 row")
    np.testing.assert_array_equal(row_scale_matrix_by_hand(f), np.ldexp(1.0, gexp - 127))
    # lossless: the FP8 values times their scale are the MXFP4 values, exactly
    deq = fp8_value(f.data) * np.repeat(row_scale_matrix_by_hand(f), 128, axis=1)
    np.testing.assert_array_equal(deq, hand_decode(nib, codes))


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 150), g=st.integers(1, 3), spread=st.integers(15, 30),
       p_zero_block=st.sampled_from([0.0, 0.1]), p_nan_block=st.sampled_from([0.0, 0.05]))
def test_fp4_to_fp8_row_lossy_spreads_round_to_nearest_even(seed, m, g, spread, p_zero_block, p_nan_block):
    rng = np.random.default_rng(seed)
    nib, codes = rand_mxfp4_row(rng, m, 128 * g, spread, p_zero_block=p_zero_block, p_nan_block=p_nan_block)
    f = R.fp4_row_to_fp8_row(make_mx(nib, codes))
    bits, nan, gexp = oracle_fp4_to_fp8_row(nib, codes)
    assert_fp8_equal(f.data, bits, nan, "fp4->fp8 row")
    np.testing.assert_array_equal(row_scale_matrix_by_hand(f), np.ldexp(1.0, gexp - 127))
    # and the exact-search oracle agrees with ml_dtypes here
    val = hand_decode(nib, codes)
    q = np.ldexp(val, np.repeat(127 - gexp, 128, axis=1))
    fin = ~np.isnan(q)
    np.testing.assert_array_equal(e4m3_bits(q[fin], "exact"), bits[fin])


def test_fp4_to_fp8_row_group_exponent_hand_cases():
    # (codes of the four blocks, expected G) by hand: G = max(max finite code - 6, 1)
    cases = [([127, 127, 127, 127], 121), ([0, 0, 0, 0], 1), ([7, 0, 3, 1], 1), ([8, 0, 0, 0], 2),
             ([255, 140, 255, 3], 134), ([255, 255, 255, 255], 1), ([254, 240, 250, 254], 248)]
    nib = np.full((len(cases), 128), 7, dtype=np.uint8)  # every element is +6
    codes = np.array([c for c, _ in cases])
    f = R.fp4_row_to_fp8_row(make_mx(nib, codes))
    sm = f.scale_matrix()[:, 0].to(torch.float64).numpy()
    np.testing.assert_array_equal(sm, np.ldexp(1.0, np.array([g for _, g in cases]) - 127))
    v = fp8_value(f.data)
    assert (v[0] == 384.0).all()  # 6 * 2^(127-121)
    assert (v[1] == 3.0).all()  # 6 * 2^(0-1)
    assert v[2, 0] == 384.0 and v[2, 32] == 3.0 and v[2, 64] == 24.0 and v[2, 96] == 6.0
    assert np.isnan(v[4, :32]).all() and (v[4, 32:64] == 384.0).all() and np.isnan(v[4, 64:96]).all()
    assert v[4, 96] == 0.0  # 6 * 2^(3-134) underflows E4M3 -> +0
    assert np.isnan(v[5]).all()


def test_fp4_to_fp8_row_rejects_k_not_multiple_of_128():
    a = make_mx(np.zeros((2, 96), dtype=np.uint8), np.zeros((2, 3), dtype=np.uint8))
    with pytest.raises(FormatError, match="multiple of 128"):
        R.fp4_row_to_fp8_row(a)
    with pytest.raises(FormatError, match="multiple of 128"):
        R.fp4_row_to_fp8_col(a)


# ---------------------------------------------------------------------------------- FP4 -> FP8 col


def rand_mxfp4_col(rng, counts, k, spread, *, hi=254, p_zero_nib=0.15):
    """Per segment and 128-token group, the UE8M0 codes of each 32-channel block column span <= spread."""
    nibs, codes = [], []
    for m in counts:
        ntg = -(-m // 128)
        top = rng.integers(spread, hi + 1, (ntg, k // 32))
        c = np.repeat(top, 128, axis=0)[:m] - rng.integers(0, spread + 1, (m, k // 32))
        codes.append(c)
        nb = rng.integers(0, 16, (m, k))
        z = rng.random((m, k)) < p_zero_nib
        nb[z] = rng.choice([0, 8], int(z.sum()))
        nibs.append(nb)
    return np.concatenate(nibs).astype(np.uint8), np.concatenate(codes).astype(np.uint8)


def elem_exponent_spread(v: np.ndarray) -> np.ndarray:
    """[K, groups, 128] exact values -> max - min of floor(log2|v|) over the nonzero values (0 if < 2)."""
    nz = v != 0
    ex = np.floor(np.log2(np.where(nz, np.abs(v), 1.0)))
    sp = np.where(nz, ex, -np.inf).max(-1) - np.where(nz, ex, np.inf).min(-1)
    return np.where(nz.sum(-1) >= 2, sp, 0)


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), g=st.integers(1, 2), spread=st.integers(0, 30),
       counts=st.lists(st.one_of(st.sampled_from([0, 1, 128, 129]), st.integers(0, 260)), min_size=1, max_size=3))
def test_fp4_to_fp8_col_matches_oracle_lossless_and_layout(seed, g, spread, counts):
    rng = np.random.default_rng(seed)
    k = 128 * g
    nib, codes = rand_mxfp4_col(rng, counts, k, spread)
    val = hand_decode(nib, codes)
    f = R.fp4_row_to_fp8_col(make_mx(nib, codes), counts)
    assert f.channels == k and f.segments.counts == tuple(counts)
    r0 = 0
    for e, c in enumerate(counts):
        d, s = f.segment(e)
        p = f.segments.padded_counts[e]
        assert p % 128 == 0 and c <= p < c + 128
        assert tuple(d.shape) == (k, p)
        bits, nan, ex = oracle_fp8_col_segment(val[r0 : r0 + c])
        assert_fp8_equal(d, bits, nan, f"fp4->fp8 col segment {e}")
        np.testing.assert_array_equal(s.numpy().astype(np.float64), np.ldexp(1.0, ex))
        assert (fp8_bits(d)[:, c:] == 0).all()
        if p == 0:
            continue
        # lossless wherever the exponent spread over the (channel, 128-token) group is <= 14
        deq = (fp8_value(d) * np.repeat(s.numpy().astype(np.float64), 128, axis=1)).reshape(k, p // 128, 128)
        padded = np.zeros((p, k))
        padded[:c] = val[r0 : r0 + c]
        exact = padded.T.reshape(k, p // 128, 128)
        ok = elem_exponent_spread(exact) <= 14
        if spread <= 11:
            assert ok.all()  # code spread <= 11 means element spread <= 14
        np.testing.assert_array_equal(deq[ok], exact[ok])
        r0 += c


# ------------------------------------------------------------------------- FP8 -> FP4 and the fused op


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(0, 150), g=st.integers(1, 3),
       p_nonfinite=st.sampled_from([0.0, 0.0, 0.005]), exp_span=st.sampled_from([3.0, 60.0]))
def test_fp8_row_to_fp4_equals_quantize_of_dequantized_fp8(seed, m, g, p_nonfinite, exp_span):
    rng = np.random.default_rng(seed)
    x = rand_bf16(rng, m, 128 * g, exp_lo=-exp_span, exp_hi=exp_span, p_nonfinite=p_nonfinite)
    f = R.bf16_to_fp8_row(x)
    a = R.fp8_row_to_fp4(f)
    deq = fp8_value(f.data) * np.repeat(f.scale_matrix().numpy().astype(np.float64), 128, axis=1)  # by hand
    nib, codes = oracle_mxfp4(deq)
    np.testing.assert_array_equal(a.scales.numpy(), codes)
    np.testing.assert_array_equal(nibbles_of(a), nib)
    # FP8ToFP4 == BF16ToFP4Row applied to the dequantized FP8 values (docs/formats.md)
    b = R.bf16_to_fp4_row(torch.from_numpy(deq))
    assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), g=st.integers(1, 3), rule=st.sampled_from(["ceil", "floor"]),
       counts=st.one_of(st.none(), st.lists(st.one_of(st.sampled_from([0, 1, 128, 129]), st.integers(0, 200)),
                                            min_size=1, max_size=4)),
       p_nonfinite=st.sampled_from([0.0, 0.005]))
def test_fused_equals_separate_ops_bit_for_bit(seed, g, rule, counts, p_nonfinite):
    rng = np.random.default_rng(seed)
    m = sum(counts) if counts is not None else int(rng.integers(0, 200))
    x = rand_bf16(rng, m, 128 * g, p_nonfinite=p_nonfinite)
    a, f = R.bf16_to_fp4_and_fp8_row(x, counts, rule=rule)
    a2, f2 = R.bf16_to_fp4_row(x, rule=rule), R.bf16_to_fp8_row(x, counts)
    assert torch.equal(a.data, a2.data) and torch.equal(a.scales, a2.scales) and a.shape == a2.shape
    assert torch.equal(f.data.view(torch.uint8), f2.data.view(torch.uint8))
    assert torch.equal(f.scales.view(torch.int32), f2.scales.view(torch.int32))
    assert f.segments == f2.segments


# ------------------------------------------------------------------------------- float64 inputs (RNE)


def test_fp8_row_float64_input_is_rounded_once():
    """The reference takes any float tensor and promises RNE. A float64 value just above an E4M3 midpoint must
    round up; going float64 -> float32 -> E4M3 (double rounding) rounds it to the even neighbour below."""
    x = torch.zeros(1, 128, dtype=torch.float64)
    x[0, 0] = 256.0  # amax 256 -> scale 2^ceil(log2(256/448)) = 1
    x[0, 1] = 1.0 + 2.0**-4 + 2.0**-30  # just above the 1.0 | 1.125 midpoint -> 1.125 (0x39)
    x[0, 2] = -(3.0 + 2.0**-3 + 2.0**-40)  # just above the 3.0 | 3.25 midpoint -> -3.25 (0xC5)
    bits, nan, e = oracle_fp8_row(x.numpy(), how="exact")
    assert e.tolist() == [[0]] and bits[0, :3].tolist() == [0x78, 0x39, 0xC5]
    got = fp8_bits(R.bf16_to_fp8_row(x).data)[0, :3].tolist()
    assert got == [0x78, 0x39, 0xC5], f"got {[hex(b) for b in got]}"


def test_fp8_col_float64_input_is_rounded_once():
    x = torch.zeros(128, 128, dtype=torch.float64)
    x[0, 0] = 256.0
    x[1, 0] = 1.0 + 2.0**-4 + 2.0**-30
    got = fp8_bits(R.bf16_to_fp8_col(x).segment(0)[0])[0, :2].tolist()
    assert got == [0x78, 0x39], f"got {[hex(b) for b in got]}"


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 60))
def test_fp8_row_float32_input_matches_exact_oracle(seed, m):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, 256)) * np.exp2(rng.uniform(-100, 100, (m, 1)))).astype(np.float32)
    f = R.bf16_to_fp8_row(torch.from_numpy(x))
    bits, nan, e = oracle_fp8_row(x.astype(np.float64), how="exact")
    assert_fp8_equal(f.data, bits, nan, "fp32->fp8 row")


# ----------------------------------------------------------------------------------- 9. containers


def test_fp8_row_tensor_constructor_validation():
    d = torch.zeros(3, 256, dtype=torch.float8_e4m3fn)
    s = torch.ones(6, dtype=torch.float32)
    FP8RowTensor(d, s, Segments((1, 2)))
    with pytest.raises(FormatError, match="float8_e4m3fn"):
        FP8RowTensor(d.to(torch.bfloat16), s, Segments((3,)))
    with pytest.raises(FormatError, match="float8_e4m3fn"):
        FP8RowTensor(d.reshape(-1), s, Segments((3,)))
    with pytest.raises(FormatError, match="multiple of 128"):
        FP8RowTensor(torch.zeros(3, 192, dtype=torch.float8_e4m3fn), torch.ones(3), Segments((3,)))
    with pytest.raises(FormatError, match="scales must be float32"):
        FP8RowTensor(d, s.double(), Segments((3,)))
    with pytest.raises(FormatError, match=r"scales must be float32 \[6\]"):
        FP8RowTensor(d, torch.ones(3, 2), Segments((3,)))
    with pytest.raises(FormatError, match="segments cover 4 rows"):
        FP8RowTensor(d, s, Segments((2, 2)))


def test_fp8_col_tensor_constructor_validation():
    seg = Segments((5, 130))  # padded 128 + 256 = 384
    d = torch.zeros(128 * 384, dtype=torch.float8_e4m3fn)
    s = torch.ones(3, 128)
    FP8ColTensor(d, s, seg, 128)
    with pytest.raises(FormatError, match="data must be flat"):
        FP8ColTensor(d[:-1], s, seg, 128)
    with pytest.raises(FormatError, match="data must be flat"):
        FP8ColTensor(d.view(torch.uint8), s, seg, 128)
    with pytest.raises(FormatError, match=r"scales must be float32 \[3, 128\]"):
        FP8ColTensor(d, torch.ones(128, 3), seg, 128)
    with pytest.raises(FormatError, match="scales must be float32"):
        FP8ColTensor(d, s.half(), seg, 128)
