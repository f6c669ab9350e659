"""fp4moe config -> megatron-core 0.16.1 ``MLATransformerConfig`` and ``GPTModel`` (MLA + MoE, no Transformer Engine).

The layer spec is megatron's local (torch-native) spec with ``core_attention`` swapped for
:class:`fp4moe.model.attention.SDPACoreAttention` (the local ``DotProductAttention`` rejects MLA's
``k_channels``/``v_channels``). Needs ``megatron.core.parallel_state.initialize_model_parallel`` to have run.

Precision (``cfg.precision`` -> its Recipe, ``fp4moe.settings``; the trainer hands in the one it parsed) is in the layer spec alone (:func:`layer_spec`): bf16 builds
megatron's own modules unchanged; fp8 and mxfp4 swap the MoE layer, its dispatcher, routed experts and shared
expert for the recipe's (:mod:`fp4moe.model.recipe_moe`), with ``scope: all_linears`` the attention and dense-MLP
linears (and MTP's ``eh_proj``) for FP8 ones (:mod:`fp4moe.model.recipe_dense`), and with ``recompute_cache_fp4``
the layers for ones whose recompute caches are MXFP4 (``fp4moe.model.recompute.MXFP4CacheTransformerLayer``);
parameter names stay megatron's (the kernel switch ``bf16_moe=fp4moe`` gives bf16 the recipe's MoE layer too:
:func:`recipe_moe_layers`). Nothing is patched into a built module; megatron's own MoE layers (bf16) get
fp4moe's instrumentation from :func:`finish`. megatron and torch themselves are patched only while
``fp4moe.model.cpu_shims.active()`` is held (:func:`prepare`).

Recompute (``cfg.recompute`` -> ``fp4moe.settings.Recompute``, which checks its rules; here only what building
without Transformer Engine adds): ``megatron_modules`` go to megatron's ``recompute_modules``; ``fp4moe_modules``
are ours (:mod:`fp4moe.model.recompute`): ``layernorm`` (megatron's output-discarding norm checkpoint, fixed for
no-TE, cache MXFP4 under mxfp4) and ``moe_expert`` (routed experts only, no dispatch re-run).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from fp4moe.config import DISPATCHERS, ConfigError
from fp4moe.model.attention import SDPACoreAttention
from fp4moe.recipe import Recipe
from fp4moe.settings import (FP4MOE_RECOMPUTE_MODULES, TE_ONLY_RECOMPUTE_MODULES, Recompute, build_group,
                             nested_in_self_attention)



def _given(value, default):
    """``value``, or ``default`` where the config leaves it null (a key whose schema's null means "not given")."""
    return default if value is None else value


def _plain(cfg: Any) -> Any:
    if cfg is None:
        return {}
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def recompute_of(recompute: Any) -> Recompute | None:
    """The ``recompute`` group as :class:`fp4moe.settings.Recompute` (its rules checked when it is built; the
    settings' own instance is taken as it is); None for no group."""
    return None if recompute is None else build_group("recompute", recompute)


def _recompute_kwargs(recompute: Any) -> dict[str, Any]:
    """megatron-core's recompute settings for a recompute scope (a Recompute, or its config node)."""
    r = recompute_of(recompute)
    if r is None or r.granularity is None:
        return {}
    te = r.te_only_modules
    if te:
        why = "; ".join(f"{m}: {TE_ONLY_RECOMPUTE_MODULES[m]}" for m in te)
        raise ConfigError(f"recompute scope {r.name!r}: megatron_modules {list(te)} need Transformer Engine in "
                          f"megatron-core and fp4moe builds the model without it ({why}). Use recompute.fp4moe_modules "
                          f"({', '.join(FP4MOE_RECOMPUTE_MODULES)}) or another recompute scope")
    if r.granularity == "full":
        return {"recompute_granularity": "full", "recompute_method": r.method,
                "recompute_num_layers": int(r.num_layers or 1)}
    mods = list(r.megatron_modules)
    if "layernorm" in r.fp4moe_modules:  # megatron's output-discarding norm checkpoint, made to work without TE
        mods.append("layernorm")
    if not mods:
        return {}
    return {"recompute_granularity": "selective", "recompute_modules": mods}


def fp4moe_recompute_modules(recompute: Any) -> list[str]:
    """The ``recompute.fp4moe_modules`` that fp4moe implements itself ('layernorm', 'moe_expert', 'self_attention')."""
    r = recompute_of(recompute)
    return [] if r is None else list(r.own_modules)


def recipe_of(cfg: Any) -> Recipe:
    """The Recipe of a config's ``precision`` group (``fp4moe.settings.Precision.recipe``); bf16 when it has none."""
    prec = cfg.get("precision") if hasattr(cfg, "get") else None
    return build_group("precision", prec) if prec is not None else Recipe.bf16()


def _check_recipe_parallel(recipe, config) -> None:
    """ConfigError for what fp4moe's MoE layers (:func:`recipe_moe_layers`) cannot run: TP, another dispatcher,
    token dropping."""
    if not recipe_moe_layers(recipe):
        return
    what = recipe.name if recipe.fp8_compute else f"{recipe.name} with kernels.bf16_moe=fp4moe"
    if config.expert_tensor_parallel_size != 1 or config.tensor_model_parallel_size != 1:
        raise ConfigError(f"precision {what!r} needs parallel.tensor = parallel.expert_tensor = 1 (the "
                          "quantized dispatcher does not all-gather MXFP4 rows over TP); use precision=bf16 "
                          "(kernels.bf16_moe=megatron, the default) for TP")
    if config.moe_token_dispatcher_type != "alltoall":
        raise ConfigError(f"precision {what!r} needs parallel.dispatcher=alltoall (the recipe's quantized "
                          f"all-to-all), got {config.moe_token_dispatcher_type!r}")
    if config.moe_expert_capacity_factor is not None or config.moe_pad_expert_input_to_capacity:
        raise ConfigError(f"precision {what!r}: token dropping / capacity padding is not supported")
    if config.moe_shared_expert_overlap:
        raise ConfigError(f"precision {recipe.name!r}: moe_shared_expert_overlap is not supported")


def transformer_config(model_cfg: Any, parallel_cfg: Any = None, recompute_cfg: Any = None, *,
                       params_dtype: torch.dtype = torch.float32, precision_cfg: Any = None):
    """Build megatron-core's ``MLATransformerConfig`` from ``conf/model``, ``conf/parallel`` and ``conf/recompute``
    entries (``recompute_cfg``: a node or the settings' Recompute). Raises :class:`fp4moe.config.ConfigError` for
    what cannot run without TE (and, given ``precision_cfg``, a Recipe or a precision node, for parallel settings the
    recipe's modules do not support)."""
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
        # null or absent: megatron's default (fp4moe.settings.ABSENT_WHEN_NULL: the schema's null means "not given")
        mtp_loss_scaling_factor=float(_given(m.get("mtp_loss_scaling_factor"), 0.1)),
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
        moe_router_pre_softmax=bool(_given(moe.get("pre_softmax"), False)),  # softmax before the top-k (DeepSeek-V2's)
        moe_router_topk_scaling_factor=moe.get("topk_scaling_factor"),
        moe_router_num_groups=moe.get("num_groups"),
        moe_router_group_topk=moe.get("group_topk"),
        moe_router_enable_expert_bias=bool(moe.get("expert_bias", False)),
        moe_router_bias_update_rate=float(_given(moe.get("bias_update_rate"), 1e-3)),
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
    kwargs.update(_pipeline_kwargs(p, params_dtype, on_cpu))
    try:
        config = MLATransformerConfig(**kwargs)
    except (AssertionError, ValueError) as e:
        if isinstance(e, ConfigError) or "pipeline_model_parallel_layout" not in kwargs:
            raise
        raise ConfigError(f"parallel.pipeline_layout={kwargs['pipeline_model_parallel_layout']!r}: megatron-core "
                          f"refuses it ({e}): fix the layout string (letters E, t, m, L; one stage per "
                          "pipeline rank)") from e
    if precision_cfg is not None:
        _check_recipe_parallel(build_group("precision", precision_cfg), config)
    return config


def _pipeline_kwargs(p: dict[str, Any], params_dtype: torch.dtype, on_cpu: bool) -> dict[str, Any]:
    """megatron-core's pipeline settings for ``parallel.pipeline`` > 1 (nothing for PP = 1, so that config stays
    as it was): the dtype of the activations sent between stages (the parameters' dtype, as megatron-lm sets it),
    the uneven stage layout ``parallel.pipeline_layout`` (megatron-core's ``--pipeline-model-parallel-layout``
    syntax) and, on CPU, no ``torch.cuda.synchronize`` after each batched send/receive."""
    pp = int(p.get("pipeline", 1) or 1)
    if pp == 1:
        return {}
    out: dict[str, Any] = {"pipeline_dtype": params_dtype}
    if p.get("pipeline_layout"):
        out["pipeline_model_parallel_layout"] = str(p["pipeline_layout"])
    if int(p.get("virtual_pipeline") or 1) > 1:
        out["virtual_pipeline_model_parallel_size"] = int(p["virtual_pipeline"])
    if on_cpu:
        out["batch_p2p_sync"] = False  # p2p_communication.py: torch.cuda.synchronize() after batch_isend_irecv
    return out


def recipe_moe_layers(recipe) -> bool:
    """Whether ``recipe``'s MoE layers are fp4moe's (:class:`RecipeMoELayer`): always under FP8 compute; under bf16
    only with the kernel switch ``bf16_moe=fp4moe`` in force (fp4moe.ops.switches_in_force; the default keeps
    megatron-core's own MoE layers, the recipe's BF16 baseline)."""
    from fp4moe.ops import switches_in_force

    return recipe.fp8_compute or switches_in_force().bf16_moe == "fp4moe"


def _moe_spec(mlp_spec, recipe, moe_expert_recompute: bool):
    """The MoE layer spec for ``recipe`` (a copy; megatron's when bf16 under ``bf16_moe=megatron``, with only the
    experts swapped for :class:`RecomputedSequentialMLP` under moe_expert recompute)."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from fp4moe.model.recipe_moe import RecipeGroupedMLP, RecipeMoELayer, RecipeSharedExpertMLP
    from fp4moe.model.recompute import RecomputedSequentialMLP

    sub = mlp_spec.submodules
    experts, shared = sub.experts, sub.shared_experts
    if not recipe_moe_layers(recipe):
        if not moe_expert_recompute:
            return mlp_spec
        experts = ModuleSpec(module=RecomputedSequentialMLP, submodules=experts.submodules)
        return ModuleSpec(module=mlp_spec.module, submodules=MoESubmodules(experts=experts, shared_experts=shared,
                                                                            router=sub.router),
                          params=dict(mlp_spec.params), metainfo=dict(mlp_spec.metainfo))
    experts = ModuleSpec(module=RecipeGroupedMLP, submodules=experts.submodules,
                         params={"recipe": recipe, "recompute": moe_expert_recompute})
    if shared is not None:
        shared = ModuleSpec(module=RecipeSharedExpertMLP, submodules=shared.submodules, params={"recipe": recipe})
    return ModuleSpec(module=RecipeMoELayer, submodules=MoESubmodules(experts=experts, shared_experts=shared,
                                                                      router=sub.router),
                      params={**mlp_spec.params, "recipe": recipe}, metainfo=dict(mlp_spec.metainfo))


def _dense_spec(mlp_spec, recipe):
    """A dense MLP's spec with its linears FP8 (``scope: all_linears``; a copy)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from fp4moe.model.recipe_dense import fp8_linear_spec

    sub = copy.copy(mlp_spec.submodules)
    sub.linear_fc1 = fp8_linear_spec(sub.linear_fc1, recipe)
    sub.linear_fc2 = fp8_linear_spec(sub.linear_fc2, recipe)
    return ModuleSpec(module=mlp_spec.module, submodules=sub, params=dict(mlp_spec.params),
                      metainfo=dict(mlp_spec.metainfo))


def layer_spec(config, recipe=None, recompute_modules: tuple[str, ...] = ()):
    """megatron's local decoder-block spec (dense layers for the first ``first_k_dense``, MoE after) with our
    SDPA core attention in every layer's MLA and the whole ``recipe`` (fp4moe.recipe.Recipe; None = bf16: megatron's
    modules): for fp8 / mxfp4 the recipe's MoE modules (:mod:`fp4moe.model.recipe_moe`), under ``scope:
    all_linears`` FP8 attention and dense-MLP linears (:mod:`fp4moe.model.recipe_dense`), under
    ``recompute_cache_fp4`` layers whose recompute caches are MXFP4
    (:class:`fp4moe.model.recompute.MXFP4CacheTransformerLayer`). ``recompute_modules``: fp4moe's own ('moe_expert'
    changes the experts, 'self_attention' the attention module to
    :class:`fp4moe.model.recompute.RecomputedMLASelfAttention`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from fp4moe.model.recipe_dense import RecipeMLASelfAttention, fp8_linear_spec
    from fp4moe.model.recompute import MXFP4CacheTransformerLayer, RecomputedMLASelfAttention

    recipe = recipe or Recipe.bf16()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    specs = []
    for spec in block.layer_specs:
        spec = copy.copy(spec)
        spec.submodules = copy.copy(spec.submodules)
        attn = spec.submodules.self_attention = copy.copy(spec.submodules.self_attention)
        attn.submodules = copy.copy(attn.submodules)
        attn.submodules.core_attention = SDPACoreAttention
        if "self_attention" in recompute_modules:
            if config.add_bias_linear:
                raise ConfigError("recompute module self_attention needs model.add_bias_linear=false (the attention "
                                  "output projection's bias would be added outside the checkpoint)")
            if attn.module is not MLASelfAttention:
                raise ConfigError(f"recompute module self_attention recomputes megatron's MLASelfAttention; this "
                                  f"model's attention is {attn.module.__name__}")
            attn.module = RecomputedMLASelfAttention
        dense = recipe.applies_to("dense")
        if dense:  # FP8 linears; the down-projections inside RecipeMLASelfAttention (recipe_dense.py says why)
            if attn.module not in (MLASelfAttention, RecomputedMLASelfAttention):
                raise ConfigError(f"precision {recipe.name!r} scope all_linears: fp4moe's FP8 attention is MLA's; "
                                  f"this model's attention is {attn.module.__name__}")
            if attn.module is MLASelfAttention:
                attn.module = RecipeMLASelfAttention
            attn.params = {**attn.params, "recipe": recipe}
            for name in ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "linear_proj"):
                setattr(attn.submodules, name, fp8_linear_spec(getattr(attn.submodules, name), recipe))
        mlp = spec.submodules.mlp
        if getattr(mlp, "module", None) is MoELayer:
            spec.submodules.mlp = _moe_spec(mlp, recipe, "moe_expert" in recompute_modules)
        elif dense and getattr(mlp, "module", None) is MLP:
            spec.submodules.mlp = _dense_spec(mlp, recipe)
        if recipe.recompute_cache_fp4:
            if spec.module is not TransformerLayer:
                raise ConfigError(f"precision {recipe.name!r}: recompute_cache_fp4 marks megatron's TransformerLayer; "
                                  f"this model's layer is {spec.module.__name__}")
            spec.module = MXFP4CacheTransformerLayer
        specs.append(spec)
    block.layer_specs = specs
    return block


# The three calls of fp4moe.model.api (the recipe in a GPTModel the user configures), which build_gpt_model makes too.

def _clear_moe_log() -> None:
    """An empty megatron per-layer MoE aux-loss log (moe_utils.py:43, :893-896: a process-global dict whose tensors
    are sized by the first model that logs; a model with more layers built later in the same process would index
    past them)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    get_moe_layer_wise_logging_tracker().clear()


class Prepared:
    """What :func:`prepare` returns: holds ``fp4moe.model.cpu_shims.active()`` from the call on, until
    :meth:`close` or the end of a ``with`` block around it (``with prepare(): ...``); without either, for the rest
    of the process (a script that cannot put its building and training inside one block)."""

    def __init__(self) -> None:
        from fp4moe.model import cpu_shims

        self._shims = cpu_shims.active()
        self.cpu = self._shims.__enter__()  # True: the CPU shims are among them (CUDA absent)
        self._held = True
        _clear_moe_log()

    def __enter__(self) -> "Prepared":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the shims (every original is back once no one else holds them). Idempotent."""
        if self._held:
            self._held = False
            self._shims.__exit__(None, None, None)


def prepare() -> Prepared:
    """Before a model is built: hold fp4moe's patches of megatron and torch (``fp4moe.model.cpu_shims.active()``:
    the no-TE fixes, fp4moe's megatron checkpoints with the optional MXFP4 recompute cache, the CPU/gloo shims when
    CUDA is absent) and empty megatron's per-layer MoE aux-loss log. Held from the call: ``with prepare(): <build
    and train>`` lets go at the block's end (every original back), a bare ``prepare()`` keeps them for the process
    (:class:`Prepared`). Calls may nest."""
    return Prepared()


def decoder_block_spec(config: Any, recipe: Any = None, recompute_modules: tuple[str, ...] = ()):
    """megatron-core's local decoder-block spec for ``config`` with the recipe inside (``recipe``: a
    ``fp4moe.recipe.Recipe``; None = bf16, megatron's own MoE path) and fp4moe's own recompute modules
    (``moe_expert``, ``self_attention``; ``layernorm`` goes in ``config.recompute_modules``). Raises ConfigError
    for what the recipe's modules do not support (TP or expert-TP > 1, a dispatcher other than alltoall, token
    dropping, shared-expert overlap) and for unknown or nested recompute modules."""
    recipe = recipe or Recipe.bf16()
    own = tuple(recompute_modules)
    bad = [m for m in own if m not in FP4MOE_RECOMPUTE_MODULES or m == "layernorm"]
    if bad:
        raise ConfigError(f"recompute_modules {bad}: fp4moe's own are moe_expert and self_attention (layernorm is "
                          "megatron's: put it in config.recompute_modules after api.prepare())")
    selective = config.recompute_granularity == "selective"
    nested = nested_in_self_attention(own, config.recompute_modules) if selective else []
    if nested:
        raise ConfigError(f"recompute module self_attention (the whole attention block) and config.recompute_modules "
                          f"{nested}, which lie inside it: keep one or the other")
    _check_recipe_parallel(recipe, config)
    return layer_spec(config, recipe, own)


def check_built_from_spec(model: Any, recipe: Any) -> None:
    """ConfigError unless ``model``'s modules are those :func:`decoder_block_spec` gives for ``recipe`` (the recipe's
    MoE layers, FP8 dense linears under all_linears, MXFP4-cache layers under recompute_cache_fp4; a pipeline stage
    without transformer layers passes): the recipe is in the spec, so a model built from another spec does not get it
    afterwards."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from fp4moe.model.recipe_dense import bf16_linears, fp8_linears
    from fp4moe.model.recipe_moe import RecipeMoELayer
    from fp4moe.model.recompute import MXFP4CacheTransformerLayer

    mods = list(model.modules())
    moe = [m for m in mods if isinstance(m, MoELayer)]
    layers = [m for m in mods if isinstance(m, TransformerLayer)]
    wrong = []
    if any(isinstance(m, RecipeMoELayer) != recipe_moe_layers(recipe) for m in moe):
        wrong.append("its MoE layers")
    # a pipeline stage without transformer layers (the paper's embedding-only first stage, 'E|...') has no such linears
    if layers and bool(fp8_linears(model) or bf16_linears(model)) != recipe.applies_to("dense"):
        wrong.append("its attention and dense-MLP linears")
    if any(isinstance(m, MXFP4CacheTransformerLayer) != recipe.recompute_cache_fp4 for m in layers):
        wrong.append("its layers' recompute caches")
    if wrong:
        raise ConfigError(f"the model was not built from the spec of recipe {recipe.tag!r} ({', '.join(wrong)} are "
                          "another recipe's): build it with transformer_layer_spec=decoder_block_spec(config, recipe, "
                          "...) and give finish() the same recipe")


