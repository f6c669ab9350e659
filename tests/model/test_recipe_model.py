"""The precision recipe inside megatron-core's GPTModel (fp4moe.model.recipe_moe, gpt_model.py) on CPU/gloo, world
size 1: the MoE layer equals fp4moe's standalone MoELayer on the same weights and routing, bf16 is megatron's
own path, mxfp4 sends MXFP4 bytes and saves less than fp8, parameter names do not depend on the recipe, and
fp4moe's own recompute (layernorm, moe_expert) gives the same loss and gradients while saving less."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("megatron.core")

CONF = Path(__file__).resolve().parents[2] / "conf"
RECIPES = ("bf16", "fp8", "mxfp4")


def _cfg(precision: str | None = "bf16", recompute: str = "none", **model_overrides):
    m = OmegaConf.load(CONF / "model" / "tiny_cpu.yaml")
    for k, v in model_overrides.items():
        OmegaConf.update(m, k, v)
    d = {"model": m, "parallel": OmegaConf.load(CONF / "parallel" / "cpu.yaml"),
         "recompute": OmegaConf.load(CONF / "recompute" / f"{recompute}.yaml")}
    if precision is not None:
        d["precision"] = OmegaConf.load(CONF / "precision" / f"{precision}.yaml")
    return OmegaConf.create(d)


def _model(precision, recompute="none", **overrides):
    """bf16-parameter GPTModel as the trainer builds it (model.bfloat16(), router expert bias kept fp32)."""
    return _build(_cfg(precision, recompute, **overrides))


def _forward_saved_bytes(m) -> int:
    """Bytes one forward of a fixed batch (2 x 32 tokens) saves for backward, parameters excluded."""
    from fp4moe.ops.accounting import SavedTensorBytes

    with SavedTensorBytes(exclude=list(m.parameters())) as c:
        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
        m(ids, torch.arange(32).unsqueeze(0).expand(2, -1), None, labels=ids).float().mean()
    return c.bytes()


def _build(cfg):
    from fp4moe.model.gpt_model import build_gpt_model, to_bf16_params

    torch.manual_seed(0)
    return to_bf16_params(build_gpt_model(cfg, params_dtype=torch.bfloat16))


def _loss_and_grads(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.vocab_size, (2, 32), generator=g)
    labels = torch.randint(0, model.vocab_size, (2, 32), generator=g)
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)
    model.zero_grad(set_to_none=True)
    loss = model(ids, pos, None, labels=labels).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _standalone_from(moe, recipe):
    """fp4moe.moe.MoELayer with the megatron MoE layer's weights (router, experts, shared expert)."""
    from fp4moe.moe.layer import MoELayer as Standalone

    c = moe.config
    ref = Standalone(c.hidden_size, c.moe_ffn_hidden_size, c.num_moe_experts, c.moe_router_topk, recipe,
                     shared_ffn=c.moe_shared_expert_intermediate_size, score="sigmoid")
    with torch.no_grad():
        ref.router.copy_(moe.router.weight.float())
        ref.w1.copy_(torch.stack([e.linear_fc1.weight for e in moe.experts.local_experts]))
        ref.w2.copy_(torch.stack([e.linear_fc2.weight for e in moe.experts.local_experts]))
        ref.shared_w1.copy_(moe.shared_experts.linear_fc1.weight)
        ref.shared_w2.copy_(moe.shared_experts.linear_fc2.weight)
    return ref


def _layer_input_and_grad(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, dL/dy) for one MoE layer of tiny_cpu: two [s=16, b=2, H=256] bf16 tensors drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(16, 2, 256, generator=g).to(torch.bfloat16) for _ in range(2))


def _moe_run(moe, x, gy):
    x = x.clone().requires_grad_(True)
    out = moe(x)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(gy)
    return y.detach(), x.grad


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# Tolerances (relative L2) of the megatron MoE layer vs the standalone layer. fp8 / mxfp4: the same ops in the
# same order, so exact. bf16: megatron's SequentialMLP rounds silu(g)*u to bf16 before the prob multiply and
# unpermute sums in bf16, the standalone does both in float32 (one rounding): a few bf16 ulps.
TOL = {"bf16": 1e-2, "fp8": 0.0, "mxfp4": 0.0}


@pytest.mark.parametrize("precision", RECIPES)
def test_moe_layer_matches_standalone(mp, precision):
    from fp4moe.recipe import Recipe

    model = _model(precision, **{"moe.aux_loss_coeff": 0.0})
    moe = model.decoder.layers[1].mlp
    recipe = Recipe.from_config(_cfg(precision).precision)
    ref = _standalone_from(moe, recipe)
    x, gy = _layer_input_and_grad(3)
    y, dx = _moe_run(moe, x, gy)
    y_ref, dx_ref = _moe_run(ref, x, gy)
    assert _rel(y, y_ref) <= TOL[precision], (precision, _rel(y, y_ref))
    # dx also carries the router path (megatron's top-k / normalisation code, float32 op order differs)
    assert _rel(dx, dx_ref) <= 1e-2, (precision, _rel(dx, dx_ref))
    dw1 = torch.stack([e.linear_fc1.weight.grad for e in moe.experts.local_experts])
    dw2 = torch.stack([e.linear_fc2.weight.grad for e in moe.experts.local_experts])
    assert _rel(dw1, ref.w1.grad) <= TOL[precision] and _rel(dw2, ref.w2.grad) <= TOL[precision]
    assert _rel(moe.shared_experts.linear_fc1.weight.grad, ref.shared_w1.grad) <= TOL[precision]
    # the router weight gradient goes through megatron's own top-k/normalisation code: float32 op order differs
    assert _rel(moe.router.weight.grad.float(), ref.router.grad) < 2e-2


