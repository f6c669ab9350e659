"""The fused SwiGLU kernels (fp4moe_kernels.triton_kernels.fused_swiglu) against the unfused float32 torch formula they
replace (fp4moe.ops.swiglu) and against a float64 evaluation: BF16 outputs equal the formula's or differ by one
BF16 unit in the last place, and lie within one unit of the float64 value; dprobs (a float32 sum over F) within
float32 rounding of the float64 sum. CPU: under the Triton interpreter, small shapes with column tails, one row,
zero rows. GPU (marked): DeepSeek-V3-like expert shapes, and the switch that routes fp4moe.ops.swiglu through them."""
from __future__ import annotations

import importlib
import os

import pytest
import torch
import triton
import triton.language as tl

from fp4moe_kernels.triton_kernels.common import bf16_rne_bits

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
    from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_bwd, swiglu_fwd

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
    from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_bwd, swiglu_fwd

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


def _check_fp4(t, f, weighted, device, gen, rule="ceil"):
    """The FP4-storing kernels against the two-kernel path they fuse, bit for bit: (z, h's MXFP4) of
    ``swiglu_fwd_fp4`` = (``swiglu_fwd``, ``bf16_to_fp4_row``), and ``swiglu_bwd_fp4`` of that MXFP4 =
    ``swiglu_bwd`` of ``fp4_to_bf16`` of it (the same float32 operations on the same decoded values): dh bit for bit
    for every variant, dprobs bit for bit for the previous default (the same tiles) and within float32 rounding of
    the float64 sum for the whole-block kernel (the same terms, summed in another order)."""
    from fp4moe_kernels import convert as kops
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import MXFP4Tensor
    from fp4moe_kernels.triton_kernels import launchers
    from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_bwd, swiglu_bwd_fp4, swiglu_fwd, swiglu_fwd_fp4

    h = (torch.randn(t, 2 * f, generator=gen) * 3).to(torch.bfloat16)
    if t > 2:  # a NaN block, an all-zero block and a tiny block: code 255, code 0, a small code
        h[0, 5], h[1, 32:64], h[2, f:f + 32] = float("nan"), 0.0, h[2, f:f + 32] * 2.0 ** -100
    h = h.to(device)
    dz = torch.randn(t, f, generator=gen).to(torch.bfloat16).to(device)
    probs = torch.rand(t, generator=gen).to(device) if weighted else None
    z, (q, s) = swiglu_fwd_fp4(h, probs, rule)
    want = ref.bf16_to_fp4_row(h.cpu(), rule)
    assert torch.equal(z.view(torch.int16), swiglu_fwd(h, probs).view(torch.int16))
    assert torch.equal(q.cpu(), want.data) and torch.equal(s.cpu(), want.scales)
    h_hat = launchers.fp4_to_bf16(MXFP4Tensor(q, s, (t, 2 * f))) if device == "cpu" else kops.fp4_to_bf16(MXFP4Tensor(q, s, (t, 2 * f)))
    dh0, dp0 = swiglu_bwd(h_hat, dz, probs)
    # the default (whole-block tiles), a tile that splits a row into several and leaves a program's last rows past T,
    # and the previous default (2-D tiles)
    for tile in (None, ("blocks", 2, 3, 2), "tiles"):
        dh, dp = swiglu_bwd_fp4(q, s, dz, probs, tile=tile)
        nan = torch.isnan(dh.float())
        assert torch.equal(nan, torch.isnan(dh0.float()))
        assert torch.equal(dh.view(torch.int16)[~nan], dh0.view(torch.int16)[~nan])
        if not weighted:
            assert dp is None and dp0 is None
            continue
        nan = torch.isnan(dp)
        assert torch.equal(nan, torch.isnan(dp0))
        if tile == "tiles":  # the same tiles as swiglu_bwd: the same summation order
            assert torch.equal(dp[~nan], dp0[~nan])
        else:  # the same float32 terms summed in another order: within float32 rounding of the float64 sum
            terms = _exact(h_hat, probs, dz)[2]
            tol = 1e-5 * max(1.0, _max(terms[~nan].abs()))
            torch.testing.assert_close(dp[~nan].double(), terms[~nan], rtol=1e-5, atol=tol)
            # the default's sum is as close to float64 (the plain kernel's test), so the two within twice that
            torch.testing.assert_close(dp[~nan], dp0[~nan], rtol=2e-5, atol=2 * tol)


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
@pytest.mark.parametrize("t,f", [(0, 64), (1, 32), (37, 96), (67, 160)])  # partial row and block tiles (5 blocks per row)
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_swiglu_fp4_store_interpreted(t, f, weighted):
    _check_fp4(t, f, weighted, "cpu", torch.Generator().manual_seed(t * 7 + f), rule="ceil" if weighted else "floor")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t,f", [(65536, 1024), (4099, 2048), (1, 1024), (0, 1024)])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_swiglu_fp4_store_gpu(t, f, weighted):
    _check_fp4(t, f, weighted, "cuda", torch.Generator().manual_seed(t + 3 * f))


