"""MXFP4 (E2M1 + UE8M0) quantization of the reference, checked against independent oracles.

Oracles used here never call the reference's helpers:
* element rounding: hand tables, ``ml_dtypes.float4_e2m1fn`` casts, and an exact nearest-even search on the
  E2M1 grid (float64 midpoints are exact);
* scale codes: ``fractions.Fraction`` arithmetic (scalar) and a log2 estimate fixed up with exact
  ``np.ldexp`` comparisons (vectorised);
* decoding: a hand-written LUT.
"""
from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fp4moe_kernels import reference as R
from fp4moe_kernels.formats import FormatError, MXFP4Tensor
from oracles import (E2M1_GRID, F4, PROFILE, ceil_log2_ratio_exact, ceil_log2_ratio_np, floor_log2_exact,
                     floor_log2_np, hand_decode, nibbles_of, oracle_mxfp4, rand_bf16, rne_index, to64)


# ----------------------------------------------------------------------------------------------- oracles


def assert_mx_equal(a: MXFP4Tensor, nib: np.ndarray, codes: np.ndarray):
    got_codes = a.scales.numpy()
    np.testing.assert_array_equal(got_codes, codes, err_msg="UE8M0 codes differ")
    got = nibbles_of(a)
    bad = np.argwhere(got != nib)
    assert bad.size == 0, f"{len(bad)} nibbles differ, first at {bad[:5].tolist()}: got {got[tuple(bad[0])]} want {nib[tuple(bad[0])]}"


# ---------------------------------------------------------------------------------- oracle self-checks


def test_oracles_agree_with_each_other():
    rng = np.random.default_rng(0)
    v = rng.uniform(0, 7, 20000).astype(np.float32).astype(np.float64)
    v = np.concatenate([v, [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0]])
    np.testing.assert_array_equal(rne_index(v, E2M1_GRID), v.astype(F4).view(np.uint8))
    for a in rng.uniform(-100, 100, 200):
        amax = float(np.exp2(a))
        assert ceil_log2_ratio_np(np.array([amax]), 6.0)[0] == ceil_log2_ratio_exact(amax, 6.0)
        assert floor_log2_np(np.array([amax]))[0] == floor_log2_exact(amax)


# ------------------------------------------------------------------------------------ 1. E2M1 encoding