def test_bf16_recipe_is_megatron_path(mp):
    """precision bf16 builds megatron's own MoE modules: bit-identical to a build without a precision group."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    a, b = _model("bf16"), _model(None)
    moe = a.decoder.layers[1].mlp
    assert type(moe) is MoELayer and type(moe.experts) is SequentialMLP
    assert type(moe.token_dispatcher) is MoEAlltoAllTokenDispatcher
    la, ga = _loss_and_grads(a)
    lb, gb = _loss_and_grads(b)
    assert torch.equal(la, lb)
    assert all(torch.equal(ga[n], gb[n]) for n in ga)


def test_bf16_moe_switch_builds_fp4moe_layers(mp):
    """kernels.bf16_moe=fp4moe: bf16 gets fp4moe's MoE layer (the BF16 grouped expert path), equal to the standalone
    layer bit for bit and to megatron's bf16 path within bf16 rounding (TOL); moe_expert recompute on it gives the
    same loss and gradients; the default switch keeps megatron's modules."""
    from fp4moe_kernels.switches import Switches, use
    from megatron.core.transformer.moe.experts import SequentialMLP

    from fp4moe.model.gpt_model import check_built_from_spec
    from fp4moe.model.recipe_moe import RecipeGroupedMLP, RecipeMoELayer
    from fp4moe.recipe import Recipe

    over = {"moe.aux_loss_coeff": 0.0}
    megatron = _model("bf16", **over)
    with use(Switches(bf16_moe="fp4moe")):
        ours = _model("bf16", **over)
        ours_rc = _model("bf16", "attn_ln_experts", **over)
        check_built_from_spec(ours, Recipe.bf16())
        with pytest.raises(Exception, match="not built from the spec"):
            check_built_from_spec(megatron, Recipe.bf16())
    moe = ours.decoder.layers[1].mlp
    assert type(moe) is RecipeMoELayer and type(moe.experts) is RecipeGroupedMLP
    assert type(megatron.decoder.layers[1].mlp.experts) is SequentialMLP
    ref = _standalone_from(moe, Recipe.bf16())
    x, gy = _layer_input_and_grad(3)
    y, dx = _moe_run(moe, x, gy)
    y_ref, _ = _moe_run(ref, x, gy)
    assert torch.equal(y, y_ref)
    assert _rel(torch.stack([e.linear_fc1.weight.grad for e in moe.experts.local_experts]), ref.w1.grad) == 0.0
    # the whole model: same weights (same seed, same parameter names), megatron's path within bf16 rounding
    sd_o, sd_m = ours.state_dict(), megatron.state_dict()
    assert list(sd_o) == list(sd_m)
    assert all(torch.equal(sd_o[k], sd_m[k]) for k in sd_o if isinstance(sd_o[k], torch.Tensor))
    lo, go = _loss_and_grads(ours)
    lm, gm = _loss_and_grads(megatron)
    assert abs(lo.item() - lm.item()) <= 1e-3 * abs(lm.item())
    far = {n: _rel(go[n], gm[n]) for n in go if _rel(go[n], gm[n]) > TOL["bf16"] * 2}
    assert not far, far
    lr, gr = _loss_and_grads(ours_rc)
    assert torch.equal(lr, lo) and all(torch.equal(gr[n], go[n]) for n in go)


def test_parameter_names_identical_across_recipes(mp):
    models = {p: _model(p) for p in RECIPES}
    shapes = {p: {k: getattr(v, "shape", None) for k, v in m.state_dict().items()} for p, m in models.items()}
    names = {p: [n for n, _ in m.named_parameters()] for p, m in models.items()}
    assert shapes["bf16"] == shapes["fp8"] == shapes["mxfp4"]
    assert names["bf16"] == names["fp8"] == names["mxfp4"]
    assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight" in shapes["mxfp4"]
    # weights load across recipes (checkpoint interop); the grouped experts take the parameters themselves
    models["mxfp4"].load_state_dict(models["bf16"].state_dict())
    experts = models["mxfp4"].decoder.layers[1].mlp.experts
    w1, w2 = experts.grouped_weights()
    assert [tuple(w.shape) for w in w1] == [(256, 256)] * 8 and [tuple(w.shape) for w in w2] == [(256, 128)] * 8
    assert all(a is e.linear_fc1.weight and b is e.linear_fc2.weight for a, b, e in zip(w1, w2, experts.local_experts))
    assert torch.equal(w1[3], models["bf16"].decoder.layers[1].mlp.experts.local_experts[3].linear_fc1.weight)


