"""The fused SwiGLU kernels (fp4moe_kernels.triton_kernels.swiglu) against the unfused float32 torch formula they
replace (fp4moe.ops.swiglu) and against a float64 evaluation: BF16 outputs equal the formula's or differ by one
BF16 unit in the last place, and lie within one unit of the float64 value; dprobs (a float32 sum over F) within
float32 rounding of the float64 sum. CPU: under the Triton interpreter, small shapes with column tails, one row,
zero rows. GPU (marked): DeepSeek-V3-like expert shapes, and the switch that routes fp4moe.ops.swiglu through them."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

ops_swiglu = importlib.import_module("fp4moe.ops.swiglu")  # the module (fp4moe.ops exports a function of that name)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
SHAPES = [(0, 64), (1, 64), (37, 96), (130, 200)]   # (T, F): F 96 and 200 leave column tails of the 128-wide tiles


def _unfused(h, probs, dz):
    """fp4moe.ops.swiglu's torch formulas (FP4MOE_FUSED_SWIGLU=0 for the call; the default restored after)."""
    before = os.environ.get(ops_swiglu.FUSED_ENV)
    os.environ[ops_swiglu.FUSED_ENV] = "0"
    try:
        z = ops_swiglu.swiglu_math(h, probs)
        dh, dp = ops_swiglu.swiglu_math_backward(h, dz, probs)
    finally:
        if before is None:
            os.environ.pop(ops_swiglu.FUSED_ENV)
        else:
            os.environ[ops_swiglu.FUSED_ENV] = before
    return z, dh, dp


def _exact(h, probs, dz):
    """float64 forward and backward."""
    f = h.shape[1] // 2
    g, u = h[:, :f].double(), h[:, f:].double()
    s = torch.sigmoid(g)
    p = torch.ones(h.shape[0], dtype=torch.float64, device=h.device) if probs is None else probs.double()
    z = g * s * u * p[:, None]
    d = dz.double()
    a = d * p[:, None]
    dh = torch.cat([a * u * (s * (1 + g * (1 - s))), a * g * s], 1)
    return z, dh, (d * g * s * u).sum(1)


def _max(x: torch.Tensor) -> float:
    return float(x.max()) if x.numel() else 0.0


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in BF16 units in the last place of b (both bf16)."""
    spacing = torch.finfo(torch.bfloat16).eps * torch.maximum(b.float().abs(), torch.tensor(torch.finfo(torch.bfloat16).tiny))
    return ((a.float() - b.float()).abs() / spacing).round()


def _check(t, f, weighted, device, gen):
    from fp4moe_kernels.triton_kernels.swiglu import swiglu_bwd, swiglu_fwd

    h = (torch.randn(t, 2 * f, generator=gen) * 3).to(torch.bfloat16).to(device)
    dz = torch.randn(t, f, generator=gen).to(torch.bfloat16).to(device)
    probs = torch.rand(t, generator=gen).to(device) if weighted else None
    z, (dh, dp) = swiglu_fwd(h, probs), swiglu_bwd(h, dz, probs)
    z0, dh0, dp0 = _unfused(h, probs, dz)
    ze, dhe, dpe = _exact(h, probs, dz)
    assert z.shape == (t, f) and dh.shape == (t, 2 * f) and z.dtype == dh.dtype == torch.bfloat16
    for fused, formula, exact in ((z, z0, ze), (dh, dh0, dhe)):
        assert _max(_ulps(fused, formula)) <= 1          # the same as the unfused formula, or 1 ulp
        rounded = exact.to(torch.bfloat16)
        assert _max(_ulps(fused, rounded)) <= 1          # and as good as it against float64
        if fused.numel() > 1000:
            assert (fused == formula).float().mean() > 0.99
    if weighted:
        assert dp.dtype == torch.float32 and dp.shape == (t,)
        torch.testing.assert_close(dp.double(), dpe, rtol=1e-5, atol=1e-5 * max(1.0, _max(dpe.abs())))
        torch.testing.assert_close(dp, dp0, rtol=1e-5, atol=1e-4)
    else:
        assert dp is None


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
@pytest.mark.parametrize("t,f", SHAPES)
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_swiglu_interpreted(t, f, weighted):
    _check(t, f, weighted, "cpu", torch.Generator().manual_seed(t * 1000 + f))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t,f", [(65536, 1024), (4099, 2048), (1, 1024), (0, 1024)])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_swiglu_gpu(t, f, weighted):
    _check(t, f, weighted, "cuda", torch.Generator().manual_seed(t + f))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_switch_routes_ops_swiglu_through_the_kernels(monkeypatch):
    """fp4moe.ops.swiglu's formulas run the kernels on CUDA by default (same values as calling them directly);
    FP4MOE_FUSED_SWIGLU=0 turns them off."""
    from fp4moe_kernels.triton_kernels.swiglu import swiglu_bwd, swiglu_fwd

    g = torch.Generator().manual_seed(3)
    h = torch.randn(5000, 2048, generator=g).to(torch.bfloat16).cuda()
    dz = torch.randn(5000, 1024, generator=g).to(torch.bfloat16).cuda()
    p = torch.rand(5000, generator=g).cuda()
    monkeypatch.setenv(ops_swiglu.FUSED_ENV, "0")
    assert not ops_swiglu.fused_enabled(h)
    monkeypatch.delenv(ops_swiglu.FUSED_ENV)
    assert ops_swiglu.fused_enabled(h) and not ops_swiglu.fused_enabled(h.cpu())
    assert torch.equal(ops_swiglu.swiglu_math(h, p), swiglu_fwd(h, p))
    dh, dp = ops_swiglu.swiglu_math_backward(h, dz, p)
    dh1, dp1 = swiglu_bwd(h, dz, p)
    assert torch.equal(dh, dh1) and torch.equal(dp, dp1)
