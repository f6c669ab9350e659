"""Independent oracles and input generators for the reference tests: numpy/ml_dtypes/exact-arithmetic, no
fp4moe_kernels code.

Imported by the test files next to it as ``from oracles import ...`` (pytest puts a test file's folder on
sys.path: tests/kernels has no __init__.py and the import mode is the default "prepend").
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np
import torch
from hypothesis import HealthCheck, settings

if TYPE_CHECKING:  # annotations only: nothing of fp4moe_kernels runs here
    from fp4moe_kernels.formats import MXFP4Tensor

PROFILE = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

F4 = ml_dtypes.float4_e2m1fn
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitude of codes 0..7 (hand table)


# ----------------------------------------------------------------------------------- exact arithmetic


def rne_index(mag: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Exact round-to-nearest-even of float64 magnitudes onto an ascending grid (index = code, even index wins
    ties), saturating at the top. Midpoints of the grids used here are exact in float64."""
    mids = (grid[:-1] + grid[1:]) / 2
    idx = np.searchsorted(mids, mag, side="left")
    at = np.minimum(idx, len(mids) - 1)
    tie = (idx < len(mids)) & (mids[at] == mag) & (idx % 2 == 1)
    return (idx + tie).astype(np.int64)


def ceil_log2_ratio_exact(amax: float, limit: float) -> int:
    """Smallest integer k with amax <= limit * 2**k, by exact rational arithmetic (amax > 0)."""
    a, lim = Fraction(amax), Fraction(limit)
    k = round(math.log2(amax) - math.log2(limit))
    while a > lim * Fraction(2) ** k:
        k += 1
    while a <= lim * Fraction(2) ** (k - 1):
        k -= 1
    return k


def floor_log2_exact(amax: float) -> int:
    """Largest integer k with 2**k <= amax, exactly (amax > 0)."""
    a = Fraction(amax)
    k = round(math.log2(amax))
    while Fraction(2) ** k > a:
        k -= 1
    while Fraction(2) ** (k + 1) <= a:
        k += 1
    return k


def ceil_log2_ratio_np(amax: np.ndarray, limit: float) -> np.ndarray:
    """Vectorised ``ceil_log2_ratio_exact`` for normal float64 amax > 0 (estimate + exact ldexp fix-up)."""
    k = np.ceil(np.log2(amax) - np.log2(limit)).astype(np.int64)
    for _ in range(3):
        k = np.where(amax > np.ldexp(limit, k), k + 1, k)
        k = np.where(amax <= np.ldexp(limit, k - 1), k - 1, k)
    assert np.all(amax <= np.ldexp(limit, k)) and np.all(amax > np.ldexp(limit, k - 1))
    return k


def floor_log2_np(amax: np.ndarray) -> np.ndarray:
    """Vectorised ``floor_log2_exact`` for normal float64 amax > 0 (estimate + exact ldexp fix-up)."""
    k = np.floor(np.log2(amax)).astype(np.int64)
    for _ in range(3):
        k = np.where(np.ldexp(1.0, k) > amax, k - 1, k)
        k = np.where(np.ldexp(1.0, k + 1) <= amax, k + 1, k)
    assert np.all(np.ldexp(1.0, k) <= amax) and np.all(np.ldexp(1.0, k + 1) > amax)
    return k


# ---------------------------------------------------------------------------------------- MXFP4 oracles


def oracle_mxfp4(x: np.ndarray, rule: str = "ceil", elements: str = "ml_dtypes"):
    """float64 [M, K] -> (nibbles [M, K] uint8, codes [M, K/32] uint8) by the rules of docs/formats.md.

    elements="ml_dtypes" rounds x/scale with ml_dtypes (exact for bf16/fp32 inputs, and for any x whose
    x/scale is float32-exact: ml_dtypes goes through float32); elements="exact" uses the exact float64
    nearest-even search."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    fin_el = np.isfinite(xb)
    finite = fin_el.all(-1)
    amax = np.where(fin_el, np.abs(np.where(fin_el, xb, 0.0)), 0.0).max(-1, initial=0.0)
    pos = amax > 0
    safe = np.where(pos, amax, 1.0)
    e = ceil_log2_ratio_np(safe, 6.0) if rule == "ceil" else floor_log2_np(safe) - 2
    code = np.clip(e + 127, 0, 254)
    code = np.where(pos, code, 0)
    code = np.where(finite, code, 255)
    q = np.ldexp(np.where(fin_el, xb, 0.0), (127 - np.minimum(code, 254))[..., None])
    if elements == "ml_dtypes":
        nib = q.astype(F4).view(np.uint8).astype(np.int64)  # sign kept: -0.0 -> 8
    else:
        nib = rne_index(np.abs(q), E2M1_GRID) | (np.signbit(q).astype(np.int64) << 3)
    nib = np.where(finite[..., None], nib, 0)
    return nib.reshape(m, k).astype(np.uint8), code.astype(np.uint8)


def hand_decode(nib: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Exact float64 values of 4-bit codes [M, K] with UE8M0 codes [M, K/32] (255 -> NaN)."""
    m, k = nib.shape
    mag = E2M1_GRID[nib & 7]
    val = np.where(nib & 8, -mag, mag).reshape(m, k // 32, 32)
    c = codes.astype(np.int64)
    out = np.ldexp(val, np.where(c == 255, 0, c - 127)[..., None])
    out = np.where((c == 255)[..., None], np.nan, out)
    return out.reshape(m, k)


def nibbles_of(a: MXFP4Tensor) -> np.ndarray:
    """Unpack by hand: element 2j = low nibble of byte j, element 2j+1 = high nibble."""
    d = a.data.numpy()
    out = np.empty((d.shape[0], d.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = d & 0xF
    out[:, 1::2] = d >> 4
    return out


# ------------------------------------------------------------------------------------------ generators


def to64(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.float64).numpy()


def rand_bf16(rng, m, k, *, exp_lo=-60.0, exp_hi=60.0, p_zero_block=0.1, p_zero=0.05, p_denorm=0.02,
              p_nonfinite=0.0, block=32) -> torch.Tensor:
    """bf16 [m, k]: normal values with a log-uniform scale per block of ``block``, zero blocks, +-0,
    bf16 subnormals (k * 2**-133) and optional NaN/+-Inf."""
    x = rng.standard_normal((m, k))
    nb = k // block
    x = x * np.repeat(np.exp2(rng.uniform(exp_lo, exp_hi, size=(m, nb))), block, axis=1)
    x[np.repeat(rng.random((m, nb)) < p_zero_block, block, axis=1)] = 0.0
    z = rng.random((m, k)) < p_zero
    x[z] = np.where(rng.random(int(z.sum())) < 0.5, 0.0, -0.0)
    d = rng.random((m, k)) < p_denorm
    x[d] = rng.integers(1, 128, int(d.sum())) * 2.0**-133 * rng.choice([-1.0, 1.0], int(d.sum()))
    nf = rng.random((m, k)) < p_nonfinite
    x[nf] = rng.choice([np.nan, np.inf, -np.inf], int(nf.sum()))
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
