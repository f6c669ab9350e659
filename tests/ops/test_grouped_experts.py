"""grouped_expert_mlp (fp4moe.ops.grouped_experts) against float64, per recipe, and its saved-bytes accounting.

Error model and tolerances (see tests/ops/test_fp8_linear.py for the single-GEMM version):

* Every FP8 (E4M3, 1x128 or 128x128 power-of-two scales) operand of a GEMM carries an independent relative
  rounding error of RMS ``E8 = 0.02655`` (RNE to 3 mantissa bits, log-uniform mantissas).
* MXFP4 operands (fc1 input under expert_input_fp4, SwiGLU input under activation_fp4_store, fc2 input's wgrad
  copy under save_fp4) carry the exact E2M1 error of the reference quantizer; FP4RowToFP8Col adds an E4M3
  rounding on top (FP4RowToFP8Row is lossless here).
* The error of the two-GEMM MLP and of its backward is that error propagated through fc1 -> SwiGLU -> fc2 and
  back. The test computes the *prediction* by running the same float64 forward/backward formulas with each
  quantized operand replaced by its modelled value (multiplicative Gaussian noise of RMS E8 for E4M3, the
  real MXFP4 round trip for E2M1; the same noise for a weight in fprop and dgrad, since both use one
  quantized copy), and requires the measured relative Frobenius error of y, dx, dw1, dw2 and dprobs to be
  within [0.8, 1.25] x the prediction (measured ratios are printed with -s; they lie in ~0.9-1.1). The
  lower end catches a path that silently skipped quantization, the upper one a wrong scale or rounding.
* bf16: only BF16 roundings of h, z, y and of the gradients (u = 2**-8): relative error < 4e-3.
"""
from __future__ import annotations

import math

import pytest
import torch

from fp4moe.ops.all_to_all import quantized_all_to_all
from fp4moe.ops.grouped_experts import expert_saved_bytes, grouped_expert_mlp
from fp4moe.ops.accounting import saved_bytes_during
from fp4moe.recipe import Recipe
from cuda_syncs import sync_calls
from fp4moe_kernels import reference as R

F64 = torch.float64
E8 = 2.0**-3 / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2)))
H, F = 256, 128
COUNTS = [70, 0, 150, 37, 0, 63]  # two experts without tokens, none a multiple of 128


def case(counts, seed=0, h=H, f=F):
    g = torch.Generator().manual_seed(seed)
    t, e = sum(counts), len(counts)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(e, 2 * f, h, generator=g) * h**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, f, generator=g) * f**-0.5).to(torch.bfloat16)
    p = torch.rand(t, generator=g) * 0.9 + 0.1
    dy = torch.randn(t, h, generator=g).to(torch.bfloat16)
    return x, w1, w2, p, dy


def run(x, counts, w1, w2, p, dy, recipe, **kw):
    xx, a, b, pp = (t.clone().requires_grad_() for t in (x, w1, w2, p))
    y = grouped_expert_mlp(xx, counts, a, b, pp, recipe, **kw)
    y.backward(dy)
    return dict(y=y.detach(), dx=xx.grad, dw1=a.grad, dw2=b.grad, dp=pp.grad)


def run_dispatched(x, counts, w1, w2, p, dy, recipe, **kw):
    """As ``run``, the input arriving as a dispatched MXFP4 (keep_fp4); dx is the sender's gradient."""
    xx = x.clone().requires_grad_()
    d = quantized_all_to_all(xx, [x.shape[0]], [x.shape[0]], keep_fp4=True)
    a, b, pp = (t.clone().requires_grad_() for t in (w1, w2, p))
    y = grouped_expert_mlp(d, counts, a, b, pp, recipe, **kw)
    y.backward(dy)
    return dict(y=y.detach(), dx=xx.grad, dw1=a.grad, dw2=b.grad, dp=pp.grad)


def offsets(counts):
    o = [0]
    for c in counts:
        o.append(o[-1] + c)
    return list(zip(o[:-1], o[1:]))


def model(x, counts, w1, w2, p, dy, q):
    """float64 forward + backward with explicit formulas; q[site](tensor) models the quantization at a site
    (identity when absent): x_f / x_c (fc1 input, fprop / wgrad), w1, w2, z_f / z_c, dy_r / dy_c, dh_r / dh_c,
    h_s (the SwiGLU input backward reads)."""
    Q = lambda s, t: q[s](t) if s in q else t  # noqa: E731
    x, w1, w2, p, dy = (t.to(F64) for t in (x, w1, w2, p, dy))
    f = w2.shape[2]
    w1q = torch.stack([Q("w1", w) for w in w1]) if len(w1) else w1
    w2q = torch.stack([Q("w2", w) for w in w2]) if len(w2) else w2
    sl = offsets(counts)
    xf, xc = Q("x_f", x), Q("x_c", x)
    hm = torch.cat([xf[a:b] @ w1q[e].t() for e, (a, b) in enumerate(sl)])
    g, u = hm[:, :f], hm[:, f:]
    z = torch.nn.functional.silu(g) * u * p[:, None]
    zf, zc = Q("z_f", z), Q("z_c", z)
    y = torch.cat([zf[a:b] @ w2q[e].t() for e, (a, b) in enumerate(sl)])
    dyr, dyc = Q("dy_r", dy), Q("dy_c", dy)
    dz = torch.cat([dyr[a:b] @ w2q[e] for e, (a, b) in enumerate(sl)])
    dw2 = torch.stack([dyc[a:b].t() @ zc[a:b] for a, b in sl])
    hs = Q("h_s", hm)
    g, u = hs[:, :f], hs[:, f:]
    s = torch.sigmoid(g)
    dp = (dz * g * s * u).sum(1)
    da = dz * p[:, None]
    dh = torch.cat([da * u * s * (1 + g * (1 - s)), da * g * s], 1)
    dhr, dhc = Q("dh_r", dh), Q("dh_c", dh)
    dx = torch.cat([dhr[a:b] @ w1q[e] for e, (a, b) in enumerate(sl)])
    dw1 = torch.stack([dhc[a:b].t() @ xc[a:b] for a, b in sl])
    return dict(y=y, dx=dx, dw1=dw1, dw2=dw2, dp=dp)