# value (block scale 1) -> expected 4-bit code, written by hand from the E2M1 grid and docs/formats.md.
TIE_TABLE = [
    (0.25, 0b000),  # tie 0 | 0.5 -> 0 (even)
    (0.75, 0b010),  # tie 0.5 | 1 -> 1
    (1.25, 0b010),  # tie 1 | 1.5 -> 1
    (1.75, 0b100),  # tie 1.5 | 2 -> 2
    (2.5, 0b100),  # tie 2 | 3 -> 2
    (3.5, 0b110),  # tie 3 | 4 -> 4
    (5.0, 0b110),  # tie 4 | 6 -> 4
    (0.2490234375, 0b000),
    (0.2509765625, 0b001),
    (0.5, 0b001),
    (0.74, 0b001),
    (0.76, 0b010),
    (1.5, 0b011),
    (2.9, 0b101),
    (4.99, 0b110),
    (5.01, 0b111),
    (6.0, 0b111),
    (0.0, 0b000),
    (0.1, 0b000),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_tie_table(dtype, sign):
    vals = [v for v, _ in TIE_TABLE]
    want = [c | (8 if sign < 0 else 0) for _, c in TIE_TABLE]
    block = torch.zeros(32, dtype=torch.float64)
    block[: len(vals)] = torch.tensor(vals, dtype=torch.float64) * sign
    block[31] = 6.0  # amax 6 -> code 127 (scale 1) under "ceil"
    a = R.bf16_to_fp4_row(block.to(dtype).reshape(1, 32), rule="ceil")
    assert a.scales.tolist() == [[127]]
    nib = nibbles_of(a)[0]
    assert nib[: len(vals)].tolist() == want
    # positions 19..30 hold +0.0 (sign 0) in both cases
    assert nib[len(vals) : 31].tolist() == [0] * (31 - len(vals))
    assert nib[31] == 0b0111


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_e2m1_saturates_at_6_floor_rule(sign):
    # floor rule: amax 7 -> code 127 + floor(log2 7) - 2 = 127: scale 1; 7 and 6.5 saturate to 6, 7.99 too.
    vals = torch.tensor([7.0, 6.5, 7.99, 5.0, 3.5, 0.25, 6.0, 4.0], dtype=torch.float64) * sign
    x = torch.zeros(1, 32, dtype=torch.float64)
    x[0, : len(vals)] = vals
    a = R.bf16_to_fp4_row(x, rule="floor")
    assert a.scales.tolist() == [[127]]
    s = 8 if sign < 0 else 0
    assert nibbles_of(a)[0, : len(vals)].tolist() == [c | s for c in (7, 7, 7, 6, 6, 0, 7, 6)]


def test_negative_zero_keeps_sign_bit():
    x = torch.zeros(1, 64, dtype=torch.float32)
    x[0, 0] = -0.0
    x[0, 1] = -0.01  # rounds to -0 at scale 1
    x[0, 2] = 6.0
    x[0, 32:] = -0.0  # all-zero block made of -0
    a = R.bf16_to_fp4_row(x)
    nib = nibbles_of(a)
    assert nib[0, 0] == 8 and nib[0, 1] == 8 and nib[0, 2] == 7 and nib[0, 3] == 0
    assert a.scales.tolist() == [[127, 0]]
    assert nib[0, 32:].tolist() == [8] * 32
    # ml_dtypes agrees: -0.0 is code 8
    assert np.array([-0.0, -0.01]).astype(F4).view(np.uint8).tolist() == [8, 8]


def test_nibble_packing_order_hand_bytes():
    # element values at scale 1 (amax 6): codes 1 (0.5), 7 (6), 10 (-1), 0, 15 (-6), 4 (2) ...
    x = torch.zeros(2, 64, dtype=torch.float32)
    x[0, :6] = torch.tensor([0.5, 6.0, -1.0, 0.0, -6.0, 2.0])
    x[1, 32:36] = torch.tensor([3.0, 1.5, 4.0, -0.5])  # amax 4 -> code 127 + ceil(log2(4/6)) = 127
    a = R.bf16_to_fp4_row(x)
    d = a.data.numpy()
    assert d.shape == (2, 32) and d.dtype == np.uint8
    assert d[0, :3].tolist() == [0x71, 0x0A, 0x4F]  # (lo=elem 2j, hi=elem 2j+1)
    assert d[0, 3:].tolist() == [0] * 29
    assert d[1, 16:18].tolist() == [0x35, 0x96]  # 3.0->5, 1.5->3 ; 4.0->6, -0.5->9
    assert a.scales.tolist() == [[127, 0], [0, 127]]


def test_nibble_packing_reference_unpack_matches_hand():
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, (3, 64), dtype=np.uint8)
    a = MXFP4Tensor(torch.from_numpy(data), torch.full((3, 4), 127, dtype=torch.uint8), (3, 128))
    np.testing.assert_array_equal(R.unpack_codes(a).numpy(), nibbles_of(a))


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(0, 70), nb=st.integers(1, 8),
       rule=st.sampled_from(["ceil", "floor"]), p_nonfinite=st.sampled_from([0.0, 0.0, 0.002, 0.02]))
def test_bf16_to_fp4_matches_oracle(seed, m, nb, rule, p_nonfinite):
    rng = np.random.default_rng(seed)
    x = rand_bf16(rng, m, 32 * nb, p_nonfinite=p_nonfinite)
    a = R.bf16_to_fp4_row(x, rule=rule)
    assert a.shape == (m, 32 * nb) and a.data.dtype == torch.uint8 and a.scales.dtype == torch.uint8
    nib, codes = oracle_mxfp4(to64(x), rule)
    assert_mx_equal(a, nib, codes)
    # exact-search oracle agrees too (ml_dtypes is exact for bf16 inputs)
    nib2, _ = oracle_mxfp4(to64(x), rule, elements="exact")
    np.testing.assert_array_equal(nib, nib2)


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 40), nb=st.integers(1, 4),
       rule=st.sampled_from(["ceil", "floor"]), lo=st.integers(-1060, 1000))