def test_mxfp4_sends_fp4_bytes_and_saves_less(mp):
    from fp4moe.ops.accounting import SavedTensorBytes
    from fp4moe.ops.all_to_all import a2a_payload_bytes

    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 2, 256, generator=g).to(torch.bfloat16)
    saved, stats = {}, {}
    for p in ("fp8", "mxfp4"):
        moe = _model(p).decoder.layers[1].mlp
        with SavedTensorBytes(exclude=list(moe.parameters())) as c:
            y, _ = moe(x.clone().requires_grad_(True))
        saved[p] = c.bytes()
        y.float().sum().backward()
        stats[p] = moe.a2a_stats()
    rows = 16 * 2 * 2  # tokens x top-k
    assert stats["mxfp4"]["dispatch_forward_sent_bytes"] == a2a_payload_bytes(rows, 256, "mxfp4") == rows * (128 + 8)
    assert stats["fp8"]["dispatch_forward_sent_bytes"] == a2a_payload_bytes(rows, 256, "bf16")
    for p in ("fp8", "mxfp4"):  # combine forward and both backward all-to-alls stay BF16 (backward_a2a: bf16)
        assert stats[p]["combine_forward_sent_bytes"] == stats[p]["dispatch_backward_sent_bytes"] == rows * 512
    assert saved["mxfp4"] < 0.75 * saved["fp8"], saved


@pytest.mark.parametrize("recompute", ["none", "attn_ln_experts", "full"])
def test_mxfp4_dispatch_quantizes_each_token_once(mp, recompute, monkeypatch):
    """Under dispatch_fp4 the dispatcher quantizes the T tokens once and gathers their k MXFP4 rows
    (FP4MOE_DISPATCH_QUANTIZE=tokens, the default) instead of quantizing the T*k permuted BF16 rows (=rows): the
    same loss, every parameter gradient and the same all-to-all bytes, bit for bit, through the whole model and
    under the recompute scopes that rerun the experts or the whole layer; each dispatch quantizes [T, H], not
    [T*k, H]."""
    from fp4moe_kernels import convert as kops

    real = kops.bf16_to_fp4_row
    runs = {}
    for mode in ("rows", "tokens"):
        monkeypatch.setenv("FP4MOE_DISPATCH_QUANTIZE", mode)
        model = _model("mxfp4", recompute)
        assert all(layer.mlp.token_dispatcher.quantize_tokens == (mode == "tokens")
                   for layer in model.decoder.layers[1:])
        shapes = []
        monkeypatch.setattr(kops, "bf16_to_fp4_row", lambda x, *a, **k: shapes.append(tuple(x.shape)) or real(x, *a, **k))
        loss, grads = _loss_and_grads(model)
        monkeypatch.setattr(kops, "bf16_to_fp4_row", real)
        stats = [layer.mlp.a2a_stats() for layer in model.decoder.layers[1:]]
        runs[mode] = (loss, grads, stats, shapes)
    (la, ga, sa, qa), (lb, gb, sb, qb) = runs["rows"], runs["tokens"]
    assert torch.equal(la, lb) and sa == sb and sa[0]["dispatch_forward_sent_bytes"] == sa[0]["dispatch_forward_calls"] * 128 * 136
    assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga), \
        [n for n in ga if not torch.equal(ga[n], gb[n])]
    rows, tokens = (128, 256), (64, 256)  # T*k = 2 x 32 tokens x top-2 rows, T tokens, H = 256
    dispatches = sum(st["dispatch_forward_calls"] for st in sa)  # one per MoE layer, two under full recompute
    assert dispatches >= len(sa) > 0
    assert qa.count(rows) - qb.count(rows) == dispatches == qb.count(tokens) - qa.count(tokens)


@pytest.mark.parametrize("precision", RECIPES)
def test_recompute_attn_ln_experts(mp, precision):
    """recompute attn_ln_experts (megatron core_attn + fp4moe layernorm + moe_expert) vs none: bitwise for bf16
    and fp8; mxfp4 stores the layernorm cache as MXFP4 (E2M1 rounding of the residual stream in backward):
    same loss, gradients within 8% relative L2 overall (20% for any one parameter). Saved bytes of one forward drop in every recipe."""
    from fp4moe.model.recipe_moe import RecipeGroupedMLP
    from fp4moe.model.recompute import RecomputedSequentialMLP

    base, rec = _model(precision, "none"), _model(precision, "attn_ln_experts")
    experts = rec.decoder.layers[1].mlp.experts
    assert isinstance(experts, RecomputedSequentialMLP if precision == "bf16" else RecipeGroupedMLP)
    assert all(l.recompute_input_layernorm and l.recompute_pre_mlp_layernorm for l in rec.decoder.layers)
    bytes_ = {"none": _forward_saved_bytes(base), "rec": _forward_saved_bytes(rec)}
    assert bytes_["rec"] < bytes_["none"], bytes_
    l0, g0 = _loss_and_grads(base)
    l1, g1 = _loss_and_grads(rec)
    if precision == "mxfp4":
        assert torch.equal(l0, l1)  # the forward is unchanged; only backward reads the MXFP4 cache
        # Grads that read the recomputed norm outputs (norm weights, the BF16 linears and router that consume
        # them) carry the E2M1 rounding of the cached residual stream, ~12% relative per element (the same size
        # of error that save_fp4 puts on every FP8 linear's wgrad); the q/kv projections also read the attention
        # recomputed from MXFP4 q/k/v (up to ~20%); the rest only inherits it through dx.
        names = [n for n in g0 if g0[n].norm() > 0]
        total = _rel(torch.cat([g1[n].float().flatten() for n in names]), torch.cat([g0[n].float().flatten() for n in names]))
        worst = max(_rel(g1[n].float(), g0[n].float()) for n in names)
        assert total < 0.08 and worst < 0.25, (total, worst)
    else:
        assert torch.equal(l0, l1)
        bad = [n for n in g0 if not torch.equal(g0[n], g1[n])]
        assert not bad, bad