def test_fp4_store_kernels_reject_widths_that_split_blocks():
    from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_bwd_fp4, swiglu_fwd_fp4

    with pytest.raises(ValueError, match="multiple of 32"):
        swiglu_fwd_fp4(torch.zeros(2, 2 * 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple of 32"):
        swiglu_bwd_fp4(torch.zeros(2, 48, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8),
                       torch.zeros(2, 48, dtype=torch.bfloat16))
    q, sc = torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8)
    for dz in (torch.zeros(2, 64), torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(64, 2, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match=r"dz must be contiguous bfloat16 \[T, F\]"):  # float32, [T, F/2], strided
            swiglu_bwd_fp4(q, sc, dz)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("where", ["experts", "swiglu"])
def test_fp4_store_switch_changes_no_bit(monkeypatch, where):
    """FP4MOE_FUSED_SWIGLU_FP4=1 (the fused FP4-storing SwiGLU) against =0 (quantize and decode in their own
    kernels) inside the routed experts under mxfp4 and inside the SwiGLU autograd function: outputs and every
    gradient bit for bit (the routing probabilities' within float32 rounding: its dprobs sums in another order), the
    same saved bytes."""
    from fp4moe.ops.grouped_experts import grouped_expert_mlp
    from fp4moe.recipe import Recipe

    recipe = Recipe.preset("mxfp4")
    g = torch.Generator().manual_seed(11)
    counts = [700, 0, 1300, 96, 1]
    t, hid, f = sum(counts), 256, 512
    x = (torch.randn(t, hid, generator=g)).to(torch.bfloat16).cuda()
    w1 = (torch.randn(len(counts), 2 * f, hid, generator=g) / 16).to(torch.bfloat16).cuda()
    w2 = (torch.randn(len(counts), hid, f, generator=g) / 16).to(torch.bfloat16).cuda()
    p = torch.rand(t, generator=g).cuda()
    h = (torch.randn(t, 2 * f, generator=g) * 2).to(torch.bfloat16).cuda()
    outs = []
    for flag in ("0", "1"):
        monkeypatch.setenv(ops_swiglu.FUSED_FP4_ENV, flag)
        leaves = [v.clone().requires_grad_() for v in ((x, w1, w2, p) if where == "experts" else (h,))]
        if where == "experts":
            y = grouped_expert_mlp(leaves[0], counts, leaves[1], leaves[2], leaves[3], recipe)
        else:
            y = ops_swiglu.swiglu(leaves[0], recipe, "shared_expert")
        saved = y.grad_fn.saved_activation_bytes
        y.backward(torch.ones_like(y))
        outs.append((y.detach(), [v.grad for v in leaves], saved))
    (y0, g0, s0), (y1, g1, s1) = outs
    assert ops_swiglu.fused_fp4_enabled(h)
    assert torch.equal(y0, y1) and s0 == s1
    for i, (a, b) in enumerate(zip(g0, g1)):
        if where == "experts" and i == 3:  # the probabilities' gradient: float32 sums over F in another order
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * max(1.0, float(a.abs().max())))
        else:
            assert torch.equal(a, b)


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
def test_bench_tiles_reach_the_kernels():
    """fp4moe.bench.swiglu_fusion's --fp4-tiles / --bwd-fp4-tiles spellings parse to tile arguments that swiglu_fwd_fp4 /
    swiglu_bwd_fp4 run, each giving the default kernel's outputs bit for bit (a typo'd spelling fails to parse
    instead of timing something else)."""
    from fp4moe.bench.swiglu_fusion import _bwd_tiles, _tiles
    from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_fwd_fp4
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_bwd_fp4

    tiles = _bwd_tiles("tiles, b2x3x2")
    assert tiles == ["tiles", ("blocks", 2, 3, 2)]
    g = torch.Generator().manual_seed(5)
    h = (torch.randn(9, 2 * 96, generator=g) * 3).to(torch.bfloat16)
    dz = torch.randn(9, 96, generator=g).to(torch.bfloat16)
    q = ref.bf16_to_fp4_row(h)
    want, _ = swiglu_bwd_fp4(q.data, q.scales, dz)
    for tile in tiles:
        assert torch.equal(swiglu_bwd_fp4(q.data, q.scales, dz, tile=tile)[0].view(torch.int16), want.view(torch.int16))
    for typo in ("blocks8x4", "words", "8x128x4"):
        with pytest.raises(ValueError):
            _bwd_tiles(typo)
    fwd = _tiles("8x1, 16x2")
    assert fwd == [(8, 1), (16, 2)]
    z, (qd, qs) = swiglu_fwd_fp4(h)
    for tile in fwd:
        z1, (qd1, qs1) = swiglu_fwd_fp4(h, tile=tile)
        assert torch.equal(z1.view(torch.int16), z.view(torch.int16)) and torch.equal(qd1, qd) and torch.equal(qs1, qs)


@triton.jit
def _bf16_round_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    """common.bf16_rne_bits applied to int32 words."""
    i = tl.arange(0, BLOCK)
    m = i < n
    tl.store(o_ptr + i, bf16_rne_bits(tl.load(x_ptr + i, mask=m)), mask=m)


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
def test_bf16_rounding_of_the_kernels_keeps_nan_and_rounds_as_torch():
    """common.bf16_rne_bits (the SwiGLU kernels' z / dh rounding and the bf16x2 twins'): nearest-even as torch's
    ``.to(torch.bfloat16)`` on float32 bit patterns, and NaN stays NaN whatever its payload: a GPU's NaN is
    0x7FFFFFFF, which the rounding add alone carries into 0x8000 (-0.0)."""
    words = [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFF800001, 0x7FC00000, 0x7F800000, 0xFF800000, 0x7F7FFFFF,
             0x3F800000, 0x3F808000, 0x3F818000, 0x3F807FFF, 0x80000000, 0x00000001, 0x00008000, 0x00018000]
    bits = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
    out = torch.empty_like(bits)
    _bf16_round_kernel[(1,)](bits, out, len(words), BLOCK=16)
    got = (out & 0xFFFF).to(torch.int16).view(torch.bfloat16).float()
    want = bits.view(torch.float32).to(torch.bfloat16).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), (got, want)
    assert torch.equal(got[~nan], want[~nan]) and torch.equal(torch.signbit(got[~nan]), torch.signbit(want[~nan]))