def error_model(recipe: Recipe, seed=123):
    g = torch.Generator().manual_seed(seed)
    e8 = lambda t: t * (1 + E8 * torch.randn(t.shape, generator=g, dtype=F64))  # noqa: E731
    fp4 = lambda t: R.dequantize_mxfp4(R.quantize_mxfp4(t)).to(F64)  # noqa: E731
    if not recipe.fp8_compute:
        return {}
    q = {k: e8 for k in ("x_f", "x_c", "w1", "w2", "z_f", "z_c", "dy_r", "dy_c", "dh_r", "dh_c")}
    if recipe.expert_input_fp4 or recipe.save_fp4:
        x4 = {}
        q["x_f"] = lambda t: x4.setdefault("v", fp4(t))  # noqa: E731  (FP4RowToFP8Row: lossless)
        q["x_c"] = lambda t: e8(x4.setdefault("v", fp4(t)))  # noqa: E731  (FP4RowToFP8Col)
    if recipe.save_fp4:
        q["z_c"] = lambda t: e8(fp4(t))  # noqa: E731
    if recipe.activation_fp4_store:
        q["h_s"] = fp4
    return q


def rel(got, ref):
    return ((got.to(F64) - ref).norm() / ref.norm()).item()


def check_error_model(got, ref, pred, label, hi):
    """Measured relative error of every output within [0.8, hi] x the error model's prediction."""
    for k in ref:
        m, pr = rel(got[k], ref[k]), rel(pred[k], ref[k])
        print(f"{label} {k}: measured {m:.4f} predicted {pr:.4f} ratio {m / pr:.3f}")
        assert 0.8 * pr <= m <= hi * pr, (label, k, m, pr)


def autograd_reference(x, counts, w1, w2, p, dy):
    x, w1, w2, p = (t.to(F64).requires_grad_() for t in (x, w1, w2, p))
    f = w2.shape[2]
    outs = []
    for e, (a, b) in enumerate(offsets(counts)):
        hm = x[a:b] @ w1[e].t()
        z = torch.nn.functional.silu(hm[:, :f]) * hm[:, f:] * p[a:b, None]
        outs.append(z @ w2[e].t())
    y = torch.cat(outs)
    y.backward(dy.to(F64))
    return dict(y=y.detach(), dx=x.grad, dw1=w1.grad, dw2=w2.grad, dp=p.grad)


def test_reference_formulas_match_autograd():
    x, w1, w2, p, dy = case(COUNTS)
    a, b = model(x, COUNTS, w1, w2, p, dy, {}), autograd_reference(x, COUNTS, w1, w2, p, dy)
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-10, atol=1e-10), k


@pytest.mark.parametrize("name", ["bf16", "fp8", "mxfp4"])
def test_against_float64(name):
    recipe = Recipe.preset(name)
    x, w1, w2, p, dy = case(COUNTS, seed=1)
    got = run(x, COUNTS, w1, w2, p, dy, recipe)
    ref = model(x, COUNTS, w1, w2, p, dy, {})
    assert got["y"].dtype == torch.bfloat16 and got["dx"].dtype == torch.bfloat16
    assert got["dw1"].dtype == w1.dtype and got["dp"].dtype == torch.float32
    for e, c in enumerate(COUNTS):  # experts without tokens: zero weight gradients
        if c == 0:
            assert not got["dw1"][e].any() and not got["dw2"][e].any()
    if name == "bf16":
        for k in ref:
            assert rel(got[k], ref[k]) < 4e-3, (k, rel(got[k], ref[k]))
        return
    check_error_model(got, ref, model(x, COUNTS, w1, w2, p, dy, error_model(recipe)), name, hi=1.25)
    if name == "fp8":  # sanity of the model itself: fc1 output error is sqrt(2) E8 before propagation
        assert 0.03 < rel(got["y"], ref["y"]) < 0.08


def test_mxfp4_vs_fp8_bounded():
    x, w1, w2, p, dy = case(COUNTS, seed=2)
    a = run(x, COUNTS, w1, w2, p, dy, Recipe.fp8())
    b = run(x, COUNTS, w1, w2, p, dy, Recipe.mxfp4())
    ref = model(x, COUNTS, w1, w2, p, dy, {})
    for k in a:
        # both carry their own error; their difference is at most the sum of the two (triangle inequality)
        d = rel(b[k], a[k].to(F64))
        assert d <= rel(a[k], ref[k]) + rel(b[k], ref[k]) + 1e-9, k
        assert d < 0.35, (k, d)


def test_dispatched_mxfp4_input_is_the_same_computation():
    """DispatchedMXFP4 input (keep_fp4) == bf16 input quantized inside (expert_input_fp4), bit for bit,
    and the gradient goes through the dispatch's anchor to the sender's x."""
    recipe = Recipe.mxfp4()
    x, w1, w2, p, dy = case(COUNTS, seed=3)
    ref = run(x, COUNTS, w1, w2, p, dy, recipe)
    for k, v in run_dispatched(x, COUNTS, w1, w2, p, dy, recipe).items():
        assert torch.equal(v, ref[k]), k