@pytest.mark.parametrize("scope", ["attn_ln_experts", "attn_ln_mlp", "mla_up_proj", "attn_block_ln_experts", "full"])
@pytest.mark.parametrize("precision", RECIPES)
def test_evaluation_under_recompute_equals_no_recompute(mp, precision, scope):
    """The trainer's held-out evaluation runs the model under ``torch.no_grad``: every recompute scope gives the
    loss of the model without recompute, bit for bit (nothing is cached, nothing recomputed). Regression: mxfp4's
    routed-expert recompute read the dispatched rows' gradient anchor, which no_grad leaves unset (an H200 run of
    experiment=proxy_t1_conv_1gpu failed at its first evaluation)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 512, (2, 32), generator=g)
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)
    losses = []
    for rec in ("none", scope):
        m = _model(precision, rec)
        with torch.no_grad():
            losses.append(m(ids, pos, None, labels=ids).float().mean())
    assert torch.equal(losses[0], losses[1]), losses


@pytest.mark.parametrize("scope", ["attn_block_ln_experts", "attn_block_ln_mlp"])
@pytest.mark.parametrize("precision", RECIPES)
def test_recompute_whole_attention_block(mp, precision, scope):
    """recompute.fp4moe_modules self_attention (the whole MLA block under a reentrant checkpoint) with the
    layernorms (+ the experts or the dense MLPs) vs none: the same loss; bitwise gradients for bf16 and fp8, mxfp4
    within the E2M1 rounding of its MXFP4 recompute caches (the block input, the norm inputs). The block keeps less
    than core attention alone (attn_ln_*): one forward saves fewer bytes, by at least every layer's q/k/v."""
    from fp4moe.model.recompute import RecomputedMLASelfAttention

    base, rec = _model(precision, "none"), _model(precision, scope)
    core = _model(precision, scope.replace("attn_block_", "attn_"))
    assert all(isinstance(l.self_attention, RecomputedMLASelfAttention) for l in rec.decoder.layers)
    assert not any(isinstance(l.self_attention, RecomputedMLASelfAttention) for l in core.decoder.layers)
    saved = {"none": _forward_saved_bytes(base), "block": _forward_saved_bytes(rec), "core": _forward_saved_bytes(core)}
    c = rec.config
    qkv = 2 * 32 * c.num_attention_heads * (2 * (c.qk_head_dim + c.qk_pos_emb_head_dim) + c.v_head_dim)  # bf16 q, k, v
    assert saved["block"] <= saved["core"] - len(rec.decoder.layers) * qkv // (2 if precision == "mxfp4" else 1), saved
    l0, g0 = _loss_and_grads(base)
    l1, g1 = _loss_and_grads(rec)
    assert torch.equal(l0, l1)
    if precision == "mxfp4":
        # every attention weight's gradient now reads the block re-run from the E2M1-rounded block input (with
        # core attention only the q/kv projections read MXFP4 q/k/v): the same ~20 % worst parameter as
        # test_recompute_attn_ln_experts, a little more overall (on this model: 7.4 / 10.9 % for the block under
        # attn_block_ln_experts / _mlp against 4.4 / 9.1 % with core attention)
        names = [n for n in g0 if g0[n].norm() > 0]
        total = _rel(torch.cat([g1[n].float().flatten() for n in names]), torch.cat([g0[n].float().flatten() for n in names]))
        worst = max(_rel(g1[n].float(), g0[n].float()) for n in names)
        assert total < 0.12 and worst < 0.25, (total, worst)
    else:
        bad = [n for n in g0 if not torch.equal(g0[n], g1[n])]
        assert not bad, bad


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_whole_attention_block_saves_only_its_input(mp, precision):
    """Under attn_block_ln_experts the attention block saves one tensor for backward: its input, the input norm's
    output [s, b, H] BF16 (the storage the layernorm recompute frees after the block and refills before its
    backward); under core attention it also keeps the latents, q, k, v and the attention output."""
    def saved_by_attention(scope):
        m = _model(precision, scope)
        attn, inside, seen = m.decoder.layers[1].self_attention, [False], {}
        attn.register_forward_pre_hook(lambda *a: inside.__setitem__(0, True))
        attn.register_forward_hook(lambda *a: inside.__setitem__(0, False))
        params = {q.untyped_storage().data_ptr() for q in m.parameters()}

        def pack(x):
            ptr = x.untyped_storage().data_ptr()
            if inside[0] and ptr not in params:
                seen[ptr] = (tuple(x.shape), x.dtype)
            return x

        ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            m(ids, torch.arange(32).unsqueeze(0).expand(2, -1), None, labels=ids).float().mean()
        return list(seen.values())

    h = _cfg(precision).model.hidden_size
    assert saved_by_attention("attn_block_ln_experts") == [((32, 2, h), torch.bfloat16)]
    assert len(saved_by_attention("attn_ln_experts")) > 5


