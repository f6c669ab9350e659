"""One MoE data path. Given the same weights, the same tokens and the same routing (top-k expert ids and their
probabilities), the standalone layer (``fp4moe.moe.MoELayer.forward_routed``) and megatron's MoE layer as
fp4moe.model builds it for training (``RecipeMoELayer`` with the recipe dispatcher, ``RecipeGroupedMLP`` and
``RecipeSharedExpertMLP``, tiny_cpu's MoE layer) give bit-identical outputs, a2a byte counts and gradients of the
input, of the routing probabilities and of every expert and shared-expert weight, for bf16, fp8 and mxfp4 (on CPU
the recipes run on the reference kernels): at EP = 1 in one process and at EP = 2 on two gloo processes (permutation
2 and the probabilities' all-to-all then move rows), with top-2 and top-3 routing (three rows per token: the order of
the float32 sums matters), the experts' recompute, ``FP4MOE_DISPATCH_QUANTIZE=rows`` and the identity permutation 2
run instead of skipped.

What is not compared, and why: the routers. megatron's router (its score function, top-k, normalisation and aux-loss
code) and the standalone's float32 router are different code by design (the megatron adapter keeps megatron's
routing); the routing is given to both (megatron's ``route`` returns the given dense probabilities and routing map),
so everything after the router is compared and the router weights get no gradient. bf16: precision bf16 builds
megatron's own MoE modules, not this path (test_recipe_model.test_bf16_recipe_is_megatron_path), so the adapter is
built from the fp8 config and its modules run the bf16 recipe, the path the adapter takes under a bf16 recipe.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.model.ep2_gloo import run_on_two_ranks  # noqa: E402

CONF = Path(__file__).resolve().parents[2] / "conf"
RECIPES = ("bf16", "fp8", "mxfp4")
VARIANTS = ("top2", "top3", "expert_recompute", "quantize_rows", "permutation_2")


def _cfg(precision: str, recompute: str = "none", ep: int = 1, **model):
    from omegaconf import OmegaConf

    m = OmegaConf.load(CONF / "model" / "tiny_cpu.yaml")
    m.moe.aux_loss_coeff = 0.0
    for k, v in model.items():
        OmegaConf.update(m, k, v)
    par = OmegaConf.load(CONF / "parallel" / "cpu.yaml")
    if ep > 1:
        par.world_size, par.expert = ep, ep
    return OmegaConf.create({"model": m, "parallel": par,
                             "recompute": OmegaConf.load(CONF / "recompute" / f"{recompute}.yaml"),
                             "precision": OmegaConf.load(CONF / "precision" / f"{precision}.yaml")})


def _pair(precision: str, variant: str, ep: int = 1):
    """(megatron's MoE layer of the tiny model, the standalone layer with its weights, top-k)."""
    from fp4moe.model.gpt_model import build_gpt_model, to_bf16_params
    from fp4moe.model.recipe_moe import RecipeMoELayer
    from fp4moe.moe import MoELayer
    from fp4moe.recipe import Recipe

    built = "fp8" if precision == "bf16" else precision
    k = 3 if variant == "top3" else 2
    cfg = _cfg(built, "attn_ln_experts" if variant == "expert_recompute" else "none", ep, **{"moe.router_topk": k})
    torch.manual_seed(0)
    moe = to_bf16_params(build_gpt_model(cfg, params_dtype=torch.bfloat16)).decoder.layers[1].mlp
    assert isinstance(moe, RecipeMoELayer) and moe.experts.recompute == (variant == "expert_recompute")
    recipe = Recipe.preset(precision) if precision == "bf16" else Recipe.from_config(cfg.precision)
    for mod in (moe, moe.token_dispatcher, moe.experts, moe.shared_experts):
        mod.recipe = recipe
    if variant == "permutation_2":
        assert moe.token_dispatcher.skip_permutation_2 == (ep == 1)
        moe.token_dispatcher.skip_permutation_2 = False  # EP = 1: the identity permutation run, not skipped
    c = moe.config
    ref = MoELayer(c.hidden_size, c.moe_ffn_hidden_size, c.num_moe_experts, k, recipe,
                   shared_ffn=c.moe_shared_expert_intermediate_size, expert_recompute=variant == "expert_recompute")
    assert ref.world == ep and ref.local_experts == len(moe.experts.local_experts)
    assert ref.quantize_tokens == moe.token_dispatcher.quantize_tokens == (variant != "quantize_rows")
    with torch.no_grad():
        ref.w1.copy_(torch.stack([e.linear_fc1.weight for e in moe.experts.local_experts]))
        ref.w2.copy_(torch.stack([e.linear_fc2.weight for e in moe.experts.local_experts]))
        ref.shared_w1.copy_(moe.shared_experts.linear_fc1.weight)
        ref.shared_w2.copy_(moe.shared_experts.linear_fc2.weight)
    return moe, ref, k


def _inputs(k: int, e: int, seed: int):
    """x, dL/dy ``[16, 2, 256]`` bf16 and the routing of its 32 tokens: top-k ids ``[32, k]``, probs ``[32, k]``."""
    g = torch.Generator().manual_seed(seed)
    x, gy = (torch.randn(16, 2, 256, generator=g).to(torch.bfloat16) for _ in range(2))
    idx = torch.rand(32, e, generator=g).topk(k, dim=1).indices
    return x, gy, idx, torch.rand(32, k, generator=g) + 0.05


def _run_megatron(moe, x, gy, idx, probs) -> dict:
    xx, p = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    t, e = idx.shape[0], moe.config.num_moe_experts
    dense = torch.zeros(t, e).scatter(1, idx, p)                  # megatron's router output: [T, E] probs and map
    routing_map = torch.zeros(t, e, dtype=torch.bool).scatter(1, idx, True)
    moe.route = lambda hidden_states, padding_mask=None: (dense, routing_map)
    y, _ = moe(xx)
    y.backward(gy)
    ex = moe.experts.local_experts
    return dict(y=y.detach(), x=xx.grad, probs=p.grad, w1=torch.stack([m.linear_fc1.weight.grad for m in ex]),
                w2=torch.stack([m.linear_fc2.weight.grad for m in ex]),
                shared_w1=moe.shared_experts.linear_fc1.weight.grad, shared_w2=moe.shared_experts.linear_fc2.weight.grad,
                a2a=moe.a2a_stats())


def _run_standalone(layer, x, gy, idx, probs) -> dict:
    xx, p = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    y = layer.forward_routed(xx, idx, p)
    y.backward(gy)
    a2a = {f"dispatch_{k}": v for k, v in layer.dispatch_stats.as_dict().items()}
    a2a.update({f"combine_{k}": v for k, v in layer.combine_stats.as_dict().items()})
    return dict(y=y.detach(), x=xx.grad, probs=p.grad, w1=layer.w1.grad, w2=layer.w2.grad,
                shared_w1=layer.shared_w1.grad, shared_w2=layer.shared_w2.grad, a2a=a2a)


def _compare(precision: str, variant: str, ep: int = 1, seed: int = 3) -> list[str]:
    """The names of the outputs / gradients that differ between the two layers (empty: bit-identical)."""
    moe, ref, k = _pair(precision, variant, ep)
    x, gy, idx, probs = _inputs(k, moe.config.num_moe_experts, seed)
    a, b = _run_megatron(moe, x, gy, idx, probs), _run_standalone(ref, x, gy, idx, probs)
    assert a["y"].dtype == b["y"].dtype == torch.bfloat16 and a["y"].shape == b["y"].shape == x.shape
    assert all(v is not None for v in (*a.values(), *b.values()))
    if ep > 1:
        assert a["a2a"]["dispatch_forward_sent_remote_bytes"] > 0
    return [n for n in a if not (torch.equal(a[n], b[n]) if isinstance(a[n], torch.Tensor) else a[n] == b[n])]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("precision", RECIPES)
def test_standalone_and_megatron_layers_are_one_path(mp, monkeypatch, precision, variant):
    if variant == "quantize_rows":
        if precision != "mxfp4":
            pytest.skip("FP4MOE_DISPATCH_QUANTIZE only matters under dispatch_fp4")
        monkeypatch.setenv("FP4MOE_DISPATCH_QUANTIZE", "rows")
    assert _compare(precision, variant) == []


def _ep2_cases(rank: int) -> dict[str, list[str]]:
    return {f"{precision}/{variant}": _compare(precision, variant, ep=2, seed=3 + rank)
            for precision in RECIPES for variant in ("top2", "top3")}


def test_one_path_at_ep2(tmp_path):
    """EP = 2 on gloo: each rank's tokens and routing (uneven rows per rank and expert) through both layers."""
    for rank, res in enumerate(run_on_two_ranks(_ep2_cases, tmp_path)):
        assert len(res) == 2 * len(RECIPES) and all(v == [] for v in res.values()), (rank, res)