@pytest.mark.parametrize("name", ["fp8", "mxfp4", "mxfp4_dispatched", "mxfp4_no_save_fp4"])
def test_rows_padded_to_128_per_expert_are_the_same_computation(name):
    """row_align=128 (DeepGEMM's layout: zero rows with probability 0 after each expert's rows, taken away after)
    gives the unpadded result bit for bit: output, input, weight and probability gradients."""
    recipe = SAVE_RECIPES.get(name, Recipe.mxfp4())
    go = run_dispatched if name.endswith("dispatched") else run
    counts = [70, 0, 150, 128, 37, 0, 63]  # empty experts, one already a multiple of 128
    x, w1, w2, p, dy = case(counts, seed=6)
    want = go(x, counts, w1, w2, p, dy, recipe, row_align=1)
    got = go(x, counts, w1, w2, p, dy, recipe, row_align=128)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_saved_bytes_with_padded_rows():
    """Under row_align the experts save their formats' bytes for the padded counts (the row map, int64 [T] and
    [Tp], rides on the autograd context, not among the saved tensors)."""
    from fp4moe.ops.grouped_experts import padded_rows
    from fp4moe_kernels.formats import Segments

    padded = list(padded_rows(Segments(tuple(COUNTS)), 128, torch.device("cpu")).padded.counts)
    for name in ("fp8", "mxfp4"):
        x, w1, w2, p, _ = case(COUNTS, seed=4)
        xx, a, b = x.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
        nbytes, _ = count_saved(lambda: grouped_expert_mlp(xx, COUNTS, a, b, p, Recipe.preset(name), row_align=128),
                                [a, b])
        assert nbytes == expert_saved_bytes(padded, H, F, Recipe.preset(name)), name


def test_padded_rows_map():
    from fp4moe.ops.grouped_experts import padded_rows
    from fp4moe_kernels.formats import Segments

    rp = padded_rows(Segments((3, 0, 130, 128)), 128, torch.device("cpu"))
    assert rp.padded.counts == (128, 0, 256, 128)
    assert rp.dst.tolist() == [0, 1, 2, *range(128, 258), *range(384, 512)]
    assert rp.pad.tolist() == [*range(3, 128), *range(258, 384)]
    x = torch.arange(1, 262, dtype=torch.float32).unsqueeze(1).repeat(1, 2)
    xp = rp.rows(x)
    assert torch.equal(xp[rp.dst], x) and not xp[rp.pad].any() and torch.equal(rp.unpad(xp), x)


def test_no_tokens_at_all():
    counts = [0, 0, 0]
    x, w1, w2, p, dy = case(counts)
    for name in ("bf16", "fp8", "mxfp4"):
        got = run(x, counts, w1, w2, p, dy, Recipe.preset(name))
        assert got["y"].shape == (0, H) and got["dx"].shape == (0, H)
        assert not got["dw1"].any() and not got["dw2"].any()



# ------------------------------------------------------------------------- weights as [E, N, K] or as E [N, K]


def run_routed(x, counts, w1, w2, p, dy, recipe, *, stacked=True, recompute=False, dispatched=False, **kw):
    """``routed_experts`` forward and backward with the weights as one ``[E, N, K]`` leaf each (``stacked``) or as E
    ``[N, K]`` leaves each (a megatron SequentialMLP's parameters; their gradients stacked here for comparison)."""
    from fp4moe.moe.experts import routed_experts

    xx, pp = x.clone().requires_grad_(), p.clone().requires_grad_()
    if stacked:
        a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    else:
        a, b = [w.clone().requires_grad_() for w in w1], [w.clone().requires_grad_() for w in w2]
    xin = quantized_all_to_all(xx, [x.shape[0]], [x.shape[0]], keep_fp4=True) if dispatched else xx
    y = routed_experts(xin, counts, a, b, pp, recipe, recompute=recompute, **kw)
    y.backward(dy)
    dw1, dw2 = (a.grad, b.grad) if stacked else (torch.stack([w.grad for w in a]), torch.stack([w.grad for w in b]))
    return dict(y=y.detach(), dx=xx.grad, dw1=dw1, dw2=dw2, dp=pp.grad)


@pytest.mark.parametrize("row_align", [1, 128])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("name", ["bf16", "fp8", "mxfp4", "mxfp4_dispatched", "mxfp4_no_save_fp4", "mxfp4_act_only"])
def test_stacked_weights_equal_per_expert_weights(name, recompute, row_align):
    """Weights as one [E, N, K] tensor each (the standalone MoELayer) or as E [N, K] tensors each (the megatron
    adapter): output, input, probability and weight gradients bit for bit the same, with and without the experts'
    recompute, a dispatched MXFP4 input, and rows padded to 128 per expert."""
    recipe = SAVE_RECIPES.get(name, Recipe.mxfp4())
    x, w1, w2, p, dy = case(COUNTS, seed=7)
    kw = dict(recompute=recompute, dispatched=name.endswith("dispatched"), row_align=row_align)
    got = run_routed(x, COUNTS, w1, w2, p, dy, recipe, stacked=True, **kw)
    want = run_routed(x, COUNTS, w1, w2, p, dy, recipe, stacked=False, **kw)
    assert got["dw1"].shape == w1.shape and got["dw2"].shape == w2.shape
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _weight_sized_stacks(trace_file, shapes, e_num) -> list:
    """The aten::stack / aten::cat ops of a chrome trace whose output has one of ``shapes`` ([E, N, K]) or whose
    inputs are E tensors of one expert's ``[N, K]`` (the output shape from the traced TensorList dims)."""
    import json

    found = []
    for ev in json.load(open(trace_file))["traceEvents"]:
        if ev.get("name") not in ("aten::stack", "aten::cat"):
            continue
        dims, conc = ev["args"]["Input Dims"], ev["args"]["Concrete Inputs"]
        parts = dims[0]
        if not parts:
            continue
        d = int(conc[1]) if len(conc) > 1 and conc[1] not in ("", None) else 0
        first = list(parts[0])
        if ev["name"] == "aten::stack":
            d %= len(first) + 1
            out = first[:d] + [len(parts)] + first[d:]
        else:
            d %= max(len(first), 1)
            out = first[:d] + [sum(q[d] for q in parts if q)] + first[d + 1:]
        per_expert = len(parts) == e_num and any(all(list(q) == list(s[1:]) for q in parts) for s in shapes)
        if tuple(out) in shapes or per_expert:
            found.append((ev["name"], parts))
    return found


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("name", ["bf16", "fp8", "mxfp4"])
def test_stacked_weight_gradients_are_not_stacked_again(name, recompute, tmp_path):
    """[E, N, K] weights enter the autograd Functions whole and get their [E, N, K] gradients as the wgrad makes
    them: the backward runs no aten::stack / aten::cat of the weight gradients (what autograd's UnbindBackward of
    per-expert views did, a full copy of both weight gradients every backward)."""
    from fp4moe.moe.experts import routed_experts

    recipe = Recipe.preset(name)
    x, w1, w2, p, dy = case(COUNTS, seed=8)
    xx, a, b, pp = (t.clone().requires_grad_() for t in (x, w1, w2, p))
    y = routed_experts(xx, COUNTS, a, b, pp, recipe, recompute=recompute)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        y.backward(dy)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    assert _weight_sized_stacks(tmp_path / "trace.json", {tuple(w1.shape), tuple(w2.shape)}, len(COUNTS)) == []
    assert a.grad.shape == w1.shape and b.grad.shape == w2.shape