def test_whole_attention_block_and_core_attention_are_one_or_the_other():
    from fp4moe.config import ConfigError
    from fp4moe.model.gpt_model import _recompute_kwargs

    r = OmegaConf.load(CONF / "recompute" / "attn_block_ln_experts.yaml")
    r.megatron_modules = ["core_attn"]
    with pytest.raises(ConfigError, match="self_attention .* and recompute.megatron_modules has \\['core_attn'\\], "
                                          "which lie inside it"):
        _recompute_kwargs(r)


def test_all_linears_scope_uses_fp8_for_attention(mp):
    """scope all_linears: the layer spec makes the attention / dense-MLP linears FP8 ones (fp4moe.model.recipe_dense,
    parameter names unchanged): exactly megatron's Column/RowParallelLinear of the decoder and MTP layers outside
    the MoE layers (MLA's projections, the dense MLP, MTP's eh_proj), the two MLA down-projections included; those
    whose dims are not multiples of 128 (tiny_cpu's kv down-projection, 256 -> 160) stay BF16 and are listed."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from fp4moe.model.recipe_dense import FP8ColumnParallelLinear, RecipeMLASelfAttention, fp8_linears

    cfg = _cfg("fp8", mtp_num_layers=1)
    cfg.precision.scope = "all_linears"
    m = _build(cfg)
    assert m.fp4moe_bf16_linears == ["decoder.layers.0.self_attention.linear_kv_down_proj",
                                     "decoder.layers.1.self_attention.linear_kv_down_proj",
                                     "mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj"]
    moe = [n + "." for n, x in m.named_modules() if isinstance(x, MoELayer)]
    dense = [n for n, x in m.named_modules() if isinstance(x, (ColumnParallelLinear, RowParallelLinear))
             and ".layers." in f".{n}" and not any(n.startswith(p) for p in moe)]
    assert "mtp.layers.0.eh_proj" in dense and "decoder.layers.0.mlp.linear_fc1" in dense
    assert fp8_linears(m) == [n for n in dense if n not in m.fp4moe_bf16_linears]
    attn = m.decoder.layers[0].self_attention
    assert type(attn) is RecipeMLASelfAttention and type(attn.linear_q_down_proj) is FP8ColumnParallelLinear
    assert "_forward_impl" in vars(attn.linear_q_down_proj) and "_forward_impl" not in vars(attn.linear_kv_down_proj)
    plain = _build(_cfg("fp8", mtp_num_layers=1))
    assert fp8_linears(plain) == [] and list(plain.state_dict()) == list(m.state_dict())
    loss, grads = _loss_and_grads(m)
    assert torch.isfinite(loss) and all(torch.isfinite(v).all() for v in grads.values())


def test_mxfp4_mla_up_proj_cache_is_mxfp4(mp):
    """recompute mla_up_proj under mxfp4: megatron's MLA up-projection checkpoint stores its cache (q/kv latents,
    k_pos_emb) as MXFP4: fewer saved bytes than the same model with a BF16 cache, the same loss, gradients within
    the E2M1 rounding of the latents."""
    from fp4moe.model.recompute import CACHE_ATTR

    fp4, plain = _model("mxfp4", "mla_up_proj"), _model("mxfp4", "mla_up_proj")
    assert all(getattr(l, CACHE_ATTR) == "mxfp4" for l in fp4.decoder.layers)
    for l in plain.decoder.layers:
        setattr(l, CACHE_ATTR, None)
    bytes_ = {"fp4": _forward_saved_bytes(fp4), "plain": _forward_saved_bytes(plain)}
    # per token and layer the cache shrinks from 2*(128 + 128 + 32) bytes to 17/32 of that (minus the rope part)
    assert bytes_["fp4"] < bytes_["plain"], bytes_
    l0, g0 = _loss_and_grads(plain)
    l1, g1 = _loss_and_grads(fp4)
    assert torch.equal(l0, l1)
    names = [n for n in g0 if g0[n].norm() > 0]
    total = _rel(torch.cat([g1[n].float().flatten() for n in names]), torch.cat([g0[n].float().flatten() for n in names]))
    assert 0 < total < 0.08, total


def test_mxfp4_mla_up_proj_keeps_the_rope_frequencies_exact(mp):
    """The up-projection checkpoint's inputs include MLA's RoPE frequencies [s, 1, 1, rope] fp32, which pass the
    MXFP4 cache's shape rule (rope 32 here, 64 on the proxy) but are not an activation: they stay exact, one fp32
    tensor per layer as with a BF16 cache (c1d0085 packed them to E2M1 too, so the recompute rotated q and k by
    rounded angles; found as 55.5 B per token fewer saved bytes on the H200 probe of 61f1fcb)."""
    from fp4moe.model.recompute import CACHE_ATTR
    from fp4moe.ops.accounting import SavedTensorBytes

    def saved_freqs(m):
        with SavedTensorBytes(exclude=list(m.parameters())) as c:
            ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
            m(ids, torch.arange(32).unsqueeze(0).expand(2, -1), None, labels=ids).float().mean()
        found = {t.untyped_storage().data_ptr() for t in c._seen
                 if t.dtype == torch.float32 and tuple(t.shape) == (32, 1, 1, 32)}
        c.release()
        return len(found)

    fp4, plain = _model("mxfp4", "mla_up_proj"), _model("mxfp4", "mla_up_proj")
    for l in plain.decoder.layers:
        setattr(l, CACHE_ATTR, None)
    assert saved_freqs(fp4) == saved_freqs(plain) == 2


def test_moe_expert_recompute_with_bf16_dispatch_under_mxfp4(mp):
    """precision mxfp4_mlp_shared (BF16 dispatch, experts quantize themselves) + recompute attn_ln_experts: the
    experts' cache is MXFP4 of the BF16 rows, the forward is unchanged (same loss), gradients within the E2M1
    rounding of the cache."""
    base, rec = _model("mxfp4_mlp_shared", "none"), _model("mxfp4_mlp_shared", "attn_ln_experts")
    l0, g0 = _loss_and_grads(base)
    l1, g1 = _loss_and_grads(rec)
    assert torch.equal(l0, l1)
    names = [n for n in g0 if g0[n].norm() > 0]
    total = _rel(torch.cat([g1[n].float().flatten() for n in names]), torch.cat([g0[n].float().flatten() for n in names]))
    assert total < 0.08, total


def test_mxfp4_without_fp4_recompute_caches_is_exact(mp):
    """recompute_cache_fp4=false: under mxfp4, attn_ln_experts recompute gives the same loss and the same
    gradients bit for bit as no recompute (the experts' cache is the dispatched MXFP4 either way)."""
    base = _model("mxfp4", "none")
    cfg = _cfg("mxfp4", "attn_ln_experts")
    cfg.precision.recompute_cache_fp4 = False
    rec = _build(cfg)
    l0, g0 = _loss_and_grads(base)
    l1, g1 = _loss_and_grads(rec)
    assert torch.equal(l0, l1)
    bad = [n for n in g0 if not torch.equal(g0[n], g1[n])]
    assert not bad, bad


def test_mxfp4_reentrant_recompute_caches_are_mxfp4(mp):
    """megatron's reentrant checkpoints under attn_ln_mlp (core_attn q/k/v, the dense-MLP input) store their cache
    MXFP4 under mxfp4, as do the layernorm caches: fewer saved bytes than with recompute_cache_fp4=false (at least
    the norm and MLP-input caches' 2 -> 17/32 bytes per element, plus q/k/v's), the same loss (the forward is
    unchanged), gradients within the E2M1 rounding of the caches; with the switch off the gradients equal no
    recompute's bit for bit."""
    base, fp4 = _model("mxfp4", "none"), _model("mxfp4", "attn_ln_mlp")
    cfg = _cfg("mxfp4", "attn_ln_mlp")
    cfg.precision.recompute_cache_fp4 = False
    plain = _build(cfg)
    bytes_ = {"fp4": _forward_saved_bytes(fp4), "plain": _forward_saved_bytes(plain)}
    tokens, hidden, layers = 64, 256, 2
    norms_and_mlp_input = tokens * hidden * (2 * layers + 1) * (2 - 17 / 32)  # 2 norms per layer, 1 dense MLP
    assert bytes_["plain"] - bytes_["fp4"] > norms_and_mlp_input, bytes_
    l0, g0 = _loss_and_grads(base)
    lp, gp = _loss_and_grads(plain)
    l1, g1 = _loss_and_grads(fp4)
    assert torch.equal(l0, lp) and torch.equal(l0, l1)
    assert not [n for n in g0 if not torch.equal(g0[n], gp[n])]
    names = [n for n in g0 if g0[n].norm() > 0]
    total = _rel(torch.cat([g1[n].float().flatten() for n in names]), torch.cat([g0[n].float().flatten() for n in names]))
    worst = max(_rel(g1[n].float(), g0[n].float()) for n in names)
    # overall larger than attn_ln_experts' (< 0.08): the dense MLP, whose weights hold much of the gradient norm,
    # is re-run from its MXFP4 input, so both of its weight gradients read E2M1-rounded activations (~0.09 here)
    assert 0 < total < 0.12 and worst < 0.25, (total, worst)


def test_mxfp4_full_recompute_keeps_bf16_layer_inputs(mp):
    """Full recompute under mxfp4 keeps each layer's input BF16 (its backward re-runs the routing; an MXFP4 input
    would route some tokens differently): the same saved bytes as with recompute_cache_fp4=false, and the same
    loss and gradients as no recompute, bit for bit."""
    base, fp4 = _model("mxfp4", "none"), _model("mxfp4", "full")
    cfg = _cfg("mxfp4", "full")
    cfg.precision.recompute_cache_fp4 = False
    plain = _build(cfg)
    assert _forward_saved_bytes(fp4) == _forward_saved_bytes(plain) < _forward_saved_bytes(base)
    l0, g0 = _loss_and_grads(base)
    l1, g1 = _loss_and_grads(fp4)
    assert torch.equal(l0, l1)
    assert not [n for n in g0 if not torch.equal(g0[n], g1[n])]


def test_permutation_as_gathers_equals_megatrons_permute_and_unpermute():
    """The MoE data path's permutation 1 (fp4moe.moe.dispatch.permute_tokens) and its inverse (unpermute_tokens), as
    the recipe dispatcher runs them: the same rows as megatron's permute; the same sums as megatron's unpermute and
    the same token gradients as autograd's index_add_, up to the order of k float32 additions; the unpermute's
    gradient is megatron's, exactly; in BF16 the k rows are summed in float32 and rounded once (within half a BF16
    unit of the float64 sum)."""
    from megatron.core.transformer.moe.moe_utils import permute, unpermute

    from fp4moe.moe.dispatch import permutation_from_routing_map, permute_tokens, unpermute_tokens
    from fp4moe.recipe import Recipe

    g = torch.Generator().manual_seed(5)
    t, h, e, k = 53, 64, 8, 3
    top = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    routing = torch.zeros(t, e, dtype=torch.bool).scatter_(1, top, True)
    x = torch.randn(t, h, generator=g, dtype=torch.float64).float()
    x0, x1 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    rows0, _, idx = permute(x0, routing)
    perm, token, _ = permutation_from_routing_map(routing, routing.float(), k)
    assert torch.equal(token, idx)
    rows1 = permute_tokens(x1, perm, Recipe.preset("bf16"))
    assert torch.equal(rows0, rows1)
    gr = torch.randn(rows0.shape, generator=g)
    rows0.backward(gr)
    rows1.backward(gr)
    torch.testing.assert_close(x1.grad, x0.grad, rtol=1e-6, atol=1e-6)
    r0, r1 = gr.clone().requires_grad_(True), gr.clone().requires_grad_(True)
    y0 = unpermute(r0, idx, restore_shape=x.shape)
    y1 = unpermute_tokens(r1, perm)
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    gy = torch.randn(t, h, generator=g)
    y0.backward(gy)
    y1.backward(gy)
    assert torch.equal(r0.grad, r1.grad)
    rb = gr.to(torch.bfloat16)
    exact = torch.zeros(t, h, dtype=torch.float64).index_add_(0, idx, rb.double())
    yb = unpermute_tokens(rb, perm)
    assert yb.dtype == torch.bfloat16
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert ((yb.double() - exact).abs() <= 0.5 * ulp + 1e-12).all()


@pytest.mark.parametrize("precision", RECIPES)
def test_full_recompute_frees_the_recomputed_graph_with_the_backward(mp, precision):
    """Under full recompute the dispatcher's routing probabilities come from the recomputation inside the backward
    and hold that graph, whose leaves are the layer's detached input and its gradient ([seq, micro, hidden] each).
    The MoE layer drops them when its forward returns (the recipe's RecipeMoELayer itself, megatron's under bf16 by
    the hook ``finish`` installs), so reference counting frees both as the backward passes (before, they lived until
    the step's end: every MoE layer already differentiated kept two such tensors while the earlier layers ran their
    backward). With the release switched off they are still there."""
    import gc

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from fp4moe.model.gpt_model import release_dispatcher_tensors
    from fp4moe.model.recipe_moe import RELEASES_DISPATCHER

    def layer_sized():  # [seq, micro, hidden] tensors made since ``before`` (earlier tests may keep their own)
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == (32, 2, 256)
                and id(o) not in before]

    for hooked in (True, False):
        m = _model(precision, "full")
        layers = [layer for layer in m.modules() if isinstance(layer, MoELayer)]
        assert layers and all(getattr(layer, RELEASES_DISPATCHER) for layer in layers)
        if not hooked:
            for layer in layers:
                setattr(layer, RELEASES_DISPATCHER, False)
        gc.collect()
        before: set[int] = set()
        before = {id(o) for o in layer_sized()}
        gc.disable()
        try:
            _loss_and_grads(m)
            kept = layer_sized()
            if hooked:
                assert kept == []
                assert release_dispatcher_tensors(m) == 0
            else:  # the one MoE layer's detached input x and its gradient, until released
                assert len(kept) == 2 and any(t.is_leaf and t.grad is not None for t in kept)
                del kept
                assert release_dispatcher_tensors(m) == 2
                assert layer_sized() == []
        finally:
            gc.enable()