def test_float64_input_exact_rounding(seed, m, nb, rule, lo):
    """float64 inputs keep their 53-bit mantissas; rounding must be exact RNE (no float32 double rounding)."""
    rng = np.random.default_rng(seed)
    k = 32 * nb
    x = rng.standard_normal((m, k)) * np.exp2(rng.uniform(lo, lo + 20, (m, 1)))
    # plant near-ties just above/below an E2M1 midpoint (1.25 + 2^-40 must round to 1.5)
    x[:, 0] = 6.0 * np.exp2(np.floor(rng.uniform(lo, lo + 20, m)))
    x[:, 1] = x[:, 0] / 6.0 * (1.25 + 2.0**-40)
    x[:, 2] = x[:, 0] / 6.0 * (2.5 - 2.0**-40)
    a = R.bf16_to_fp4_row(torch.from_numpy(x), rule=rule)
    nib, codes = oracle_mxfp4(x, rule, elements="exact")
    assert_mx_equal(a, nib, codes)


# ------------------------------------------------------------------------------------ 2. scale rules


def _amax_edges():
    out = []
    for k in (-126, -100, -40, -3, -1, 0, 1, 2, 3, 10, 60, 120, 125):
        p = 2.0**k
        out += [p, 6 * p, 3 * p, 1.5 * p, 6 * p * (1 + 2.0**-7), 6 * p * (1 - 2.0**-8), 6 * p * (1 + 2.0**-23),
                3 * p * (1 + 2.0**-23), p * (1 - 2.0**-24), p * (1 + 2.0**-23), 4 * p, 7 * p]
    return [v for v in out if v < 3.3e38]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_scale_rule_edges_exact(rule, dtype):
    amaxes = _amax_edges()
    if dtype == torch.float32:
        amaxes = [v for v in amaxes if float(np.float32(v)) == v]
    x = torch.zeros(len(amaxes), 32, dtype=dtype)
    x[:, 5] = torch.tensor(amaxes, dtype=torch.float64).to(dtype)
    assert x[:, 5].to(torch.float64).tolist() == amaxes
    x[:, 7] = -x[:, 5] / 3  # smaller, negative companions never change amax
    a = R.bf16_to_fp4_row(x, rule=rule)
    checked = 0
    for i, amax in enumerate(amaxes):
        if rule == "ceil":
            raw = 127 + ceil_log2_ratio_exact(amax, 6.0)
        else:
            raw = 127 + floor_log2_exact(amax) - 2
        want = min(max(raw, 0), 254)
        got = int(a.scales[i, 0])
        assert got == want, f"amax={amax!r} ({amax.hex()}): code {got} != {want}"
        if raw == want:
            ratio = Fraction(amax) / Fraction(2) ** (want - 127)
            if rule == "ceil":
                assert 3 < ratio <= 6, (amax, want)
            else:
                assert 4 <= ratio < 8, (amax, want)
            checked += 1
    assert checked > 0.8 * len(amaxes)


def test_scale_rule_hand_examples():
    # (amax, ceil code, floor code) worked out by hand
    cases = [
        (6.0, 127, 127),  # 6/6 = 1 -> 0 ; floor(log2 6) = 2 -> 0
        (6.0 * (1 + 2**-7), 128, 127),
        (3.0, 126, 126),  # ceil(log2 0.5) = -1 ; floor(log2 3) = 1 -> -1
        (3.0 * (1 + 2**-7), 127, 126),
        (1.0, 125, 125),  # ceil(log2(1/6)) = ceil(-2.58) = -2 ; 0 - 2
        (4.0, 127, 127),
        (8.0, 128, 128),
        (7.99, 128, 127),
        (448.0, 134, 133),  # 448/6 = 74.7 -> 2^7 ; floor(log2 448) = 8 -> 6
        (2.0**-130, 0, 0),  # clamps at code 0
    ]
    x = torch.zeros(len(cases), 32, dtype=torch.float64)
    x[:, 0] = torch.tensor([c[0] for c in cases], dtype=torch.float64)
    assert R.bf16_to_fp4_row(x, "ceil").scales[:, 0].tolist() == [c[1] for c in cases]
    assert R.bf16_to_fp4_row(x, "floor").scales[:, 0].tolist() == [c[2] for c in cases]


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(1, 64))
def test_ceil_rule_ratio_in_3_6_for_every_nonzero_block(seed, m):
    rng = np.random.default_rng(seed)
    x = rand_bf16(rng, m, 128, exp_lo=-100, exp_hi=100, p_zero_block=0.2)
    a = R.bf16_to_fp4_row(x)
    x64 = to64(x).reshape(m, 4, 32)
    for i in range(m):
        for b in range(4):
            amax = float(np.abs(x64[i, b]).max())
            code = int(a.scales[i, b])
            if amax == 0:
                assert code == 0
                continue
            assert code == min(max(127 + ceil_log2_ratio_exact(amax, 6.0), 0), 254)
            if code > 0:
                assert 3 < Fraction(amax) / Fraction(2) ** (code - 127) <= 6