# ------------------------------------------------------------------------------------------- saved bytes


count_saved = saved_bytes_during  # bytes autograd saved, storages of `exclude` left out


SAVE_RECIPES = {
    "bf16": Recipe.bf16(),
    "fp8": Recipe.fp8(),
    "mxfp4": Recipe.mxfp4(),
    "mxfp4_no_save_fp4": Recipe(name="mxfp4", dispatch_fp4=True, expert_input_fp4=True, activation_fp4_store=True),
    "mxfp4_act_only": Recipe(name="mxfp4", activation_fp4_store=True),
}


@pytest.mark.parametrize("name", list(SAVE_RECIPES))
def test_saved_bytes_match_the_saved_tensors(name):
    recipe = SAVE_RECIPES[name]
    x, w1, w2, p, _ = case(COUNTS, seed=4)
    xx, a, b = x.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
    nbytes, y = count_saved(lambda: grouped_expert_mlp(xx, COUNTS, a, b, p, recipe), [a, b])
    want = expert_saved_bytes(COUNTS, H, F, recipe)
    assert nbytes == want == y.grad_fn.saved_activation_bytes, (name, nbytes, want)


def test_saved_bytes_by_hand_and_deepseek_like_ratio():
    counts = [128] * 8  # H=256, F=128, 8 experts, 1024 tokens: per token bytes
    t = 1024
    by_hand = {
        "bf16": t * (2 * 256 + 4 * 128 + 2 * 128 + 4),
        "fp8": t * ((256 + 8 + 256 + 8) + 4 * 128 + (128 + 4 + 128 + 4) + 4),  # x row+col, h bf16, z row+col, p
        "mxfp4": t * ((128 + 8) + (128 + 8) + (64 + 4) + 4),  # x, h, z MXFP4, p
    }
    for name, want in by_hand.items():
        assert expert_saved_bytes(counts, 256, 128, Recipe.preset(name)) == want, name
    x, w1, w2, p, _ = case(counts, seed=5)
    got = {}
    for name in ("fp8", "mxfp4"):
        a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        got[name], _ = count_saved(lambda: grouped_expert_mlp(x, counts, a, b, p, Recipe.preset(name)), [a, b])
        assert got[name] == by_hand[name]
    assert got["mxfp4"] <= 0.5 * got["fp8"]  # 344 / 1308 = 0.26 per token


# ---------------------------------------------------------------------------------------------------- GPU

CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _deepgemm_missing() -> str | None:
    from fp4moe_kernels import deepgemm

    return deepgemm.why_unavailable()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with blockwise FP8 GEMMs (sm_90)")
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_gpu_padded_rows_are_the_same_computation(name):
    """On CUDA (grouped Triton GEMMs) rows padded to 128 per expert give the unpadded result bit for bit."""
    from fp4moe_kernels import switches

    x, w1, w2, p, dy = (t.cuda() for t in case(COUNTS, seed=2))
    with switches.use(switches.Switches(grouped_gemm="triton")):
        want = run(x, COUNTS, w1, w2, p, dy, Recipe.preset(name), row_align=1)
        got = run(x, COUNTS, w1, w2, p, dy, Recipe.preset(name), row_align=128)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with blockwise FP8 GEMMs (sm_90)")
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_gpu_deepgemm_against_float64_and_triton(name):
    """grouped_gemm=deepgemm (DeepGEMM's m-grouped fprop / dgrad on padded rows, Triton wgrad): the same error
    bounds against float64 as the Triton path (its error is the operands' rounding, not the kernel's), within the
    sum of both errors of the Triton path's result, and zero weight gradients for empty experts."""
    why = _deepgemm_missing()
    if why:
        pytest.skip(why)
    from fp4moe_kernels import switches

    recipe = Recipe.preset(name)
    x, w1, w2, p, dy = case(COUNTS, seed=1)
    dev = torch.device("cuda")
    xs = [t.to(dev) for t in (x, w1, w2, p, dy)]
    with switches.use(switches.Switches(grouped_gemm="deepgemm")):
        got = {k: v.cpu() for k, v in run(*xs[:1], COUNTS, *xs[1:], recipe).items()}
    with switches.use(switches.Switches(grouped_gemm="triton")):
        tri = {k: v.cpu() for k, v in run(*xs[:1], COUNTS, *xs[1:], recipe).items()}
    ref = model(x, COUNTS, w1, w2, p, dy, {})
    for k in ref:
        assert rel(got[k], tri[k].to(F64)) <= rel(got[k], ref[k]) + rel(tri[k], ref[k]) + 1e-9, k
    for e, c in enumerate(COUNTS):
        if c == 0:
            assert not got["dw1"][e].any() and not got["dw2"][e].any()
    check_error_model(got, ref, model(x, COUNTS, w1, w2, p, dy, error_model(recipe)), f"GPU deepgemm {name}", hi=1.4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with blockwise FP8 GEMMs (sm_90)")
def test_gpu_deepgemm_gemm_equals_an_fp32_product_of_the_dequantized_operands():
    """fp4moe_kernels.deepgemm.m_grouped_rows on row-aligned segments (one empty expert) against the FP32 product
    of the dequantized operands, per expert, and against the grouped Triton kernel; padding rows come out zero."""
    why = _deepgemm_missing()
    if why:
        pytest.skip(why)
    from fp4moe_kernels import convert as kops, deepgemm
    from fp4moe_kernels.formats import Segments
    from fp4moe_kernels.triton_kernels import launchers
    from fp4moe.ops.grouped_experts import quantize_experts_128x128

    g = torch.Generator(device="cuda").manual_seed(0)
    seg = Segments((256, 0, 128, 384))
    k, n = 512, 256
    x = torch.randn(seg.total, k, device="cuda", generator=g).to(torch.bfloat16)
    x[128 + 100:256] = 0  # expert 0's padding rows, as grouped_expert_mlp writes them
    w = (torch.randn(seg.num, n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    row = kops.bf16_to_fp8_row(x, seg)
    wd, ws = quantize_experts_128x128(w)
    out = deepgemm.m_grouped_rows(row, wd, ws)
    tri = launchers.grouped_fp8_rows(row, wd, ws)
    assert not out[128 + 100:256].any()
    for e, (r0, r1) in enumerate(zip(seg.offsets[:-1], seg.offsets[1:])):
        if r1 == r0:
            continue
        a, sa = row.segment(e)
        xa = a.float() * sa.repeat_interleave(128, 1)
        wb = wd[e].float() * ws[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
        ref = xa @ wb.t()
        assert rel(out[r0:r1], ref) < 4e-3, e  # the BF16 output's rounding (~1.7e-3 measured)
        assert rel(out[r0:r1], tri[r0:r1].float()) < 4e-3, e


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with blockwise FP8 GEMMs (sm_90)")
@pytest.mark.parametrize("name", ["bf16", "fp8", "mxfp4"])
def test_gpu_against_float64(name):
    """The CUDA path (Triton kernels, F.scaled_mm per expert, ragged counts with empty experts and rows not
    multiples of 16) against float64: the same error bounds as the CPU emulation, widened to 1.4x the
    prediction above because Hopper accumulates each 128-wide K chunk of an FP8 GEMM in reduced precision.
    Saved bytes are the formats' bytes there too."""
    recipe = Recipe.preset(name)
    x, w1, w2, p, dy = case(COUNTS, seed=1)
    dev = torch.device("cuda")
    xx, a, b, pp = (t.to(dev).requires_grad_() for t in (x, w1, w2, p))
    nbytes, y = count_saved(lambda: grouped_expert_mlp(xx, COUNTS, a, b, pp, recipe), [a, b])
    assert nbytes == expert_saved_bytes(COUNTS, H, F, recipe)
    y.backward(dy.to(dev))
    got = {k: v.detach().cpu() for k, v in dict(y=y, dx=xx.grad, dw1=a.grad, dw2=b.grad, dp=pp.grad).items()}
    for e, c in enumerate(COUNTS):
        if c == 0:
            assert not got["dw1"][e].any() and not got["dw2"][e].any()
    ref = model(x, COUNTS, w1, w2, p, dy, {})
    if name == "bf16":
        for k in ref:
            assert rel(got[k], ref[k]) < 4e-3, (k, rel(got[k], ref[k]))
        return
    check_error_model(got, ref, model(x, COUNTS, w1, w2, p, dy, error_model(recipe)), f"GPU {name}", hi=1.4)


# ---------------------------------------------------------------------------------- gradient-accumulation fusion


def _fused_run(x, counts, w1, w2, p, dy, recipe, grads, *, stacked, recompute, zero_out=False, dtype=torch.float32):
    """``routed_experts`` with the weights marked for fusion and given main_grad views into one buffer holding
    ``grads`` (dW1, dW2 as ``[E, N, K]``), as megatron DDP sets them up: in reverse order, ``grad_added_to_main_grad``
    False. Returns (main gradients after the backward as ``[E, N, K]`` float64, the weights)."""
    from fp4moe.moe.experts import routed_experts
    from fp4moe.ops.grouped_experts import fuse_wgrad_accumulation

    sizes = [grads[0].numel(), grads[1].numel()]
    buf = torch.zeros(sum(sizes) + 64, dtype=dtype, device=x.device)
    mg1 = buf[sizes[1] + 64:].view(grads[0].shape)   # fc2 first: DDP's buffer holds the parameters backwards
    mg2 = buf[:sizes[1]].view(grads[1].shape)
    mg1.copy_(grads[0]), mg2.copy_(grads[1])
    if stacked:
        a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        pairs = [(a, mg1), (b, mg2)]
    else:
        a, b = [w.clone().requires_grad_() for w in w1], [w.clone().requires_grad_() for w in w2]
        pairs = [*zip(a, mg1.unbind(0)), *zip(b, mg2.unbind(0))]
    for w, mg in pairs:
        w.main_grad, w.grad_added_to_main_grad, w.zero_out_wgrad = mg, False, zero_out
    fuse_wgrad_accumulation([w for w, _ in pairs])
    xx, pp = x.clone().requires_grad_(), p.clone().requires_grad_()
    routed_experts(xx, counts, a, b, pp, recipe, recompute=recompute).backward(dy)
    return (mg1.double().clone(), mg2.double().clone()), [w for w, _ in pairs]


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("name", ["bf16", "fp8", "mxfp4"])
def test_wgrad_accumulation_fusion_adds_into_main_grad(name, recompute, stacked):
    """Weights marked for fusion with DDP's main_grad: the backward adds the FP32 weight gradient into main_grad (from
    zero: the gradient; from earlier values: those plus it, bit for bit), whose BF16 rounding is the unfused
    gradient (fp8 / mxfp4: bit for bit; bf16: the BF16 product itself); each weight's grad_added_to_main_grad is
    set, and what autograd receives is DDP's to drop (zeros under zero_out_wgrad), with and without the experts'
    recompute."""
    recipe = SAVE_RECIPES.get(name, Recipe.mxfp4())
    x, w1, w2, p, dy = case(COUNTS, seed=9)
    want = run_routed(x, COUNTS, w1, w2, p, dy, recipe, stacked=True, recompute=recompute)
    zeros = (torch.zeros(w1.shape), torch.zeros(w2.shape))
    (g1, g2), ws = _fused_run(x, COUNTS, w1, w2, p, dy, recipe, zeros, stacked=stacked, recompute=recompute)
    assert torch.equal(g1.to(torch.bfloat16), want["dw1"]) and torch.equal(g2.to(torch.bfloat16), want["dw2"])
    assert all(w.grad_added_to_main_grad for w in ws)
    g = torch.Generator().manual_seed(1)
    earlier = (torch.randn(w1.shape, generator=g), torch.randn(w2.shape, generator=g))
    (h1, h2), ws = _fused_run(x, COUNTS, w1, w2, p, dy, recipe, earlier, stacked=stacked, recompute=recompute,
                              zero_out=True)
    assert torch.equal(h1, (earlier[0] + g1.float()).double()) and torch.equal(h2, (earlier[1] + g2.float()).double())
    assert all(not w.grad.any() for w in ws)   # zero_out_wgrad: the stand-in is zeros


def test_wgrad_accumulation_fusion_into_bf16_main_grads_and_not_without_ddp():
    """BF16 main gradients (the precision-aware optimizer's): the FP32 sum rounded once; weights without DDP's
    attributes keep the unfused gradient even when marked."""
    from fp4moe.ops.grouped_experts import fuse_wgrad_accumulation

    recipe = Recipe.mxfp4()
    x, w1, w2, p, dy = case(COUNTS, seed=9)
    zeros = (torch.zeros(w1.shape), torch.zeros(w2.shape))
    (g1, _), _ = _fused_run(x, COUNTS, w1, w2, p, dy, recipe, zeros, stacked=False, recompute=False)
    g = torch.Generator().manual_seed(2)
    earlier = tuple(torch.randn(w.shape, generator=g).bfloat16().float() for w in (w1, w2))
    (h1, _), _ = _fused_run(x, COUNTS, w1, w2, p, dy, recipe, earlier, stacked=False, recompute=False,
                            dtype=torch.bfloat16)
    assert torch.equal(h1, (earlier[0] + g1.float()).bfloat16().double())
    a, b = [w.clone().requires_grad_() for w in w1], [w.clone().requires_grad_() for w in w2]
    fuse_wgrad_accumulation([*a, *b])
    grouped_expert_mlp(x.clone().requires_grad_(), COUNTS, a, b, p.clone().requires_grad_(), recipe).backward(dy)
    want = run_routed(x, COUNTS, w1, w2, p, dy, recipe, stacked=True)
    assert torch.equal(torch.stack([w.grad for w in a]), want["dw1"])


class _ConversionCalls:
    """Counts the calls of the conversions that only a backward reads (FP8 column copies, the fused MXFP4 + FP8 row
    quantizer whose MXFP4 output is saved, the SwiGLU that writes h's MXFP4 copy) while the real ones run."""

    NAMES = ("bf16_to_fp8_col", "bf16_to_fp4_and_fp8_row")

    def __init__(self, monkeypatch):
        import fp4moe.ops.grouped_experts as ge
        from fp4moe_kernels import convert

        self.n = {name: 0 for name in (*self.NAMES, "swiglu_math_fp4")}
        for mod, name in [(convert, n) for n in self.NAMES] + [(ge, "swiglu_math_fp4")]:
            real = getattr(mod, name)
            monkeypatch.setattr(mod, name, self._counted(name, real))

    def _counted(self, name, real):
        def call(*a, **k):
            self.n[name] += 1
            return real(*a, **k)
        return call

    def take(self) -> dict:
        out, self.n = self.n, {k: 0 for k in self.n}
        return out


@pytest.mark.parametrize("name", ["fp8", "mxfp4", "mxfp4_no_save_fp4", "mxfp4_act_only"])
def test_forward_without_backward_makes_no_backward_operands(name, monkeypatch):
    """Under ``torch.no_grad`` (the first forward of a recomputed block, ``_ExpertRecompute``'s forward) the weights
    still say requires_grad, but no backward follows: no FP8 column copy, no MXFP4 copy to save is made, and the
    output is the same bits as with grad mode on, where they are made."""
    recipe = SAVE_RECIPES.get(name, Recipe.mxfp4())
    x, w1, w2, p, _ = case(COUNTS, seed=8)
    a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    calls = _ConversionCalls(monkeypatch)
    y_grad = grouped_expert_mlp(x, COUNTS, a, b, p, recipe)
    with_grad = calls.take()
    with torch.no_grad():
        y_none = grouped_expert_mlp(x, COUNTS, a, b, p, recipe)
    without = calls.take()
    assert torch.equal(y_grad.detach().view(torch.int16), y_none.view(torch.int16))
    assert sum(with_grad.values()) > 0, with_grad  # the spies see the grad-mode forward make them
    assert without == {k: 0 for k in without}, without
    if recipe.name == "fp8":
        assert with_grad["bf16_to_fp8_col"] == 2  # x's and z's column copies, for fc1's and fc2's wgrad
    if recipe.activation_fp4_store:
        assert with_grad["swiglu_math_fp4"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with blockwise FP8 GEMMs (sm_90)")
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_wgrad_loop_equals_the_grouped_wgrad(name, fused):
    """``wgrad_gemm=loop`` (one cuBLAS GEMM per expert) under the grouped Triton fprop / dgrad: y, dx and dprobs the
    same bits as the grouped wgrad's run (the wgrad feeds nothing else), the weight gradients within the FP32
    accumulation order's difference of them (both sum the same FP8 products), zero for empty experts; also added
    into main gradients (``fuse_wgrad_accumulation``)."""
    from fp4moe_kernels import switches
    from fp4moe.ops.grouped_experts import fuse_wgrad_accumulation

    recipe = Recipe.preset(name)
    x, w1, w2, p, dy = (t.cuda() for t in case(COUNTS, seed=3))
    out = {}
    for wg in ("triton", "loop"):
        with switches.use(switches.Switches(grouped_gemm="triton", wgrad_gemm=wg)):
            if not fused:
                out[wg] = run(x, COUNTS, w1, w2, p, dy, recipe)
                continue
            a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
            for t in (a, b):
                t.main_grad = torch.ones(t.shape, dtype=torch.float32, device="cuda")
                t.grad_added_to_main_grad = False
            fuse_wgrad_accumulation([a, b])
            try:
                grouped_expert_mlp(x, COUNTS, a, b, p, recipe).backward(dy)
            finally:
                fuse_wgrad_accumulation([a, b], enabled=False)
            assert a.grad_added_to_main_grad and b.grad_added_to_main_grad
            out[wg] = dict(dw1=a.main_grad - 1, dw2=b.main_grad - 1)
    for k, want in out["triton"].items():
        got = out["loop"][k]
        if k in ("dw1", "dw2"):
            assert rel(got.float().cpu(), want.to(F64).cpu()) < 2e-3, k  # BF16 rounding of either side, or FP32 order
            for e, c in enumerate(COUNTS):
                if c == 0:
                    assert not got[e].any(), (k, e)
        else:
            assert torch.equal(got, want), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stacked", [False, True])
def test_gpu_bf16_experts_fused_wgrad_matches_the_unfused_gradient(stacked):
    """The bf16 recipe's routed experts on CUDA with fused weights: every weight's main gradient (FP32, from earlier
    values) grows by the unfused BF16 gradient to within its rounding, empty experts' not at all, and
    grad_added_to_main_grad is set."""
    recipe = Recipe.preset("bf16")
    x, w1, w2, p, dy = (t.cuda() for t in case(COUNTS, seed=4))
    want = run(x, COUNTS, w1, w2, p, dy, recipe)
    g = torch.Generator().manual_seed(6)
    earlier = (torch.randn(w1.shape, generator=g).cuda(), torch.randn(w2.shape, generator=g).cuda())
    (g1, g2), ws = _fused_run(x, COUNTS, w1, w2, p, dy, recipe, earlier, stacked=stacked, recompute=False)
    assert all(w.grad_added_to_main_grad for w in ws)
    got = {"dw1": g1 - earlier[0].double(), "dw2": g2 - earlier[1].double()}   # what the backward added
    for k in ("dw1", "dw2"):
        assert rel(got[k].cpu(), want[k].to(F64).cpu()) < 2e-3, k
        for e, c in enumerate(COUNTS):
            if c == 0:
                assert not got[k][e].any(), (k, e)


def _row_col_devices():
    return [pytest.param("cpu", id="cpu"),
            pytest.param("cuda", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
                not CUDA, reason="needs a CUDA GPU with blockwise FP8 GEMMs (sm_90)")])]


@pytest.mark.parametrize("device", _row_col_devices())
@pytest.mark.parametrize("name", ["fp8", "mxfp4", "mxfp4_no_save_fp4"])
def test_fp8_row_col_switch_changes_no_bit(name, device, monkeypatch):
    """``fp8_row_col=1``: every operand whose FP8 rows and columns both go to GEMMs (fp8: x and z forward, dY and dH
    backward; mxfp4: dY and dH) takes both from one ``bf16_to_fp8_row_col`` call; outputs and gradients are the
    same bits as with the two kernels (on a GPU: the Triton kernels; on the CPU: the reference)."""
    from fp4moe_kernels import convert, switches

    recipe = SAVE_RECIPES.get(name, Recipe.mxfp4())
    x, w1, w2, p, dy = (t.to(device) for t in case(COUNTS, seed=11))
    fused = []
    real = convert.bf16_to_fp8_row_col
    monkeypatch.setattr(convert, "bf16_to_fp8_row_col", lambda *a, **k: fused.append(1) or real(*a, **k))
    got = {}
    for value in ("0", "1"):
        with switches.use(switches.Switches(fp8_row_col=value)):
            got[value] = run(x, COUNTS, w1, w2, p, dy, recipe)
        if value == "0":
            assert not fused
    # fp8: x, z, dY, dH; mxfp4 (MXFP4 x and z saved): dY, dH; without save_fp4: z too (x arrives MXFP4)
    assert len(fused) == {"fp8": 4, "mxfp4": 2, "mxfp4_no_save_fp4": 3}[name], len(fused)
    for k, want in got["0"].items():
        assert torch.equal(got["1"][k].view(torch.int16) if got["1"][k].dtype == torch.bfloat16 else got["1"][k],
                           want.view(torch.int16) if want.dtype == torch.bfloat16 else want), k


def _kernels_on_cpu(monkeypatch):
    """Let the SwiGLU's Triton kernels (and the one that writes FP8 copies) run on CPU tensors, as they do on CUDA
    ones (here under the Triton interpreter): every ``is_cuda`` gate of fp4moe.ops.swiglu read as true."""
    import importlib

    import fp4moe.ops.grouped_experts as ge
    from fp4moe_kernels import switches

    sw = importlib.import_module("fp4moe.ops.swiglu")  # the module (fp4moe.ops exports a function of that name)

    def fused(h):
        return h.dtype == torch.bfloat16 and switches.current().fused_swiglu == "1"

    def fp4_on(is_cuda, f, real=sw._fp4_switch_on):
        return real(True, f)

    def fp8_on(is_cuda, f, real=sw.fused_fp8_enabled):
        return real(True, f)

    monkeypatch.setattr(sw, "fused_enabled", fused)
    monkeypatch.setattr(sw, "_fp4_switch_on", fp4_on)
    monkeypatch.setattr(ge, "fused_fp8_enabled", fp8_on)


@pytest.mark.parametrize("device", _row_col_devices())
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_fused_swiglu_fp8_switch_changes_no_bit(name, device, monkeypatch):
    """``fused_swiglu_fp8=1``: the experts' SwiGLU writes fc2's FP8 rows and columns of z (fp8) and fc1's of dH
    (every FP8 recipe; for mxfp4 from h's MXFP4 copy) itself, z / dH never in memory: y, dx and the weight gradients
    the same bits as the fused SwiGLU kernels followed by the quantizers, dprobs within float32 rounding (its sum
    runs in another order), and the fused kernels really ran. On the CPU the Triton kernels run interpreted (the
    test routes fp4moe.ops.swiglu to them as on CUDA)."""
    from fp4moe_kernels import switches
    from fp4moe_kernels.triton_kernels import fused_swiglu

    if device == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            pytest.skip("the CPU variant runs the Triton kernels under TRITON_INTERPRET=1")
        _kernels_on_cpu(monkeypatch)
    recipe = SAVE_RECIPES.get(name, Recipe.mxfp4())
    counts = [70, 0, 150]
    x, w1, w2, p, dy = (t.to(device) for t in case(counts, seed=12, h=128, f=128))
    calls = {"fwd": 0, "bwd": 0}
    for key, fn in (("fwd", "swiglu_fwd_fp8"), ("bwd", "swiglu_bwd_fp8")):
        real = getattr(fused_swiglu, fn)
        monkeypatch.setattr(fused_swiglu, fn, lambda *a, _r=real, _k=key, **k: calls.__setitem__(_k, calls[_k] + 1)
                            or _r(*a, **k))
    got = {}
    for value in ("0", "1"):
        # h's MXFP4 copy by the separate quantizer (the interpreter runs the fused one slowly; the bits are the same)
        with switches.use(switches.Switches(fused_swiglu_fp8=value, fused_swiglu_fp4="0")):
            got[value] = run(x, counts, w1, w2, p, dy, recipe)
        if value == "0":
            assert calls == {"fwd": 0, "bwd": 0}
    # fp8 writes z's copies in the forward; mxfp4 saves z as MXFP4 (its own fused quantizer), its backward decodes h
    assert calls == {"fwd": 1 if name == "fp8" else 0, "bwd": 1}, calls
    for k, want in got["0"].items():
        have = got["1"][k]
        if k == "dp":
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
        else:
            assert torch.equal(have.view(torch.int16), want.view(torch.int16)), k


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with blockwise FP8 GEMMs (sm_90)")
@pytest.mark.parametrize("name,gemm", [("bf16", "triton"), ("fp8", "triton"), ("mxfp4", "triton"),
                                       ("fp8", "deepgemm"), ("mxfp4", "deepgemm")])
def test_gpu_expert_pass_never_waits_for_the_gpu(name, gemm):
    """The routed experts' forward + backward from host counts, wgrads added into main gradients (and rows padded to
    128 per expert under DeepGEMM), makes no synchronizing CUDA call: the host's tables (offsets, counts, padding
    rows) reach the device as queued copies (``host_to_device``). A copy from pageable memory waits for the stream to
    drain and leaves the GPU idle while the host catches up: the fused wgrad's offsets did so, 5.6 ms per iteration
    of DeepSeek-V3's layer on an H100 (results/moe_layer/README.md, the thirty-fourth session)."""
    from fp4moe_kernels import switches

    if gemm == "deepgemm" and _deepgemm_missing():
        pytest.skip(f"DeepGEMM: {_deepgemm_missing()}")
    recipe = Recipe.preset(name)
    x, w1, w2, p, dy = (t.cuda() for t in case(COUNTS, seed=5))
    zeros = (torch.zeros(w1.shape, device="cuda"), torch.zeros(w2.shape, device="cuda"))

    def once():
        _fused_run(x, COUNTS, w1, w2, p, dy, recipe, zeros, stacked=False, recompute=False)
    with switches.use(switches.Switches(grouped_gemm=gemm)):
        once()   # first calls compile and fill the caches
        assert sync_calls(once) == []
    # the check sees a pageable copy (what the offsets were)
    assert sync_calls(lambda: torch.tensor(COUNTS, device="cuda")) != []
