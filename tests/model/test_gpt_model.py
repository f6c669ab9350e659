"""megatron-core 0.16.1 GPTModel (MLA + MoE, local spec, SDPA core attention, no TE) built from our configs:
forward + backward of the tiny CPU model on gloo (world size 1), and clear errors for what cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fp4moe.config import ConfigError, param_counts

pytest.importorskip("megatron.core")

CONF = Path(__file__).resolve().parents[2] / "conf"


def _cfg(model: str = "tiny_cpu", recompute: str = "none", **model_overrides):
    m = OmegaConf.load(CONF / "model" / f"{model}.yaml")
    for k, v in model_overrides.items():
        OmegaConf.update(m, k, v)
    return OmegaConf.create({"model": m, "parallel": OmegaConf.load(CONF / "parallel" / "cpu.yaml"),
                             "recompute": OmegaConf.load(CONF / "recompute" / f"{recompute}.yaml")})


def _fwd_bwd(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.vocab_size, (2, 32), generator=g)
    pos = torch.arange(32).unsqueeze(0).expand(2, -1)
    labels = torch.randint(0, model.vocab_size, (2, 32), generator=g)
    loss = model(ids, pos, None, labels=labels)  # per-token loss [b, s]
    assert loss.shape == (2, 32)
    loss = loss.mean()
    assert torch.isfinite(loss)
    loss.backward()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, p in params if p.grad is None]
    bad = [n for n, p in params if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not missing, f"no grad: {missing}"
    assert not bad, f"non-finite grad: {bad}"
    return loss.item(), params


@pytest.mark.parametrize("recompute", ["none", "mla_up_proj", "full"])
def test_tiny_forward_backward(mp, recompute):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from fp4moe.model.attention import SDPACoreAttention
    from fp4moe.model.gpt_model import build_gpt_model

    torch.manual_seed(0)
    model = build_gpt_model(_cfg(recompute=recompute))
    assert isinstance(model, GPTModel)
    layers = model.decoder.layers
    assert len(layers) == 2
    assert all(isinstance(l.self_attention, MLASelfAttention) for l in layers)
    assert all(isinstance(l.self_attention.core_attention, SDPACoreAttention) for l in layers)
    assert not isinstance(layers[0].mlp, MoELayer) and isinstance(layers[1].mlp, MoELayer)  # first_k_dense = 1
    assert layers[1].mlp.shared_experts is not None
    assert model.config.moe_token_dispatcher_type == "alltoall"
    assert all(l.self_attention.recompute_up_proj == (recompute == "mla_up_proj") for l in layers)
    assert model.config.recompute_granularity == {"none": None, "mla_up_proj": "selective", "full": "full"}[recompute]
    loss, params = _fwd_bwd(model)
    assert 5.5 < loss < 7.0  # ~ln(512) at init
    # our parameter count formula (fp4moe.config.param_counts) describes what megatron builds
    assert sum(p.numel() for _, p in params) == param_counts(_cfg().model)["total"]


def test_tiny_mtp_forward_backward(mp):
    from fp4moe.model.gpt_model import build_gpt_model

    torch.manual_seed(0)
    model = build_gpt_model(_cfg(mtp_num_layers=1))
    assert model.mtp_process
    _fwd_bwd(model)


def test_recompute_scope_needing_te_is_a_clear_error():
    from fp4moe.model.gpt_model import transformer_config

    cfg = _cfg()
    rec = OmegaConf.create({"name": "ln_te", "granularity": "selective", "megatron_modules": ["core_attn", "layernorm"],
                            "fp4moe_modules": []})
    with pytest.raises(ConfigError, match=r"recompute scope 'ln_te'.*\['layernorm'\].*Transformer Engine"):
        transformer_config(cfg.model, cfg.parallel, rec)


def test_recompute_scope_with_fp4moe_modules_maps_to_megatron():
    """fp4moe's layernorm recompute runs megatron's own (fixed) norm checkpoint; moe_expert is ours alone."""
    from fp4moe.model.gpt_model import fp4moe_recompute_modules, transformer_config

    cfg = _cfg(recompute="attn_ln_experts")
    c = transformer_config(cfg.model, cfg.parallel, cfg.recompute)
    assert c.recompute_granularity == "selective" and c.recompute_modules == ["core_attn", "layernorm"]
    assert fp4moe_recompute_modules(cfg.recompute) == ["layernorm", "moe_expert"]
    rec = OmegaConf.create({"name": "bogus", "granularity": "selective", "megatron_modules": [],
                            "fp4moe_modules": ["attn"]})
    # the scope's rules are fp4moe.settings.Recompute's, checked when the node becomes one
    with pytest.raises(ConfigError, match=r"^recompute.fp4moe_modules has \['attn'\]: fp4moe implements"):
        transformer_config(cfg.model, cfg.parallel, rec)


def test_transformer_config_dsv3_671b():
    """The full-size config maps onto megatron's MLATransformerConfig (no model is built)."""
    from fp4moe.model.gpt_model import transformer_config

    cfg = _cfg(model="dsv3_671b", recompute="mla_up_proj")
    c = transformer_config(cfg.model, cfg.parallel, cfg.recompute)
    assert c.multi_latent_attention and c.q_lora_rank == 1536 and c.kv_lora_rank == 512
    assert (c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) == (128, 64, 128)
    assert c.num_moe_experts == 256 and c.moe_router_topk == 8 and c.moe_ffn_hidden_size == 2048
    assert c.moe_shared_expert_intermediate_size == 2048
    assert c.moe_layer_freq == [0, 0, 0] + [1] * 58
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    # the paper lab's routing (conf/model/dsv3_671b.yaml: no group-limited routing, no MTP; sister artifact)
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor) == (None, None, 2.5)
    assert not c.moe_router_pre_softmax
    assert c.normalization == "RMSNorm" and c.gated_linear_unit and not c.add_bias_linear
    assert c.rope_type == "yarn" and c.rotary_scaling_factor == 40
    assert c.mtp_num_layers is None
    assert c.recompute_granularity == "selective" and c.recompute_modules == ["mla_up_proj"]
    assert c.moe_token_dispatcher_type == "alltoall"


def test_flex_dispatcher_is_a_clear_error():
    from fp4moe.model.gpt_model import transformer_config

    cfg = _cfg()
    cfg.parallel.dispatcher = "flex"
    with pytest.raises(ConfigError, match="parallel.dispatcher='flex'"):
        transformer_config(cfg.model, cfg.parallel, cfg.recompute)


def test_pre_softmax_routing_reaches_megatron():
    """The 16B and 236B models route DeepSeek-V2's way (softmax over all experts before the top-k: megatron's
    moe_router_pre_softmax), the 671B DeepSeek-V3's (sigmoid, no pre-softmax)."""
    from fp4moe.model.gpt_model import transformer_config

    for model, pre in (("moe_16b", True), ("dsv2_236b", True), ("dsv3_671b", False)):
        cfg = _cfg(model=model)
        c = transformer_config(cfg.model, cfg.parallel, cfg.recompute)
        assert c.moe_router_pre_softmax is pre, model