def _fp8_inputs(counts, f, weighted, device, gen):
    """h [T, 2F], dz [T, F] (bf16) and probs over the experts' rows, with values at both ends of the float32 range
    after scaling: NaN, Inf, values whose z or dh overflows to Inf, and ones whose z is a BF16 denormal or zero."""
    t = sum(counts)
    h = (torch.randn(t, 2 * f, generator=gen) * 3).to(torch.bfloat16)
    dz = torch.randn(t, f, generator=gen).to(torch.bfloat16)
    if t > 6:
        h[0, 5], h[1, f + 7], h[2, 9] = float("nan"), float("inf"), -float("inf")
        h[3, :f // 2], h[3, f:f + f // 2] = 2.0 ** 70, 2.0 ** 70      # z = 2**140: Inf in float32
        h[4, 128:], h[4, f + 128:] = 2.0 ** -70, 2.0 ** -60           # z ~ 2**-131: a BF16 denormal
        h[5] = h[5] * 2.0 ** -126                                     # a token of tiny values
        dz[6, 3], dz[2, :] = float("nan"), dz[2, :] * 2.0 ** 100
    probs = (torch.rand(t, generator=gen) + 0.01).to(device) if weighted else None
    return h.to(device), dz.to(device), probs


def _check_fp8(counts, f, weighted, device, gen, tile=None):
    """``swiglu_fwd_fp8`` / ``swiglu_bwd_fp8`` against the kernels they fuse, bit for bit: z's (dh's) FP8 rows and
    columns equal ``bf16_to_fp8_row`` / ``bf16_to_fp8_col`` of the fused SwiGLU kernels' z (dh, also from h's MXFP4
    copy), without columns the same rows; dprobs within float32 rounding of ``swiglu_bwd``'s (the same terms summed
    in another order)."""
    from fp4moe_kernels import convert as kops
    from fp4moe_kernels import selfcheck
    from fp4moe_kernels.formats import Segments
    from fp4moe_kernels.triton_kernels import launchers
    from fp4moe_kernels.triton_kernels.fused_swiglu import (swiglu_bwd, swiglu_bwd_fp4, swiglu_bwd_fp8, swiglu_fwd,
                                                            swiglu_fwd_fp8)

    lib = launchers if device == "cpu" else kops
    seg = Segments.of(counts, sum(counts))
    h, dz, probs = _fp8_inputs(counts, f, weighted, device, gen)

    def quantized(x):
        return lib.bf16_to_fp8_row(x, seg), lib.bf16_to_fp8_col(x, seg)

    z_rows, z_cols = quantized(swiglu_fwd(h, probs))
    rows, cols = swiglu_fwd_fp8(h, probs, seg, True, tile=tile)
    assert not selfcheck.compare(rows, z_rows) and not selfcheck.compare(cols, z_cols)
    rows, cols = swiglu_fwd_fp8(h, probs, seg, False, tile=tile)
    assert cols is None and not selfcheck.compare(rows, z_rows)
    q4 = lib.bf16_to_fp4_row(h)
    sources = [(h, swiglu_bwd(h, dz, probs))]
    if tile is None or tile[0] >= 32:  # MXFP4 h is decoded in whole 32-element blocks
        sources.append(((q4.data, q4.scales), swiglu_bwd_fp4(q4.data, q4.scales, dz, probs, tile="tiles")))
    for h_in, (dh, dp0) in sources:
        dh_rows, dh_cols = quantized(dh)
        for with_cols in (True, False) if h_in is h else (True,):
            rows, cols, dp = swiglu_bwd_fp8(h_in, dz, probs, seg, with_cols, tile=tile)
            assert not selfcheck.compare(rows, dh_rows)
            assert (cols is None) if not with_cols else not selfcheck.compare(cols, dh_cols)
            if not weighted:
                assert dp is None
                continue
            nan = torch.isnan(dp0)
            assert torch.equal(torch.isnan(dp), nan)
            fin = ~nan & torch.isfinite(dp0)
            torch.testing.assert_close(dp[fin], dp0[fin], rtol=2e-5, atol=2e-5 * max(1.0, _max(dp0[fin].abs())))


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
@pytest.mark.parametrize("counts,f,bn,weighted", [([0, 130, 5, 0, 1], 256, 32, True), ([9, 128], 128, 128, False),
                                                  ([200], 128, 64, True), ([0, 0], 128, 32, True)])
def test_swiglu_writing_fp8_interpreted(counts, f, bn, weighted):
    _check_fp8(counts, f, weighted, "cpu", torch.Generator().manual_seed(sum(counts) + f + bn), tile=(bn, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("counts,f", [([1024] * 8, 2048), ([700, 0, 1300, 96, 1] * 4, 1024), ([0], 2048)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("tile", [None, (16, 4), (32, 8), (128, 8)])
def test_swiglu_writing_fp8_gpu(counts, f, weighted, tile):
    _check_fp8(counts, f, weighted, "cuda", torch.Generator().manual_seed(sum(counts) + f), tile=tile)


def test_swiglu_writing_fp8_rejects_what_it_cannot_quantize():
    """F not a multiple of 128, segments that do not cover h's rows, a wrong dz, MXFP4 h decoded in part-blocks:
    refused with the reason, before any launch."""
    from fp4moe_kernels.formats import Segments
    from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_bwd_fp8, swiglu_fwd_fp8

    seg = Segments.of([2], 2)
    with pytest.raises(ValueError, match="multiple of 128"):
        swiglu_fwd_fp8(torch.zeros(2, 2 * 96, dtype=torch.bfloat16), None, seg)
    with pytest.raises(ValueError, match="segments count 3 rows, h has 2"):
        swiglu_fwd_fp8(torch.zeros(2, 256, dtype=torch.bfloat16), None, Segments.of([1, 2], 3))
    for dz in (torch.zeros(2, 128), torch.zeros(2, 64, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match=r"dz must be contiguous bfloat16 \[T, F\]"):
            swiglu_bwd_fp8(torch.zeros(2, 256, dtype=torch.bfloat16), dz, None, seg)
    q, sc = torch.zeros(2, 128, dtype=torch.uint8), torch.zeros(2, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scales"):
        swiglu_bwd_fp8((q, sc[:, :4]), torch.zeros(2, 128, dtype=torch.bfloat16), None, seg)
    with pytest.raises(ValueError, match="BN 16 must be >= 32"):
        swiglu_bwd_fp8((q, sc), torch.zeros(2, 128, dtype=torch.bfloat16), None, seg, tile=(16, 4))


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
def test_bench_fp8_cases_time_equal_computations():
    """Each FP8-writing SwiGLU case of fp4moe.bench.swiglu_fusion (default tile and a --fp8-tiles one) and the
    unfused kernels it is timed against return the same FP8 copies; BN 16 has no backward-from-MXFP4 case (refused
    by the kernel)."""
    from fp4moe.bench.swiglu_fusion import _fp8_cases, _tiles
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels import selfcheck

    t, f = 140, 128
    g = torch.Generator().manual_seed(2)
    h = (torch.randn(t, 2 * f, generator=g) * 3).to(torch.bfloat16)
    dz = torch.randn(t, f, generator=g).to(torch.bfloat16)
    p = torch.rand(t, generator=g)
    cases = _fp8_cases(t, f, h, dz, p, ref.bf16_to_fp4_row(h), 3, _tiles("16x2"), 4 * t)
    names = [c[0] for c in cases]
    assert len(cases) == 7 and not any("MXFP4" in n and "tile 16x2" in n for n in names), names
    for name, fused, unfused, nbytes in cases:
        got, want = fused(), unfused()
        got = got[:2] if len(got) == 3 else got  # the backward's dprobs is no FP8 copy
        if got[1] is None:  # rows only: the unfused side is the row quantizer alone
            got = got[0]
        assert not selfcheck.compare(got, want), name


def test_bench_refuses_a_misspelled_tile_before_any_gpu_work(capsys):
    """fp4moe.bench.swiglu_fusion checks --shapes and the tile lists first, on any machine (exit 2 naming the form)."""
    from fp4moe.bench.swiglu_fusion import main

    for bad in (["--fp8-tiles", "32x"], ["--fp8-tiles", "32x4x2"], ["--shapes", "1024"], ["--bwd-fp4-tiles", "b8x4"]):
        with pytest.raises(SystemExit) as e:
            main(bad)
        assert e.value.code == 2 and "AxB" in capsys.readouterr().err, bad


def test_bench_results_are_rewritten_after_each_row_and_marked_until_complete(tmp_path):
    """fp4moe.bench.swiglu_fusion's results files as main writes them after each row: a run cut short (a device
    call's limit: on an H100 four --fp8-tiles needed more than 200 s and the old code wrote only at the end, so the
    whole sweep was lost) leaves the rows so far, marked incomplete in both files; the last write marks it complete.
    No temporary file is left beside them."""
    import json

    from fp4moe.bench.swiglu_fusion import write_results

    env = {"gpu": "NVIDIA H100 80GB HBM3", "commit": "abcdef0123", "date": "2026-12-06T02:30:00", "command": "x"}
    row = {"shape": "32768x2048", "pass": "forward", "probs": True, "fused_ms": 0.14, "unfused_ms": 1.27,
           "bytes": 1, "gbps": 2856.0, "pct_copy": 95.2, "speedup": 9.01}
    stem = tmp_path / "out" / "swiglu_h100_2026-12-06_abcdef0"
    write_results(stem, env, 3000.0, [row], complete=False)
    doc = json.loads(stem.with_suffix(".json").read_text())
    assert doc["complete"] is False and doc["rows"] == [row]
    assert "**Incomplete**: the run stopped after these 1 rows" in stem.with_suffix(".md").read_text()
    write_results(stem, env, 3000.0, [row, dict(row, probs=False)], complete=True)
    doc = json.loads(stem.with_suffix(".json").read_text())
    md = stem.with_suffix(".md").read_text()
    assert doc["complete"] is True and len(doc["rows"]) == 2 and "Incomplete" not in md
    assert md.count("| 32768x2048 | forward |") == 2
    assert sorted(p.name for p in stem.parent.iterdir()) == [stem.name + ".json", stem.name + ".md"]
