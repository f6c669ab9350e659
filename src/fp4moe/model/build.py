"""fp4moe config -> megatron-core 0.16.1 ``MLATransformerConfig`` and ``GPTModel`` (MLA + MoE, no Transformer Engine).

The layer spec is megatron's local (torch-native) spec with ``core_attention`` swapped for
:class:`fp4moe.model.attention.SDPACoreAttention` (the local ``DotProductAttention`` rejects MLA's
``k_channels``/``v_channels``). Needs ``megatron.core.parallel_state.initialize_model_parallel`` to have run.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from fp4moe.config import (FP4MOE_RECOMPUTE_MODULES, MEGATRON_RECOMPUTE_MODULES, TE_ONLY_RECOMPUTE_MODULES,
                           ConfigError)
from fp4moe.model import cpu_shims
from fp4moe.model.attention import SDPACoreAttention

DISPATCHERS = ("alltoall", "allgather")  # 'flex' needs DeepEP/HybridEP, absent here


def _plain(cfg: Any) -> Any:
    if cfg is None:
        return {}
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def _recompute_kwargs(recompute_cfg: Any) -> dict[str, Any]:
    r = _plain(recompute_cfg)
    name = r.get("name", "<unnamed>")
    gran = r.get("granularity")
    mods = list(r.get("megatron_modules") or [])
    own = list(r.get("fp4moe_modules") or [])
    if gran is None:
        if mods or own:
            raise ConfigError(f"recompute scope {name!r}: modules {mods + own} are set but granularity is null: "
                              "set granularity: selective or empty the module lists")
        return {}
    if gran == "full":
        method = r.get("method")
        if method not in ("uniform", "block"):
            raise ConfigError(f"recompute scope {name!r}: granularity full needs method uniform or block, got {method!r}")
        return {"recompute_granularity": "full", "recompute_method": method,
                "recompute_num_layers": int(r.get("num_layers") or 1)}
    if gran != "selective":
        raise ConfigError(f"recompute scope {name!r}: granularity={gran!r}; pick null, selective or full")
    unknown = [m for m in mods if m not in MEGATRON_RECOMPUTE_MODULES]
    if unknown:
        raise ConfigError(f"recompute scope {name!r}: megatron_modules {unknown} are not megatron-core recompute "
                          f"modules ({', '.join(MEGATRON_RECOMPUTE_MODULES)})")
    te = [m for m in mods if m in TE_ONLY_RECOMPUTE_MODULES]
    if te:
        why = "; ".join(f"{m}: {TE_ONLY_RECOMPUTE_MODULES[m]}" for m in te)
        raise ConfigError(f"recompute scope {name!r}: megatron_modules {te} need Transformer Engine in megatron-core "
                          f"and fp4moe builds the model without it ({why}). Use recompute.fp4moe_modules "
                          f"({', '.join(FP4MOE_RECOMPUTE_MODULES)}) or another recompute scope")
    if own:
        raise ConfigError(f"recompute scope {name!r}: fp4moe_modules {own} (fp4moe's own layernorm / expert-MLP "
                          "recompute) are not implemented in the model yet (P3): pick a scope without them "
                          "(mla_up_proj, none, full) for now")
    if not mods:
        raise ConfigError(f"recompute scope {name!r}: granularity selective with no modules; use granularity: null")
    return {"recompute_granularity": "selective", "recompute_modules": mods}


def transformer_config(model_cfg: Any, parallel_cfg: Any = None, recompute_cfg: Any = None, *,
                       params_dtype: torch.dtype = torch.float32):
    """Build megatron-core's ``MLATransformerConfig`` from ``conf/model``, ``conf/parallel`` and ``conf/recompute``
    entries. Raises :class:`fp4moe.config.ConfigError` for what cannot run without TE."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    m, p = _plain(model_cfg), _plain(parallel_cfg)
    mla, moe = m["mla"], m["moe"]
    layers, dense_k = int(m["num_layers"]), int(moe["first_k_dense"])
    if not 0 <= dense_k <= layers:
        raise ConfigError(f"model.moe.first_k_dense={dense_k} must be in [0, model.num_layers={layers}]")
    dispatcher = p.get("dispatcher") or "alltoall"
    if dispatcher not in DISPATCHERS:
        raise ConfigError(f"parallel.dispatcher={dispatcher!r}: without DeepEP/HybridEP pick one of {DISPATCHERS}")
    on_cpu = not torch.cuda.is_available()
    shared = int(moe.get("shared_experts") or 0) * int(moe["ffn_hidden_size"])
    kwargs: dict[str, Any] = dict(
        # model
        num_layers=layers,
        hidden_size=int(m["hidden_size"]),
        num_attention_heads=int(m["num_attention_heads"]),
        ffn_hidden_size=int(m["ffn_hidden_size"]),
        normalization=str(m.get("normalization", "RMSNorm")),
        layernorm_epsilon=float(m.get("norm_epsilon", 1e-6)),
        init_method_std=float(m.get("init_method_std", 0.02)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mtp_num_layers=int(m.get("mtp_num_layers") or 0) or None,
        mtp_loss_scaling_factor=float(m.get("mtp_loss_scaling_factor", 0.1)),
        # MLA
        multi_latent_attention=True,
        q_lora_rank=mla.get("q_lora_rank"),
        kv_lora_rank=int(mla["kv_lora_rank"]),
        qk_head_dim=int(mla["qk_head_dim"]),
        qk_pos_emb_head_dim=int(mla["qk_pos_emb_head_dim"]),
        v_head_dim=int(mla["v_head_dim"]),
        qk_layernorm=True,  # MLA's q/kv latent RMSNorms
        rope_type=str(mla.get("rope_type", "rope")),
        rotary_base=float(mla.get("rotary_base", 10000)),
        rotary_scaling_factor=float(mla.get("rotary_scaling_factor", 1.0)),
        # MoE
        num_moe_experts=int(moe["num_experts"]),
        moe_layer_freq=[0] * dense_k + [1] * (layers - dense_k),
        moe_ffn_hidden_size=int(moe["ffn_hidden_size"]),
        moe_shared_expert_intermediate_size=shared or None,
        moe_router_topk=int(moe["router_topk"]),
        moe_router_score_function=str(moe.get("score_function", "softmax")),
        moe_router_topk_scaling_factor=moe.get("topk_scaling_factor"),
        moe_router_num_groups=moe.get("num_groups"),
        moe_router_group_topk=moe.get("group_topk"),
        moe_router_enable_expert_bias=bool(moe.get("expert_bias", False)),
        moe_router_bias_update_rate=float(moe.get("bias_update_rate", 1e-3)),
        moe_router_load_balancing_type=str(moe.get("load_balancing_type", "aux_loss")),
        moe_aux_loss_coeff=float(moe.get("aux_loss_coeff", 0.0)),
        moe_router_dtype=moe.get("router_dtype"),
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        # parallel
        tensor_model_parallel_size=int(p.get("tensor", 1)),
        pipeline_model_parallel_size=int(p.get("pipeline", 1)),
        context_parallel_size=int(p.get("context", 1)),
        expert_model_parallel_size=int(p.get("expert", 1)),
        expert_tensor_parallel_size=int(p.get("expert_tensor") or p.get("tensor", 1)),
        sequence_parallel=bool(p.get("sequence_parallel", False)),
        # no TE / apex / megatron CUDA kernels
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bias_activation_fusion=not on_cpu,
        bias_dropout_fusion=not on_cpu,
        use_cpu_initialization=on_cpu,
        perform_initialization=True,
    )
    if mla.get("rope_type") == "yarn":
        kwargs["original_max_position_embeddings"] = int(mla.get("original_max_position_embeddings", 4096))
    kwargs.update(_recompute_kwargs(recompute_cfg))
    return MLATransformerConfig(**kwargs)


def layer_spec(config):
    """megatron's local decoder-block spec (dense layers for the first ``first_k_dense``, MoE after) with our
    SDPA core attention in every layer's MLA."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    for spec in block.layer_specs:
        attn = spec.submodules.self_attention
        attn.submodules = copy.copy(attn.submodules)
        attn.submodules.core_attention = SDPACoreAttention
    return block


def build_gpt_model(cfg: Any, *, params_dtype: torch.dtype = torch.float32,
                    pre_process: bool = True, post_process: bool = True):
    """``GPTModel`` (MLA + MoE, local spec, SDPA core attention) for the composed config ``cfg`` (groups
    ``model``, ``parallel``, ``recompute``). Applies the CPU shims when CUDA is absent."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    cpu_shims.apply()
    # megatron's per-layer MoE aux-loss log (moe_utils.py:43, :893-896) is a process-global dict whose tensors are
    # sized by the first model that logs (num_layers [+ mtp]); a model with more layers built later in the same
    # process would index past them (IndexError in save_to_aux_losses_tracker). Start each model with it empty.
    get_moe_layer_wise_logging_tracker().clear()
    model_cfg = cfg["model"]
    config = transformer_config(model_cfg, cfg.get("parallel"), cfg.get("recompute"), params_dtype=params_dtype)
    block = layer_spec(config)
    mtp = None
    if config.mtp_num_layers:
        mtp = get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False)
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=int(model_cfg["vocab_size"]),
        max_sequence_length=int(model_cfg["max_position_embeddings"]),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(model_cfg.get("tie_embeddings", False)),
        position_embedding_type="none",  # MLA applies its own (decoupled) RoPE
        mtp_block_spec=mtp,
    )


__all__ = ["transformer_config", "build_gpt_model", "layer_spec", "DISPATCHERS"]
