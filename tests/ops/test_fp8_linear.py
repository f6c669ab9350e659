"""FP8 GEMMs and the FP8 linear (fp4moe.ops.fp8_gemm, fp4moe.ops.fp8_linear) against float64 references.

Tolerances, and why (u = unit roundoff):

* Output rounding: bf16 has 8 significant bits, u = 2**-8; FP32 accumulation of C products adds at most
  C * 2**-24 (first-order) of sum|a'b'|. So ``fp8_mm`` against the float64 product of its *dequantized*
  operands must agree to ``2**-8 |ref| + C 2**-23 (|a'| @ |b'|^T)`` elementwise (tight: nothing else differs).
* E4M3 quantization (3 mantissa bits, power-of-two group scale s): error <= 2**-4 |x| in the normal range and
  <= 2**-10 s (half the subnormal step 2**-9) below it; s < 2 amax/448. MXFP4 (E2M1, "ceil" scale
  s4 < 2 amax32/6): error <= 2**-2 |x| for |x| >= s4 and <= s4/4 below. Against the *original* operands the
  product's error is then at most ``|da| @ |b| + |a| @ |db| + |da| @ |db|`` plus the output rounding:
  a worst-case bound checked elementwise (it cannot fail unless a scale or a rounding is wrong).
* The typical error is much smaller and predictable: RNE to 3 mantissa bits leaves an error uniform over half
  a step, relative RMS ``E8 = 2**-3/sqrt(12) * sqrt(E[1/m**2])`` with mantissas m log-uniform on [1, 2)
  (Gaussian data): E8 = 0.02655. Independent errors of the two operands of a K-long dot product add in
  quadrature, so the relative Frobenius error of y, dX and dW under fp8 is sqrt(2) E8 = 0.0375 (measured
  0.0374-0.0379). The mxfp4 wgrad operand carries the MXFP4 error E4 (measured on the same x, ~0.116 for
  Gaussian rows) and a second E4M3 rounding (FP4RowToFP8Col), so dW's error is sqrt(E4**2 + 2 E8**2) (~0.12).
  Tests require the measured Frobenius error within [0.9, 1.1] x the prediction (measured: within 3%): the
  upper end catches a wrong scale or rounding, the lower one a path that silently skipped quantization.
* GPU vs the CPU emulation: the FP8 operands are bit-identical (kernels == reference); results differ by the
  bf16 rounding on each side (2 * 2**-8 |y|) and Hopper's FP8 MMA accumulation, which keeps ~14 bits within
  each 128-wide K chunk before promotion to FP32 (DeepSeek-V3 report §3.3.2): <= 128 * 2**-14 = 2**-7 of
  sum|a'b'|. Checked as ``2**-7 |y_cpu| + 2**-6 (|a| @ |b|^T)`` (|a'| <= (1 + 2**-4)|a| + tiny).
"""
from __future__ import annotations

import math

import pytest
import torch

from fp4moe.ops import (
    FP8Linear,
    dequantize_weight_128x128,
    fp8_linear,
    fp8_mm,
    linear_saved_bytes,
    quantize_weight_128x128,
    saved_bytes,
    transpose_weight_128x128,
)
from fp4moe.ops.fp8_gemm import GPU_ROW_MULTIPLE, scaled_mm_args
from fp4moe.ops.accounting import saved_bytes_during
from fp4moe.recipe import Recipe
from fp4moe_kernels import convert as kops
from fp4moe_kernels import reference as R
from fp4moe_kernels.formats import FormatError, Segments

from oracles import ceil_log2_ratio_exact

F64 = torch.float64
U_BF16 = 2.0**-8
E4M3_REL, E4M3_SUB = 2.0**-4, 2.0**-10
E2M1_REL = 2.0**-2
# Relative RMS error of RNE to E4M3 for log-uniform mantissas: 2**-3/sqrt(12) * sqrt(E[1/m^2]),
# E[1/m^2] = int_1^2 m^-2 / (m ln 2) dm = 3 / (8 ln 2).
E8 = 2.0**-3 / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2)))
CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