def test_scale_code_clamps_for_extreme_float64():
    x = torch.zeros(3, 32, dtype=torch.float64)
    x[0, :2] = torch.tensor([1e300, -3e299], dtype=torch.float64)  # code would be > 254
    x[1, :2] = torch.tensor([1e-300, 5e-324], dtype=torch.float64)  # code would be < 0 (incl. a float64 subnormal)
    x[2, 0] = 6.0 * 2.0**127  # exactly code 254 under ceil
    a = R.bf16_to_fp4_row(x)
    assert a.scales[:, 0].tolist() == [254, 0, 254]
    nib = nibbles_of(a)
    assert nib[0, :2].tolist() == [7, 15]  # saturated to +-6
    assert nib[1, :2].tolist() == [0, 0]  # flushed to +0
    assert nib[2, 0] == 7


# ------------------------------------------------------------------------------------ 3. special values


def test_all_zero_block():
    x = torch.zeros(2, 96, dtype=torch.bfloat16)
    x[0, 32:64] = 1.0
    x[1, 64:96] = -0.0
    a = R.bf16_to_fp4_row(x)
    assert a.scales.tolist() == [[0, 125, 0], [0, 0, 0]]
    nib = nibbles_of(a)
    assert (nib[0, :32] == 0).all() and (nib[0, 64:] == 0).all()
    assert (nib[1, :64] == 0).all() and (nib[1, 64:] == 8).all()
    np.testing.assert_array_equal(hand_decode(nib, a.scales.numpy())[0, :32], 0.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_nonfinite_poisons_its_block_only(bad, dtype, rule):
    rng = np.random.default_rng(7)
    clean = rand_bf16(rng, 4, 128, p_zero_block=0.0).to(dtype)
    for pos in (0, 17, 31, 32, 95, 127):
        x = clean.clone()
        x[2, pos] = bad
        a = R.bf16_to_fp4_row(x, rule)
        ref = R.bf16_to_fp4_row(clean, rule)
        blk = pos // 32
        assert int(a.scales[2, blk]) == 255
        nib = nibbles_of(a)
        assert (nib[2, 32 * blk : 32 * blk + 32] == 0).all()
        mask = np.ones((4, 128), dtype=bool)
        mask[2, 32 * blk : 32 * blk + 32] = False
        np.testing.assert_array_equal(nib[mask], nibbles_of(ref)[mask])
        sc_mask = np.ones((4, 4), dtype=bool)
        sc_mask[2, blk] = False
        np.testing.assert_array_equal(a.scales.numpy()[sc_mask], ref.scales.numpy()[sc_mask])
        dec = R.fp4_to_bf16(a).float().numpy()
        assert np.isnan(dec[2, 32 * blk : 32 * blk + 32]).all()
        assert not np.isnan(dec[mask]).any()


# --------------------------------------------------------------------------- 7. decode and payload


def test_fp4_to_bf16_every_code_every_scale_class():
    codes = [0, 1, 2, 100, 126, 127, 128, 200, 250, 252, 253, 254, 255]
    m = len(codes)
    nib = np.tile(np.arange(16, dtype=np.uint8), (m, 2))  # 32 elements: each code twice
    data = nib[:, 0::2] | (nib[:, 1::2] << 4)
    sc = np.array(codes, dtype=np.uint8)[:, None]
    a = MXFP4Tensor(torch.from_numpy(data.copy()), torch.from_numpy(sc.copy()), (m, 32))
    got = R.fp4_to_bf16(a)
    assert got.dtype == torch.bfloat16 and got.shape == (m, 32)
    with np.errstate(over="ignore"):
        want = hand_decode(nib, sc).astype(ml_dtypes.bfloat16)  # exact values; only > bf16 max become +-inf
    g = got.view(torch.int16).numpy().view(np.uint16)
    w = want.view(np.uint16)
    nan_g = np.isnan(got.float().numpy())
    nan_w = np.isnan(want.astype(np.float64))
    np.testing.assert_array_equal(nan_g, nan_w)
    assert nan_g[-1].all() and not nan_g[:-1].any()
    np.testing.assert_array_equal(g[~nan_g], w[~nan_w])
    # spot-check by hand: code 127, nibble 7 -> 6.0; code 1, nibble 1 -> 0.5 * 2^-126 ; nibble 8 -> -0.0
    assert got[codes.index(127), 7].item() == 6.0
    assert got[codes.index(1), 1].item() == 2.0**-127
    assert math.copysign(1.0, got[codes.index(127), 8].item()) == -1.0
    # exact (float64) dequantization agrees with the hand decode everywhere
    np.testing.assert_array_equal(R.dequantize_mxfp4(a).numpy(), hand_decode(nib, sc))


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), m=st.integers(0, 50), nb=st.integers(1, 8))
def test_payload_round_trip(seed, m, nb):
    rng = np.random.default_rng(seed)
    k = 32 * nb
    a = R.bf16_to_fp4_row(rand_bf16(rng, m, k, p_nonfinite=0.01))
    p = a.payload()
    assert p.dtype == torch.uint8 and tuple(p.shape) == (m, k // 2 + k // 32)
    np.testing.assert_array_equal(p[:, : k // 2].numpy(), a.data.numpy())
    np.testing.assert_array_equal(p[:, k // 2 :].numpy(), a.scales.numpy())
    b = MXFP4Tensor.from_payload(p, k)
    assert b.shape == (m, k)
    assert torch.equal(b.data, a.data) and torch.equal(b.scales, a.scales)
    assert b.nbytes == a.nbytes == m * (k // 2 + k // 32)


def test_from_payload_rejects_bad_input():
    p = torch.zeros(4, 64 + 4, dtype=torch.uint8)
    MXFP4Tensor.from_payload(p, 128)
    with pytest.raises(FormatError, match="payload"):
        MXFP4Tensor.from_payload(p, 96)
    with pytest.raises(FormatError, match="payload"):
        MXFP4Tensor.from_payload(p.to(torch.int16), 128)
    with pytest.raises(FormatError, match="payload"):
        MXFP4Tensor.from_payload(p.reshape(-1), 128)


# ----------------------------------------------------------------------------------- 9. validation


def test_mxfp4_tensor_constructor_validation():
    d = torch.zeros(4, 32, dtype=torch.uint8)
    s = torch.zeros(4, 2, dtype=torch.uint8)
    MXFP4Tensor(d, s, (4, 64))
    with pytest.raises(FormatError, match="multiple of 32"):
        MXFP4Tensor(torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8), (4, 48))
    with pytest.raises(FormatError, match="data must be uint8"):
        MXFP4Tensor(d.to(torch.int8), s, (4, 64))
    with pytest.raises(FormatError, match="scales must be uint8"):
        MXFP4Tensor(d, s.float(), (4, 64))
    with pytest.raises(FormatError, match=r"data must have shape \(4, 32\)"):
        MXFP4Tensor(torch.zeros(4, 16, dtype=torch.uint8), s, (4, 64))
    with pytest.raises(FormatError, match=r"scales must have shape \(4, 2\)"):
        MXFP4Tensor(d, torch.zeros(4, 3, dtype=torch.uint8), (4, 64))
    with pytest.raises(FormatError, match=r"data must have shape"):
        MXFP4Tensor(d, s, (5, 64))
    with pytest.raises(FormatError, match="contiguous"):
        MXFP4Tensor(torch.zeros(32, 4, dtype=torch.uint8).t(), s, (4, 64))


def test_unknown_scale_rule_rejected():
    with pytest.raises(FormatError, match="scale rule"):
        R.bf16_to_fp4_row(torch.ones(1, 32), rule="round")