def finish(model: Any, recipe: Any = None) -> list[str]:
    """After ``GPTModel(...)`` built from :func:`decoder_block_spec` of the same ``recipe`` (checked:
    :func:`check_built_from_spec`). The recipe itself is all in the spec; what ``finish`` adds is instrumentation of
    megatron's own MoE layers (the bf16 recipe's, which stay megatron's modules, so no spec carries it; the
    recipe's :class:`fp4moe.model.recipe_moe.RecipeMoELayer` does both itself): the routed-row counters of their
    dispatchers (:func:`count_routed_rows`) and a hook that drops what each dispatcher keeps once its layer's
    forward returns (:func:`release_dispatcher_after_forward`). Sets ``model.fp4moe_recipe`` and
    ``model.fp4moe_bf16_linears``; returns the dense linears left BF16 under all_linears (dims not multiples of
    128)."""
    from fp4moe.model.recipe_dense import bf16_linears

    recipe = recipe or Recipe.bf16()
    check_built_from_spec(model, recipe)
    model.fp4moe_recipe = recipe
    model.fp4moe_bf16_linears = bf16_linears(model)
    count_routed_rows(model)
    release_dispatcher_after_forward(model)
    return model.fp4moe_bf16_linears


def mtp_block_spec(config: Any, block: Any, recipe: Any = None):
    """megatron's local MTP block spec whose transformer layer is ``block``'s last (:func:`decoder_block_spec`'s
    result) and, under the recipe's ``scope: all_linears``, whose ``eh_proj`` is FP8 too. ``block`` is given whole:
    megatron's ``get_gpt_mtp_block_spec`` takes a single layer spec only if it is exactly ``TransformerLayer``'s,
    which the recipe's MXFP4-cache layer is not (fp4moe.model.recompute.MXFP4CacheTransformerLayer)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from fp4moe.model.recipe_dense import fp8_linear_spec

    recipe = recipe or Recipe.bf16()
    spec = get_gpt_mtp_block_spec(config, block, use_transformer_engine=False)
    if spec is None or not recipe.applies_to("dense"):
        return spec
    layers = []
    for layer in spec.layer_specs:
        layer = copy.copy(layer)
        layer.submodules = copy.copy(layer.submodules)
        layer.submodules.eh_proj = fp8_linear_spec(layer.submodules.eh_proj, recipe)
        layers.append(layer)
    spec.layer_specs = layers
    return spec


def build_gpt_model(cfg: Any, *, params_dtype: torch.dtype = torch.float32,
                    pre_process: bool | None = None, post_process: bool | None = None, settings: Any = None):
    """``GPTModel`` (MLA + MoE, local spec, SDPA core attention) for the composed config ``cfg`` (groups
    ``model``, ``parallel``, ``recompute``, ``precision``; no precision = bf16). ``settings``: the run's
    fp4moe.settings.Settings, whose Recipe and Recompute are used as they are (else parsed from ``cfg`` here).
    Applies the CPU shims when CUDA is absent. ``model.fp4moe_recipe``: the Recipe; ``model.fp4moe_bf16_linears``: dense linears left BF16 under
    ``scope: all_linears`` (dims not multiples of 128).

    Pipeline parallelism: this process's stage, as megatron-lm builds it. ``pre_process`` (embedding) and
    ``post_process`` (final norm, output layer, loss) default to megatron's parallel state (first / last pipeline
    stage); megatron's ``TransformerBlock`` builds the stage's layers (an even split of ``num_layers``, or
    ``parallel.pipeline_layout``'s), the MTP block only on the stage that holds it. Parameter names are megatron's
    module names, so a stage's layers are ``decoder.layers.0..`` locally (``layer_number`` stays global).

    Needs fp4moe's patches of megatron and torch held (``with prepare():`` or ``fp4moe.model.cpu_shims.active()``,
    for building and for training; ``fp4moe.train`` holds them for its run): RuntimeError otherwise."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank

    from fp4moe.model import cpu_shims

    if cpu_shims.depth() == 0:
        raise RuntimeError("build_gpt_model: fp4moe's patches of megatron-core and torch are not held; build and "
                           "train the model inside `with fp4moe.model.gpt_model.prepare():` (or "
                           "fp4moe.model.cpu_shims.active())")
    _clear_moe_log()
    model_cfg = cfg["model"]
    # the trainer's settings hold the recipe and the recompute scope already parsed and checked
    recipe = settings.precision if settings is not None else recipe_of(cfg)
    recompute = settings.recompute if settings is not None else recompute_of(cfg.get("recompute"))
    own = [m for m in fp4moe_recompute_modules(recompute) if m != "layernorm"]  # layernorm: megatron's
    config = transformer_config(model_cfg, cfg.get("parallel"), recompute, params_dtype=params_dtype,
                                precision_cfg=recipe)
    block = decoder_block_spec(config, recipe, tuple(own))
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    mtp = None
    if config.mtp_num_layers and mtp_on_this_rank(config, ignore_virtual=True):
        if not block.layer_specs:
            raise ConfigError("parallel.pipeline_layout puts the MTP block on a stage without decoder layers: "
                              "give that stage at least one 't' (e.g. '...|tmL')")
        mtp = mtp_block_spec(config, block, recipe)
    model = GPTModel(
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
    drop_unused_output_weight(model)
    finish(model, recipe)  # routed-row counters and the dispatcher release of megatron's own MoE layers (bf16)
    return model


def drop_unused_output_weight(model) -> None:
    """Remove ``output_layer.weight`` from a stage that megatron-core 0.16.1 gives one it never uses: with tied
    embeddings, a pipeline stage that holds the MTP block and the output layer but not the embedding computes the
    logits with its copy of the embedding (``shared_embedding_or_output_weight``), as megatron's own
    ``tie_embeddings_and_output_weights_state_dict`` says ("the output layer will not have any weight"), yet
    ``GPTModel`` allocates the output weight there all the same (``skip_weight_param_allocation`` only on the first
    stage). Left in place, that [vocab, hidden] weight gets no gradient, so DDP with ``overlap_grad_reduce``
    asserts at the next step (its bucket never becomes ready), every checkpoint save asserts in megatron's sharded
    state dict, and it costs its parameter, gradient and optimizer bytes for nothing."""
    if (model.share_embeddings_and_output_weights and getattr(model, "mtp_process", False) and model.post_process
            and not model.pre_process):
        model.output_layer.weight = None


def _moe_dispatchers(model):
    """(MoE layer, its token dispatcher) of every megatron ``MoELayer`` of ``model`` (ours are subclasses)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for m in model.modules():
        d = getattr(m, "token_dispatcher", None) if isinstance(m, MoELayer) else None
        if d is not None:
            yield m, d


def count_routed_rows(model) -> None:
    """Count, on every megatron MoE token dispatcher of ``model`` (the bf16 recipe's; the recipe's own dispatcher
    counts itself, ``QuantizedAlltoAllTokenDispatcher.fp4moe_rows``), the routed rows this rank's tokens send and
    the rows its local experts receive (``dispatcher.fp4moe_rows``; read with ``a2a_stats``), by wrapping the
    instance's ``token_dispatch``: post-build instrumentation, not precision. Their ratio is the routing's imbalance
    on this GPU, which sets the experts' memory under EP (fp4moe.scale.memory ``expert_rows_factor``). Row counts
    come from shapes: no device sync. Under full recompute the recomputed forward dispatches again and counts again
    (both sides; the ratio holds). Idempotent."""
    for _, d in _moe_dispatchers(model):
        if getattr(d, "fp4moe_rows", None) is not None:
            continue
        d.fp4moe_rows = {"sent": 0, "received": 0}

        def token_dispatch(tokens, probs, inner=d.token_dispatch, rows=d.fp4moe_rows):
            out = inner(tokens, probs)
            rows["sent"] += int(tokens.shape[0])
            rows["received"] += int(out[0].shape[0])
            return out

        d.token_dispatch = token_dispatch


def to_bf16_params(model: torch.nn.Module) -> torch.nn.Module:
    """Cast the model to BF16 as megatron-core's Float16Module does (torch.nn.RMSNorm weights would stay fp32
    otherwise), except the router's expert-bias state, which megatron keeps fp32 (router.py
    _maintain_float32_expert_bias), and the per-expert token counts (BF16 counts are exact only up to 256).
    In place; returns the model."""
    model.bfloat16()
    for mod in model.modules():
        for name in ("expert_bias", "local_tokens_per_expert"):
            buf = getattr(mod, name, None)
            if isinstance(buf, torch.Tensor):
                buf.data = buf.data.float()
    return model

def a2a_stats(model) -> dict[str, int]:
    """All-to-all payload bytes of every recipe MoE layer of ``model``, summed (``RecipeMoELayer.a2a_stats``;
    none under bf16, megatron's own dispatcher), and for every MoE layer the routed rows its tokens sent and its
    experts received (``dispatch_forward_sent_rows`` / ``_received_rows``, ``count_routed_rows``), summed."""
    from fp4moe.model.recipe_moe import RecipeMoELayer

    total: dict[str, int] = {}
    for m, d in _moe_dispatchers(model):
        stats = dict(m.a2a_stats()) if isinstance(m, RecipeMoELayer) else {}
        rows = getattr(d, "fp4moe_rows", None)
        if rows is not None:
            stats.update(dispatch_forward_sent_rows=rows["sent"], dispatch_forward_received_rows=rows["received"])
        for k, v in stats.items():
            total[k] = total.get(k, 0) + v
    return total


def release_dispatcher_after_forward(model) -> int:
    """Make every megatron ``MoELayer`` of ``model`` drop what its token dispatcher keeps (``DISPATCHER_STEP_TENSORS``)
    as soon as the layer's forward returns, as the recipe's ``RecipeMoELayer`` does by itself (a forward hook calling
    ``fp4moe.model.recipe_moe.release_after_forward``, which says why; post-build instrumentation of megatron's own
    modules, which a spec cannot carry without replacing them). Idempotent; returns how many layers got the hook.
    A layer's ``fp4moe_releases_dispatcher`` set False switches it off."""
    from fp4moe.model.recipe_moe import RELEASES_DISPATCHER

    n = 0
    for layer, _ in _moe_dispatchers(model):
        if not hasattr(layer, RELEASES_DISPATCHER):
            layer.register_forward_hook(_release_hook, with_kwargs=True)
            setattr(layer, RELEASES_DISPATCHER, True)
            n += 1
    return n


def _release_hook(layer, args, kwargs, output) -> None:
    from fp4moe.model.recipe_moe import release_after_forward

    release_after_forward(layer, kwargs.get("intermediate_tensors", args[1] if len(args) > 1 else None))


def release_dispatcher_tensors(model) -> int:
    """Drop what megatron's MoE token dispatchers (ours included) keep from their last forward
    (``DISPATCHER_STEP_TENSORS``); call after a step's backward passes. Returns how many were dropped.

    ``MoEAlltoAllTokenDispatcher`` stores the routing probabilities on itself (token_dispatcher.py:610) and keeps them
    until its next forward. Under full recompute that forward is the recomputation inside the backward, so the
    probabilities hold the recomputed graph, whose leaves are the layer's detached input and its gradient: two
    [seq, micro, hidden] activations per MoE layer stayed allocated from one step into the next (on the H200 proxy
    at micro-batch 16, a step under full recompute began with 1.5 GiB more than under the other scopes)."""
    from fp4moe.model.recipe_moe import drop_step_tensors

    return sum(drop_step_tensors(d) for _, d in _moe_dispatchers(model))


__all__ = ["transformer_config", "build_gpt_model", "drop_unused_output_weight", "to_bf16_params", "layer_spec",
           "mtp_block_spec", "recipe_of", "recipe_moe_layers", "recompute_of",
           "a2a_stats", "fp4moe_recompute_modules", "DISPATCHERS", "release_dispatcher_after_forward",
           "release_dispatcher_tensors", "count_routed_rows", "prepare", "Prepared", "decoder_block_spec", "finish",
           "check_built_from_spec"]