# ------------------------------------------------------------------------------------------------ helpers


def gen(seed):
    return torch.Generator().manual_seed(seed)


def u8(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int32) if t.dtype == torch.float32 else t


def bits_equal(a, b):
    return a.shape == b.shape and torch.equal(u8(a.contiguous()), u8(b.contiguous()))


def group_amax_rows(x):
    """[M, K] -> per-element amax of its 1x128 group along K."""
    m, k = x.shape
    return x.abs().reshape(m, k // 128, 128).amax(-1).repeat_interleave(128, 1)


def group_amax_cols(x, counts=None):
    """[M, K] -> per-element amax of its 128-token group along M (per segment, as the column layout)."""
    seg = Segments.of(counts, x.shape[0])
    out = torch.zeros_like(x)
    for r0, r1 in zip(seg.offsets[:-1], seg.offsets[1:]):
        for g0 in range(r0, r1, 128):
            g1 = min(g0 + 128, r1)
            out[g0:g1] = x[g0:g1].abs().amax(0, keepdim=True)
    return out


def group_amax_blocks(w):
    n, k = w.shape
    a = w.abs().reshape(n // 128, 128, k // 128, 128).amax(dim=(1, 3))
    return a.repeat_interleave(128, 0).repeat_interleave(128, 1)


def e4m3_err(x, amax):
    """Worst-case |Q(x) - x| for E4M3 with power-of-two scale s < 2 amax / 448."""
    return E4M3_REL * x.abs() + E4M3_SUB * 2 * amax / 448


def mxfp4_err(x):
    """Worst-case |Q4(x) - x| for MXFP4 "ceil": s4 < 2 amax32 / 6, error <= |x|/4 or s4/4."""
    m, k = x.shape
    a32 = x.abs().reshape(m, k // 32, 32).amax(-1).repeat_interleave(32, 1)
    return E2M1_REL * x.abs() + 2 * a32 / 6 / 4


def product_bound(a, da, b, db, c, u_out):
    """Elementwise bound on |Q(a) Q(b)^T - a b^T| (a [R, C], b [S, C], float64), output rounding u_out."""
    aa, bb = a.abs(), b.abs()
    y = (a @ b.t()).abs()
    quant = da @ bb.t() + aa @ db.t() + da @ db.t()
    acc = c * 2.0**-23 * ((aa + da) @ (bb + db).t())
    return quant + acc + u_out * (y + quant + acc)


def rel_fro(got, ref):
    return ((got.to(F64) - ref).norm() / ref.norm()).item()


def assert_bounded(got, ref, bound, what):
    err = (got.to(F64) - ref).abs()
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert worst <= 1.0, f"{what}: error exceeds the worst-case bound by {worst:.3f}x"


def randn(seed, *shape, dtype=torch.bfloat16, std=1.0):
    return (torch.randn(*shape, generator=gen(seed), dtype=torch.float32) * std).to(dtype)


# --------------------------------------------------------------------------------------- weight quantizer


def tricky_weight(dtype=torch.float32):
    """[256, 384] with blocks whose amax is exactly 448 * 2**k, just above it, all zero, tiny, huge."""
    w = randn(1, 256, 384, dtype=torch.float32)
    w[:128, :128] *= 448 * 2.0**-3 / w[:128, :128].abs().max()  # amax == 448 * 2**-3 exactly -> k = -3
    w[:128, 128:256] *= 448 * 2.0**5 / w[:128, 128:256].abs().max()
    w[0, 128] = 450 * 2.0**5  # the next bf16 above 448 * 2**5 -> k = 6
    w[:128, 256:] = 0.0  # all-zero block -> scale 1
    w[128:, :128] *= 2.0**-100  # tiny
    w[128:, 128:256] *= 2.0**100  # huge
    w[128:, 256:] *= 1e-3
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_weight_scales_exact_powers_of_two(dtype):
    w = tricky_weight(dtype)
    q, s = quantize_weight_128x128(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (2, 3)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5), "scales must be powers of two"
    wf = w.to(F64)
    for i in range(2):
        for j in range(3):
            blk = wf[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
            amax = blk.abs().max().item()
            want = 0 if amax == 0 else ceil_log2_ratio_exact(amax, 448.0)
            assert s[i, j].item() == 2.0**want, (i, j, amax)
            # elements: blk / scale rounded to E4M3 nearest-even, bit for bit the reference's rounding
            assert bits_equal(q[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)], R._to_e4m3(blk / 2.0**want))
    assert s[0, 0].item() == 2.0**-3 and s[0, 1].item() == 2.0**6 and s[0, 2].item() == 1.0
    assert q.to(F64).abs().max() <= 448


def test_quantize_weight_error_bound_and_nan():
    w = randn(2, 384, 256, dtype=torch.float32, std=0.02)
    q, s = quantize_weight_128x128(w)
    deq = dequantize_weight_128x128(q, s, F64)
    wf = w.to(F64)
    sx = s.to(F64).repeat_interleave(128, 0).repeat_interleave(128, 1)
    err = (deq - wf).abs()
    assert torch.all(err <= torch.maximum(E4M3_REL * wf.abs(), E4M3_SUB * sx))
    assert rel_fro(deq, wf) == pytest.approx(E8, rel=0.1)  # the RMS prediction of the module docstring
    w[5, 200] = float("nan")
    w[200, 7] = float("inf")
    q2, s2 = quantize_weight_128x128(w)
    assert torch.isnan(q2[5, 200].float()) and torch.isnan(q2[200, 7].float())  # never finite garbage
    assert torch.equal(s2, s)  # amax over the finite values only


def test_transpose_weight_is_exact():
    w = tricky_weight()
    q, s = quantize_weight_128x128(w)
    qt, st = transpose_weight_128x128(q, s)
    q2, s2 = quantize_weight_128x128(w.t().contiguous())
    assert bits_equal(qt, q2) and bits_equal(st, s2) and qt.is_contiguous()


def test_quantize_weight_validation():
    with pytest.raises(FormatError, match="multiples of 128"):
        quantize_weight_128x128(torch.zeros(128, 100))
    with pytest.raises(FormatError, match="dtype"):
        quantize_weight_128x128(torch.zeros(128, 128, dtype=F64))


# ------------------------------------------------------------------------------------------------- fp8_mm


def operands(kind, m, k, n, seed, counts=None):
    """(a, a_scale, b, b_scale, a_hp, b_hp) for one GEMM kind: quantized operands and the float64 originals
    they came from, orientated [rows, contraction]."""
    x = randn(seed, m, k)
    w = randn(seed + 1, n, k, dtype=torch.float32, std=0.05)
    dy = randn(seed + 2, m, n)
    if kind == "fprop":
        f = kops.bf16_to_fp8_row(x, counts)
        a, sa = f.segment(0) if f.segments.num == 1 else (f.data, f.scale_matrix())
        b, sb = quantize_weight_128x128(w)
        return a, sa, b, sb, x.to(F64), w.to(F64)
    if kind == "dgrad":
        f = kops.bf16_to_fp8_row(dy, counts)
        a, sa = f.segment(0)
        b, sb = transpose_weight_128x128(*quantize_weight_128x128(w))
        return a, sa, b, sb, dy.to(F64), w.to(F64).t()
    fa, fb = kops.bf16_to_fp8_col(dy, counts), kops.bf16_to_fp8_col(x, counts)
    a, sa = fa.segment(0)
    b, sb = fb.segment(0)
    return a, sa, b, sb, dy.to(F64).t(), x.to(F64).t()


def dequant(t, s, kind, is_b):
    if is_b and kind != "wgrad":
        return dequantize_weight_128x128(t, s, F64)
    return t.to(F64) * s.to(F64).repeat_interleave(128, 1)


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("m", [256, 200])
def test_fp8_mm_against_float64(kind, m):
    k, n = 384, 256
    a, sa, b, sb, a_hp, b_hp = operands(kind, m, k, n, seed=10 + m)
    y = fp8_mm(a, sa, b, sb, kind)
    assert y.dtype == torch.bfloat16
    ad, bd = dequant(a, sa, kind, False), dequant(b, sb, kind, True)
    c = a.shape[1]
    assert y.shape == (a.shape[0], b.shape[0])
    # tight: against the float64 product of the dequantized operands (only FP32 accumulation + bf16 rounding)
    ref_q = ad @ bd.t()
    tight = U_BF16 * ref_q.abs() + c * 2.0**-23 * (ad.abs() @ bd.abs().t())
    assert torch.all((y.to(F64) - ref_q).abs() <= tight)
    assert torch.equal(fp8_mm(a, sa, b, sb, kind, out_dtype=F64, compute_dtype=F64), ref_q)
    # loose: against the original operands, the E4M3 worst case (module docstring)
    ref = a_hp @ b_hp.t()
    if kind == "wgrad":  # groups of 128 tokens along the contraction (columns of a_hp/b_hp)
        da, db = e4m3_err(a_hp, group_amax_cols(a_hp.t()).t()), e4m3_err(b_hp, group_amax_cols(b_hp.t()).t())
    else:
        da = e4m3_err(a_hp, group_amax_rows(a_hp))
        db = e4m3_err(b_hp, group_amax_blocks(b_hp))
    pad = c - a_hp.shape[1]  # wgrad: the column layout pads tokens with zeros
    assert pad == (0 if kind != "wgrad" else (-m) % 128)
    assert_bounded(y, ref, product_bound(a_hp, da, b_hp, db, c, U_BF16), kind)
    assert 0.9 * math.sqrt(2) * E8 <= rel_fro(y, ref) <= 1.1 * math.sqrt(2) * E8


def test_fp8_mm_scale_strides_and_validation():
    a, sa, b, sb, _, _ = operands("fprop", 256, 256, 128, seed=3)
    y = fp8_mm(a, sa, b, sb, "fprop")
    assert sa.stride() == (1, 256)  # FP8RowTensor.segment's M-major view
    assert torch.equal(fp8_mm(a, sa.contiguous(), b, sb, "fprop"), y)  # row-major scales give the same
    with pytest.raises(FormatError, match="kind"):
        fp8_mm(a, sa, b, sb, "bprop")
    with pytest.raises(FormatError, match="contraction"):
        fp8_mm(a, sa, b[:, :128].contiguous(), sb[:, :1].contiguous(), "fprop")
    with pytest.raises(FormatError, match="b_scale"):
        fp8_mm(a, sa, b, sb[:, :1].contiguous(), "fprop")
    with pytest.raises(FormatError, match="float8"):
        fp8_mm(a.float(), sa, b, sb, "fprop")
    assert fp8_mm(a[:0], sa[:0], b, sb, "fprop").shape == (0, 128)


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
@pytest.mark.parametrize("m", [256, 200, 1])
def test_scaled_mm_args_follow_torchs_layout_rules(kind, m):
    """What fp8_mm hands F.scaled_mm on CUDA, checked on CPU: shapes/strides as torch's blockwise checks
    (ScaledBlas.cpp, _scaled_block1x128_block128x128 / _scaled_block1x128_block1x128) demand, and numbers that,
    read with cuBLAS's semantics, give the emulation's result. K = 384 (3 groups) exercises the padding of the
    128x128 scale rows to 4 floats."""
    k, n = 384, 256
    a, sa, b, sb, _, _ = operands(kind, m, k, n, seed=20)
    mat_a, mat_b, sa2, sb2, r = scaled_mm_args(a, sa, b, sb, kind)
    rows, c = mat_a.shape
    s = mat_b.shape[1]
    assert mat_b.shape == (c, s) and mat_b.stride() == (1, c)  # column-major b
    assert c % 16 == 0 and s % 16 == 0 and mat_a.is_contiguous()
    g = c // 128
    assert sa2.shape == (rows, g) and sa2.stride(0) == 1 and (sa2.stride(1) == rows or g == 1)
    if kind == "wgrad":
        assert (rows, r) == (a.shape[0], a.shape[0])
        assert sb2.shape == (s, g) and sb2.stride(0) == 1 and (sb2.stride(1) == s or g == 1)
        bs = sb2.t().to(F64).repeat_interleave(128, 0)  # scale_b[j, blk] scales mat_b[128 blk : ..., j]
    else:
        assert r == a.shape[0] and rows % GPU_ROW_MULTIPLE == 0 and rows - r < GPU_ROW_MULTIPLE
        g4 = -(-g // 4) * 4
        assert sb2.shape == (g4, s // 128) and sb2.stride() == (1, g4)
        bs = sb2[:g].to(F64).repeat_interleave(128, 0).repeat_interleave(128, 1)  # [kb, nb] -> block of mat_b
    a_deq = mat_a.to(F64) * sa2.to(F64).repeat_interleave(128, 1)
    y = (a_deq @ (mat_b.to(F64) * bs))[:r]
    assert torch.equal(y, fp8_mm(a, sa, b, sb, kind, out_dtype=F64, compute_dtype=F64))


# ----------------------------------------------------------------------------------------------- FP8Linear


def linear_case(m, k, n, seed, w_dtype=torch.float32):
    x = randn(seed, m, k)
    w = randn(seed + 1, n, k, dtype=w_dtype, std=0.02)
    g = randn(seed + 2, m, n)
    return x, w, g


def run_linear(x, w, g, recipe, counts=None):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_linear(xx, ww, recipe, counts)
    y.backward(g)
    return y.detach(), xx.grad, ww.grad


def reference64(x, w, g):
    xd, wd = x.to(F64).requires_grad_(), w.to(F64).requires_grad_()
    y = xd @ wd.t()
    y.backward(g.to(F64))
    return y.detach(), xd.grad, wd.grad


@pytest.mark.parametrize("m, counts", [(256, None), (200, None), (200, [0, 77, 123, 0])])
def test_fp8_linear_against_float64(m, counts):
    k, n = 512, 256
    x, w, g = linear_case(m, k, n, seed=m)
    yr, dxr, dwr = reference64(x, w, g)
    x64, w64, g64 = x.to(F64), w.to(F64), g.to(F64)
    out = {name: run_linear(x, w, g, Recipe.preset(name), counts) for name in ("fp8", "mxfp4")}
    for name, (y, dx, dw) in out.items():
        assert (y.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
        # worst-case elementwise bounds
        dx8 = e4m3_err(x64, group_amax_rows(x64))
        dw8 = e4m3_err(w64, group_amax_blocks(w64))
        assert_bounded(y, yr, product_bound(x64, dx8, w64, dw8, k, U_BF16), f"{name} y")
        dg8 = e4m3_err(g64, group_amax_rows(g64))
        assert_bounded(dx, dxr, product_bound(g64, dg8, w64.t(), dw8.t(), n, U_BF16), f"{name} dX")
        dgc = e4m3_err(g64, group_amax_cols(g64, counts))
        if name == "fp8":
            dxc = e4m3_err(x64, group_amax_cols(x64, counts))
        else:
            d4 = mxfp4_err(x64)
            dxc = d4 + e4m3_err(x64.abs() + d4, group_amax_cols(x64.abs() + d4, counts))
        assert_bounded(dw, dwr, product_bound(g64.t(), dgc.t(), x64.t(), dxc.t(), m, 2.0**-24), f"{name} dW")
        # typical (RMS) errors against their predictions
        pred8 = math.sqrt(2) * E8
        for what, got, ref in (("y", y, yr), ("dX", dx, dxr)):
            assert 0.9 * pred8 <= rel_fro(got, ref) <= 1.1 * pred8, (name, what, rel_fro(got, ref))
        if name == "fp8":
            pred_dw = pred8
        else:
            e4 = rel_fro(R.dequantize_mxfp4(R.quantize_mxfp4(x)), x64)
            assert 0.08 < e4 < 0.15  # MXFP4 of Gaussian rows
            pred_dw = math.sqrt(e4**2 + 2 * E8**2)
        assert 0.9 * pred_dw <= rel_fro(dw, dwr) <= 1.1 * pred_dw, (name, "dW", rel_fro(dw, dwr), pred_dw)
    # mxfp4 vs fp8: forward rows and dgrad are the same FP8 path (bit-identical); only wgrad's X differs
    (y8, dx8_, dw8_), (y4, dx4, dw4) = out["fp8"], out["mxfp4"]
    assert torch.equal(y8, y4) and torch.equal(dx8_, dx4)
    diff = rel_fro(dw4, dw8_.to(F64))
    e4 = rel_fro(R.dequantize_mxfp4(R.quantize_mxfp4(x)), x64)
    pred = math.sqrt(e4**2 + 2 * E8**2)  # dY columns shared; X: (E4 + E8 of FP4RowToFP8Col) vs E8
    assert 0.9 * pred <= diff <= 1.1 * pred, (diff, pred)


def test_counts_only_shape_the_layout():
    x, w, g = linear_case(200, 256, 128, seed=7)
    for name in ("fp8", "mxfp4"):
        y0, dx0, dw0 = run_linear(x, w, g, Recipe.preset(name))
        y1, dx1, dw1 = run_linear(x, w, g, Recipe.preset(name), [100, 100])
        assert torch.equal(y0, y1) and torch.equal(dx0, dx1)  # row groups do not depend on segments
        assert rel_fro(dw1, dw0.to(F64)) < 0.1  # column groups do (128 tokens per segment)


def test_bf16_and_out_of_scope_use_f_linear():
    x, w, g = linear_case(64, 256, 128, seed=1, w_dtype=torch.bfloat16)
    y = fp8_linear(x, w, Recipe.bf16())
    assert torch.equal(y, torch.nn.functional.linear(x, w))
    fp8_scope = Recipe(name="fp8", scope="experts")
    assert torch.equal(fp8_linear(x, w, fp8_scope, layer_kind="dense"), y)
    xx = x.clone().requires_grad_()
    y2 = fp8_linear(xx, w, fp8_scope, layer_kind="expert")
    assert isinstance(y2.grad_fn, FP8Linear._backward_cls) and not torch.equal(y2, y)


def test_leading_dims_and_dtypes():
    x, w, g = linear_case(96, 256, 128, seed=2, w_dtype=torch.bfloat16)
    x3 = x.reshape(2, 48, 256).clone().requires_grad_()
    ww = w.clone().requires_grad_()
    y = fp8_linear(x3, ww, Recipe.mxfp4())
    assert y.shape == (2, 48, 128)
    y.backward(g.reshape(2, 48, 128))
    assert x3.grad.shape == x3.shape and ww.grad.dtype == torch.bfloat16
    y2, dx2, dw2 = run_linear(x, w, g, Recipe.mxfp4())
    assert torch.equal(y.reshape(96, 128), y2) and torch.equal(x3.grad.reshape(96, 256), dx2)
    assert torch.equal(ww.grad, dw2)
    with pytest.raises(FormatError, match="multiples of 128"):
        fp8_linear(torch.zeros(4, 256), torch.zeros(100, 256), Recipe.fp8())


# ------------------------------------------------------------------------------------------- saved bytes


count_saved = saved_bytes_during  # bytes autograd saved, storages of `exclude` left out


@pytest.mark.parametrize("m, counts", [(256, None), (200, None), (200, [60, 70, 70]), (200, [0, 200])])
def test_saved_bytes_match_the_saved_tensors(m, counts):
    k, n = 512, 256
    x, w, _ = linear_case(m, k, n, seed=5)
    got = {}
    for name in ("bf16", "fp8", "mxfp4"):
        recipe = Recipe.preset(name)
        xx = x.clone().requires_grad_()
        ww = w.to(torch.bfloat16).requires_grad_()
        nbytes, y = count_saved(lambda: fp8_linear(xx, ww, recipe, counts if name != "bf16" else None), [ww])
        want = linear_saved_bytes(m, k, recipe, counts)
        assert nbytes == want, (name, nbytes, want)
        if name != "bf16":
            assert saved_bytes(y) == want
        got[name] = nbytes
    mp = Segments.of(counts, m).padded_total
    assert got["bf16"] == 2 * m * k
    assert got["mxfp4"] == m * k // 2 + m * k // 32
    assert got["fp8"] == m * k + 4 * m * k // 128 + k * mp + 4 * k * mp // 128
    if m == 256:  # by hand: 65536 + 4096 vs (131072 + 4096) * 2
        assert (got["mxfp4"], got["fp8"]) == (69632, 270336)
        assert got["mxfp4"] <= 0.5 * got["fp8"]


def test_nothing_saved_without_weight_grad():
    x, w, _ = linear_case(128, 256, 128, seed=6)
    xx = x.clone().requires_grad_()
    nbytes, y = count_saved(lambda: fp8_linear(xx, w, Recipe.fp8()), [w])
    assert nbytes == 0 and saved_bytes(y) == 0
    y.sum().backward()
    assert xx.grad is not None


@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_forward_under_no_grad_makes_no_backward_operands(name, monkeypatch):
    """Under ``torch.no_grad`` (a recomputed block's first forward) the weight still requires grad, but no backward
    follows: no FP8 column copy and no MXFP4 copy of x is made (only the FP8 rows the GEMM reads), and y is the
    same bits as with grad mode on, where the backward's operands are made."""
    from fp4moe_kernels import convert

    made = []
    for fn in ("bf16_to_fp8_col", "bf16_to_fp4_and_fp8_row", "bf16_to_fp8_row"):
        real = getattr(convert, fn)
        monkeypatch.setattr(convert, fn, lambda *a, _real=real, _fn=fn, **k: made.append(_fn) or _real(*a, **k))
    recipe = Recipe.fp8() if name == "fp8" else Recipe.mxfp4()
    x, w, _ = linear_case(256, 256, 128, seed=9)
    ww = w.clone().requires_grad_()
    y_grad = fp8_linear(x, ww, recipe)
    with_grad, made[:] = list(made), []
    with torch.no_grad():
        y_none = fp8_linear(x, ww, recipe)
    assert torch.equal(y_grad.detach().view(torch.int16), y_none.view(torch.int16))
    assert with_grad == (["bf16_to_fp8_row", "bf16_to_fp8_col"] if name == "fp8" else ["bf16_to_fp4_and_fp8_row"])
    assert made == ["bf16_to_fp8_row"]


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not CUDA, reason="needs a CUDA GPU with blockwise FP8 GEMMs (sm_90)")])])
@pytest.mark.parametrize("counts", [None, [100, 0, 156]])
def test_fp8_row_col_switch_changes_no_bit(device, counts, monkeypatch):
    """``fp8_row_col=1``: x's rows and columns (forward) and dY's (backward) each from one ``bf16_to_fp8_row_col``
    call; y, dX and dW the same bits as with the two kernels."""
    from fp4moe_kernels import convert, switches

    fused = []
    real = convert.bf16_to_fp8_row_col
    monkeypatch.setattr(convert, "bf16_to_fp8_row_col", lambda *a, **k: fused.append(1) or real(*a, **k))
    x, w, _ = linear_case(256, 256, 128, seed=12)
    dy = torch.randn(256, 128, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16).to(device)
    got = {}
    for value in ("0", "1"):
        xx, ww = x.to(device).clone().requires_grad_(), w.to(device).clone().requires_grad_()
        with switches.use(switches.Switches(fp8_row_col=value)):
            y = fp8_linear(xx, ww, Recipe.fp8(), counts)
            y.backward(dy)
        got[value] = [t.detach().float() for t in (y, xx.grad, ww.grad)]
    assert len(fused) == 2
    for a, b in zip(got["0"], got["1"]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with blockwise FP8 GEMMs (sm_90)")
@pytest.mark.parametrize("m", [256, 200, 201, 1])
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_fp8_linear_gpu_matches_cpu_emulation(m, name):
    k, n = 512, 384
    x, w, g = linear_case(m, k, n, seed=11 + m)
    recipe = Recipe.preset(name)
    y_c, dx_c, dw_c = run_linear(x, w, g, recipe)
    dev = torch.device("cuda")
    xx, ww = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
    nbytes, y = count_saved(lambda: fp8_linear(xx, ww, recipe), [ww])
    assert nbytes == linear_saved_bytes(m, k, recipe)
    y.backward(g.to(dev))
    qc, sc = quantize_weight_128x128(w)
    qg, sg = quantize_weight_128x128(w.to(dev))
    assert bits_equal(qg.cpu(), qc) and bits_equal(sg.cpu(), sc)
    x64, w64, g64 = x.to(F64), w.to(F64), g.to(F64)
    for what, got, cpu, a, b in (
        ("y", y, y_c, x64, w64),
        ("dX", xx.grad, dx_c, g64, w64.t()),
        ("dW", ww.grad, dw_c, g64.t(), x64.t()),
    ):
        tol = 2.0**-7 * cpu.to(F64).abs() + 2.0**-6 * (a.abs() @ b.abs().t())
        assert_bounded(got.cpu(), cpu.to(F64), tol, f"{name} {what} GPU vs CPU")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with blockwise FP8 GEMMs (sm_90)")
@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_fp8_mm_gpu_matches_cpu(kind):
    a, sa, b, sb, a_hp, b_hp = operands(kind, 200, 512, 384, seed=4)
    y_c = fp8_mm(a, sa, b, sb, kind)
    y_g = fp8_mm(a.cuda(), sa.cuda(), b.cuda(), sb.cuda(), kind)  # M = 200: fprop/dgrad pad rows to 16
    tol = 2.0**-7 * y_c.to(F64).abs() + 2.0**-6 * (a_hp.abs() @ b_hp.abs().t())
    assert_bounded(y_g.cpu(), y_c.to(F64), tol, f"{kind} GPU vs CPU")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with blockwise FP8 GEMMs (sm_90)")
@pytest.mark.parametrize("kind", ["fprop", "dgrad"])
def test_fp8_mm_gpu_ragged_rows_padding(kind):
    """Experts of a ragged FP8RowTensor (row counts and offsets not multiples of 16; cuBLAS rejects such rows
    unpadded on an H200) padded with the rows that follow them in the buffer give the same bits as padded with
    zero rows (the expert copied to a buffer of its own), and match the CPU emulation within the FP8 bound."""
    counts = [37, 0, 150, 13, 63]
    m, k, n = sum(counts), 512, 384
    x = randn(21, m, k) if kind == "fprop" else randn(21, m, n)
    w = randn(22, n, k, dtype=torch.float32, std=0.05)
    f = kops.bf16_to_fp8_row(x.cuda(), counts)
    wq = quantize_weight_128x128(w.cuda())
    if kind == "dgrad":
        wq = transpose_weight_128x128(*wq)
    fc = kops.bf16_to_fp8_row(x, counts)
    wc = quantize_weight_128x128(w)
    if kind == "dgrad":
        wc = transpose_weight_128x128(*wc)
    for e, c in enumerate(counts):
        if not c:
            continue
        a, sa = f.segment(e)
        slack = fp8_mm(a, sa, *wq, kind)
        own = fp8_mm(a.clone(), sa, *wq, kind)
        assert torch.equal(slack, own), f"{kind} expert {e}: slack rows change the result"
        a_c, sa_c = fc.segment(e)
        ref = fp8_mm(a_c, sa_c, *wc, kind)
        a64 = a_c.to(F64) * sa_c.to(F64).repeat_interleave(128, 1)
        b64 = wc[0].to(F64) * wc[1].to(F64).repeat_interleave(128, 0).repeat_interleave(128, 1)
        tol = 2.0**-7 * ref.to(F64).abs() + 2.0**-6 * (a64.abs() @ b64.abs().t())
        assert_bounded(slack.cpu(), ref.to(F64), tol, f"{kind} expert {e} GPU vs CPU")