@pytest.mark.parametrize("precision", ("fp8", "mxfp4"))
def test_identity_permutation_2_is_skipped_and_changes_nothing(mp, precision, monkeypatch):
    """One source rank (EP = 1) with several local experts: permutation 2 and its inverse would copy the rows in the
    same order; the recipe dispatcher skips both (no row copy: neither fp4moe.moe.dispatch.reorder_rows nor megatron's
    sort_chunks_by_idxs runs), bit for bit the same output and gradients as with the copies made by reorder_rows
    (skip_permutation_2 off: rows, probs and the combine's inverse, 3 calls) or by megatron's own permutation 2 (its
    BF16-row code, the fallback under drop/pad: fp8 sorts in dispatch and combine, mxfp4's MXFP4 rows are always
    sorted by reorder_rows, its combine by megatron)."""
    import megatron.core.transformer.moe.token_dispatcher as td

    import fp4moe.model.recipe_moe as rm

    calls = {"megatron": 0, "fp4moe": 0}

    def spy(name, real):
        def call(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        return call

    monkeypatch.setattr(td, "sort_chunks_by_idxs", spy("megatron", td.sort_chunks_by_idxs))
    monkeypatch.setattr(rm, "reorder_rows", spy("fp4moe", rm.reorder_rows))
    x, gy = _layer_input_and_grad(3)
    runs = {}
    for run in ("skip", "fp4moe", "megatron"):
        moe = _model(precision, **{"moe.aux_loss_coeff": 0.0}).decoder.layers[1].mlp
        d = moe.token_dispatcher
        assert moe.num_local_experts > 1 and isinstance(d, rm.QuantizedAlltoAllTokenDispatcher)
        assert d.skip_permutation_2  # one source rank
        d.skip_permutation_2 = run == "skip"
        if run == "megatron":
            d._megatron_permutation_2 = lambda: True
        before = dict(calls)
        y, dx = _moe_run(moe, x, gy)
        w1 = torch.stack([e.linear_fc1.weight.grad for e in moe.experts.local_experts])
        runs[run] = (y, dx, w1, {k: calls[k] - before[k] for k in calls})
    assert runs["skip"][3] == {"megatron": 0, "fp4moe": 0}
    assert runs["fp4moe"][3] == {"megatron": 0, "fp4moe": 3}
    assert runs["megatron"][3] == ({"megatron": 2, "fp4moe": 0} if precision == "fp8" else {"megatron": 1, "fp4moe": 2})
    for run in ("fp4moe", "megatron"):
        for a, b in zip(runs["skip"][:3], runs[run][:3]):
            assert torch.equal(a, b), run


@pytest.mark.parametrize("precision", ("fp8", "mxfp4"))
def test_moe_forward_releases_rows_before_the_combine(mp, precision, monkeypatch):
    """The recipe MoE layer frees permutation 1's rows once they are dispatched and the dispatched rows once the
    experts ran (megatron's forward keeps both referenced until it returns): by the time the combine runs, only
    reference counting is needed for both to be gone. Output and gradients are megatron's forward's, bit for bit."""
    import gc
    import weakref

    from megatron.core.transformer.moe.moe_layer import MoELayer

    x, gy = _layer_input_and_grad(5)
    results = {}
    for own in (True, False):
        moe = _model(precision, **{"moe.aux_loss_coeff": 0.0}).decoder.layers[1].mlp
        if not own:  # megatron's forward, the recipe's cast back to the input dtype
            monkeypatch.setattr(type(moe), "_forward_releasing",
                                lambda self, h, m=None: MoELayer.forward(self, h, None, m))
        refs, alive = [], []
        dispatch, routed, combine = moe.dispatch, moe.routed_experts_compute, moe.combine

        def spy_dispatch(rows, probs):
            refs.append(weakref.ref(rows))
            return dispatch(rows, probs)

        def spy_routed(rows, probs):
            anchor = rows if isinstance(rows, torch.Tensor) else rows.grad_anchor  # MXFP4 rows: their anchor
            refs.append(weakref.ref(anchor))
            del anchor
            return routed(rows, probs)

        def spy_combine(output):
            alive.append([r() is not None for r in refs])
            return combine(output)

        moe.dispatch, moe.routed_experts_compute, moe.combine = spy_dispatch, spy_routed, spy_combine
        gc.disable()
        try:
            results[own] = _moe_run(moe, x, gy) + (alive[0],)
        finally:
            gc.enable()
    assert results[True][2] == [False, False]   # both released before the combine
    assert results[False][2] == [True, True]    # megatron's forward still holds them there
    assert torch.equal(results[True][0], results[False][0]) and torch.equal(results[True][1], results[False][1])


def _layer_output_holders(model) -> list[int]:
    """Per transformer layer but the last: how many tensors hold its output's storage after one forward, besides
    the output tensor itself (torch's storage use count, minus that tensor and the storage handle asked for it)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    outs = []
    hooks = [mod.register_forward_hook(lambda mod, args, out: outs.append(out[0] if isinstance(out, tuple) else out))
             for mod in model.modules() if isinstance(mod, TransformerLayer)]
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(ids, torch.arange(32).unsqueeze(0).expand(2, -1), None, labels=ids).float().mean()
    for h in hooks:
        h.remove()
    counts = [torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 2 for t in outs[:-1]]
    del loss
    return counts


def test_mxfp4_norm_cache_replaces_the_bf16_input(mp):
    """Under recompute_cache_fp4 an output-discarding norm checkpoint keeps only the MXFP4 copy of its input, the
    residual stream: nothing else holds a layer's output once the next layer has run. megatron's checkpoint function
    saves its inputs as leaves that require grad, which autograd keeps alive itself (their gradient accumulator
    holds them) beside whatever a pack hook returns: with megatron's BF16 cache (recompute_cache_fp4=false, the
    control) one more tensor holds it. H200 traces of mxfp4 attn_ln_mlp showed every norm input BF16 beside its
    MXFP4 copy before fp4moe.model.recompute saved them as plain tensors."""
    assert _layer_output_holders(_model("mxfp4", "attn_ln_mlp")) == [0]
    cfg = _cfg("mxfp4", "attn_ln_mlp")
    cfg.precision.recompute_cache_fp4 = False
    assert _layer_output_holders(_build(cfg)) == [1]


@pytest.mark.parametrize("precision", RECIPES)
def test_routed_rows_are_counted_for_every_recipe(mp, precision):
    """a2a_stats counts, on every MoE layer's dispatcher (megatron's for bf16), the rows its tokens sent and its
    experts received: on one rank both are T x k per MoE layer and forward (the tiny model: 1 MoE layer, top-2)."""
    from fp4moe.model.gpt_model import a2a_stats

    m = _model(precision)
    assert a2a_stats(m)["dispatch_forward_sent_rows"] == 0
    _forward_saved_bytes(m)   # one forward of 2 x 32 tokens
    st = a2a_stats(m)
    assert st["dispatch_forward_sent_rows"] == st["dispatch_forward_received_rows"] == 2 * 32 * 2
