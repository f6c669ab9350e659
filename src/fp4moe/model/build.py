"""fp4moe config -> megatron-core 0.16.1 ``MLATransformerConfig`` and ``GPTModel`` (MLA + MoE, no Transformer Engine).

The layer spec is megatron's local (torch-native) spec with ``core_attention`` swapped for
:class:`fp4moe.model.attention.SDPACoreAttention` (the local ``DotProductAttention`` rejects MLA's
``k_channels``/``v_channels``). Needs ``megatron.core.parallel_state.initialize_model_parallel`` to have run.

Precision (``cfg.precision`` -> ``Recipe.from_config``): bf16 builds megatron's own modules unchanged; fp8 and
mxfp4 swap the MoE layer, its dispatcher, routed experts and shared expert for the recipe's
(:mod:`fp4moe.model.recipe_moe`, parameter names unchanged), and with ``scope: all_linears`` route the attention
and dense-MLP linears through ``fp8_linear`` (:func:`apply_fp8_dense_linears`).

Recompute (``cfg.recompute``): ``megatron_modules`` go to megatron's ``recompute_modules``; ``fp4moe_modules``
are ours (:mod:`fp4moe.model.recompute`): ``layernorm`` (megatron's output-discarding norm checkpoint, fixed for
no-TE, cache MXFP4 under mxfp4) and ``moe_expert`` (routed experts only, no dispatch re-run).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from fp4moe.config import (DISPATCHERS, FP4MOE_RECOMPUTE_MODULES, MEGATRON_RECOMPUTE_MODULES, TE_ONLY_RECOMPUTE_MODULES,
                           ConfigError, nested_in_self_attention)
from fp4moe.model.attention import SDPACoreAttention
from fp4moe.recipe import Recipe


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
    bad = [m for m in own if m not in FP4MOE_RECOMPUTE_MODULES]
    if bad:
        raise ConfigError(f"recompute scope {name!r}: fp4moe_modules {bad} are not fp4moe recompute modules "
                          f"({', '.join(FP4MOE_RECOMPUTE_MODULES)})")
    if not mods and not own:
        raise ConfigError(f"recompute scope {name!r}: granularity selective with no modules; use granularity: null")
    nested = nested_in_self_attention(own, mods)
    if nested:
        raise ConfigError(f"recompute scope {name!r}: fp4moe_modules self_attention (the whole attention block) and "
                          f"megatron_modules {nested}, which lie inside it: keep one or the other")
    if "layernorm" in own:  # megatron's output-discarding norm checkpoint, made to work without TE (recompute.py)
        mods = mods + ["layernorm"]
    if not mods:
        return {}
    return {"recompute_granularity": "selective", "recompute_modules": mods}


def fp4moe_recompute_modules(recompute_cfg: Any) -> list[str]:
    """The ``recompute.fp4moe_modules`` that fp4moe implements itself ('layernorm', 'moe_expert', 'self_attention')."""
    r = _plain(recompute_cfg)
    return list(r.get("fp4moe_modules") or []) if r.get("granularity") == "selective" else []


def recipe_of(cfg: Any):
    """``Recipe.from_config(cfg['precision'])``; bf16 when the config has no precision group."""
    prec = cfg.get("precision") if hasattr(cfg, "get") else None
    return Recipe.from_config(prec) if prec is not None else Recipe.bf16()


def _check_recipe_parallel(recipe, config) -> None:
    if not recipe.fp8_compute:
        return
    if config.expert_tensor_parallel_size != 1 or config.tensor_model_parallel_size != 1:
        raise ConfigError(f"precision {recipe.name!r} needs parallel.tensor = parallel.expert_tensor = 1 (the "
                          "quantized dispatcher does not all-gather MXFP4 rows over TP); use precision=bf16 for TP")
    if config.moe_token_dispatcher_type != "alltoall":
        raise ConfigError(f"precision {recipe.name!r} needs parallel.dispatcher=alltoall (the recipe's quantized "
                          f"all-to-all), got {config.moe_token_dispatcher_type!r}")
    if config.moe_expert_capacity_factor is not None or config.moe_pad_expert_input_to_capacity:
        raise ConfigError(f"precision {recipe.name!r}: token dropping / capacity padding is not supported")
    if config.moe_shared_expert_overlap:
        raise ConfigError(f"precision {recipe.name!r}: moe_shared_expert_overlap is not supported")


def transformer_config(model_cfg: Any, parallel_cfg: Any = None, recompute_cfg: Any = None, *,
                       params_dtype: torch.dtype = torch.float32, precision_cfg: Any = None):
    """Build megatron-core's ``MLATransformerConfig`` from ``conf/model``, ``conf/parallel`` and ``conf/recompute``
    entries. Raises :class:`fp4moe.config.ConfigError` for what cannot run without TE (and, given
    ``precision_cfg``, for parallel settings the recipe's modules do not support)."""
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
        moe_router_pre_softmax=bool(moe.get("pre_softmax", False)),  # softmax before the top-k (DeepSeek-V2's)
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
        _check_recipe_parallel(Recipe.from_config(precision_cfg), config)
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


def _moe_spec(mlp_spec, recipe, moe_expert_recompute: bool):
    """The MoE layer spec for ``recipe`` (a copy; megatron's when bf16, with only the experts swapped for
    :class:`RecomputedSequentialMLP` under bf16 + moe_expert recompute)."""
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from fp4moe.model.recipe_moe import RecipeGroupedMLP, RecipeMoELayer, RecipeSharedExpertMLP
    from fp4moe.model.recompute import RecomputedSequentialMLP

    sub = mlp_spec.submodules
    experts, shared = sub.experts, sub.shared_experts
    if not recipe.fp8_compute:
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


def layer_spec(config, recipe=None, recompute_modules: tuple[str, ...] = ()):
    """megatron's local decoder-block spec (dense layers for the first ``first_k_dense``, MoE after) with our
    SDPA core attention in every layer's MLA and, for an fp8/mxfp4 ``recipe`` (fp4moe.recipe.Recipe; None =
    bf16), the recipe's MoE modules. ``recompute_modules``: fp4moe's own ('moe_expert' changes the experts,
    'self_attention' the attention module to :class:`fp4moe.model.recompute.RecomputedMLASelfAttention`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from fp4moe.model.recompute import RecomputedMLASelfAttention

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
        mlp = spec.submodules.mlp
        if getattr(mlp, "module", None) is MoELayer:
            spec.submodules.mlp = _moe_spec(mlp, recipe, "moe_expert" in recompute_modules)
        specs.append(spec)
    block.layer_specs = specs
    return block


def apply_fp8_dense_linears(model, recipe) -> list[str]:
    """``scope: all_linears``: the attention and dense-MLP linears (megatron ``ColumnParallelLinear`` /
    ``RowParallelLinear`` outside the MoE layers; not the embedding or output layer) compute through
    ``fp8_linear(..., layer_kind='dense')`` by overriding each instance's ``_forward_impl`` (MLA accepts only
    the exact linear classes, so the class stays, and so do parameter names). Linears whose in/out features are
    not multiples of 128 stay BF16. Returns the names of the linears left in BF16. TP = 1 only."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from fp4moe.ops.fp8_linear import fp8_linear

    if not recipe.applies_to("dense"):
        return []
    moe_prefixes = [n + "." for n, m in model.named_modules() if isinstance(m, MoELayer)]
    skipped = []

    def make_impl(rec):
        def impl(input, weight, bias=None, *args, **kwargs):
            y = fp8_linear(input, weight, rec, layer_kind="dense").to(input.dtype)
            return y if bias is None else y + bias
        return impl

    for name, mod in model.named_modules():
        if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)) or ".layers." not in f".{name}":
            continue
        if any(name.startswith(p) for p in moe_prefixes):
            continue
        n, k = mod.weight.shape
        if n % 128 or k % 128:
            skipped.append(name)
            continue
        mod._forward_impl = make_impl(recipe)
    return skipped


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


def finish(model: Any, recipe: Any = None) -> list[str]:
    """After ``GPTModel(...)``: FP8 through ``fp8_linear`` for the attention and dense-MLP linears when the recipe's
    scope is ``all_linears``, MXFP4 recompute caches inside every ``TransformerLayer`` when the recipe stores them
    (``recompute_cache_fp4``), the routed-row counters of every MoE dispatcher, and a hook that drops what each
    dispatcher keeps once its layer's forward returns (``release_dispatcher_after_forward``). Sets ``model.fp4moe_recipe``
    and ``model.fp4moe_bf16_linears``; returns the dense linears left BF16 (dims not multiples of 128)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from fp4moe.model import recompute as fp4moe_recompute

    recipe = recipe or Recipe.bf16()
    model.fp4moe_recipe = recipe
    model.fp4moe_bf16_linears = apply_fp8_dense_linears(model, recipe)
    if recipe.recompute_cache_fp4:
        for layer in model.modules():
            if isinstance(layer, TransformerLayer):
                fp4moe_recompute.cache_mxfp4_inside(layer)
    count_routed_rows(model)
    release_dispatcher_after_forward(model)
    return model.fp4moe_bf16_linears


def build_gpt_model(cfg: Any, *, params_dtype: torch.dtype = torch.float32,
                    pre_process: bool | None = None, post_process: bool | None = None):
    """``GPTModel`` (MLA + MoE, local spec, SDPA core attention) for the composed config ``cfg`` (groups
    ``model``, ``parallel``, ``recompute``, ``precision``; no precision = bf16). Applies the CPU shims when CUDA
    is absent. ``model.fp4moe_recipe``: the Recipe; ``model.fp4moe_bf16_linears``: dense linears left BF16 under
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
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank

    from fp4moe.model import cpu_shims

    if cpu_shims.depth() == 0:
        raise RuntimeError("build_gpt_model: fp4moe's patches of megatron-core and torch are not held; build and "
                           "train the model inside `with fp4moe.model.build.prepare():` (or "
                           "fp4moe.model.cpu_shims.active())")
    _clear_moe_log()
    model_cfg = cfg["model"]
    recipe = recipe_of(cfg)
    own = [m for m in fp4moe_recompute_modules(cfg.get("recompute")) if m != "layernorm"]  # layernorm: megatron's
    config = transformer_config(model_cfg, cfg.get("parallel"), cfg.get("recompute"), params_dtype=params_dtype,
                                precision_cfg=recipe.to_dict())
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
        mtp = get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False)
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
    finish(model, recipe)  # FP8 dense linears (all_linears), MXFP4 recompute caches, routed-row counters
    return model


def _moe_dispatchers(model):
    """(MoE layer, its token dispatcher) of every megatron ``MoELayer`` of ``model`` (ours are subclasses)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for m in model.modules():
        d = getattr(m, "token_dispatcher", None) if isinstance(m, MoELayer) else None
        if d is not None:
            yield m, d


def count_routed_rows(model) -> None:
    """Count, on every MoE layer's token dispatcher (megatron's for bf16, ours otherwise), the routed rows this
    rank's tokens send and the rows its local experts receive (``dispatcher.fp4moe_rows``; read with
    ``a2a_stats``). Their ratio is the routing's imbalance on this GPU, which sets the experts' memory under EP
    (fp4moe.scale.memory ``expert_rows_factor``). Row counts come from shapes: no device sync. Under full recompute
    the recomputed forward dispatches again and counts again (both sides; the ratio holds). Idempotent."""
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


# megatron's token dispatchers keep these from one forward for its combine; each holds the autograd graph it came from
DISPATCHER_STEP_TENSORS = ("probs", "routing_map")


def _drop_step_tensors(dispatcher) -> int:
    """Set the ``DISPATCHER_STEP_TENSORS`` a token dispatcher holds to None; returns how many it held."""
    n = 0
    for name in DISPATCHER_STEP_TENSORS:
        if getattr(dispatcher, name, None) is not None:
            setattr(dispatcher, name, None)
            n += 1
    return n


def _drop_dispatcher_tensors(layer, args, kwargs, output) -> None:
    """Forward hook of a MoE layer: its combine has run, so what its dispatcher kept for it is dead
    (``release_dispatcher_after_forward``). A partial forward (CUDA-graph capture with intermediate tensors, or an
    execution map other than the whole layer) keeps them for the calls that follow."""
    from fp4moe.model.recipe_moe import WHOLE_FORWARD

    partial = kwargs.get("intermediate_tensors", args[1] if len(args) > 1 else None) is not None
    if tuple(getattr(layer, "fwd_execution_map", WHOLE_FORWARD)) == WHOLE_FORWARD and not partial:
        _drop_step_tensors(layer.token_dispatcher)


def release_dispatcher_after_forward(model) -> int:
    """Make every MoE layer of ``model`` drop what its token dispatcher keeps (``DISPATCHER_STEP_TENSORS``) as soon as
    the layer's forward returns; idempotent. Returns how many layers got the hook.

    Under full recompute the forward that sets them last is the recomputation inside the backward: kept, the
    probabilities held that graph (the layer's detached input and its gradient, [seq, micro, hidden] each) until
    the step's backward had passed, so every MoE layer already differentiated kept two such tensors while the layers
    before it ran theirs (0.75 GiB at the H200 proxy's first MoE layer at micro-batch 16:
    results/train_proxy/memtrace_h200_mb16_e431a41/)."""
    n = 0
    for layer, _ in _moe_dispatchers(model):
        if not getattr(layer, "_fp4moe_drops_dispatcher_tensors", False):
            layer.register_forward_hook(_drop_dispatcher_tensors, with_kwargs=True)
            layer._fp4moe_drops_dispatcher_tensors = True
            n += 1
    return n


def release_dispatcher_tensors(model) -> int:
    """Drop what megatron's MoE token dispatchers (ours included) keep from their last forward
    (``DISPATCHER_STEP_TENSORS``); call after a step's backward passes. Returns how many were dropped.

    ``MoEAlltoAllTokenDispatcher`` stores the routing probabilities on itself (token_dispatcher.py:610) and keeps them
    until its next forward. Under full recompute that forward is the recomputation inside the backward, so the
    probabilities hold the recomputed graph, whose leaves are the layer's detached input and its gradient: two
    [seq, micro, hidden] activations per MoE layer stayed allocated from one step into the next (on the H200 proxy
    at micro-batch 16, a step under full recompute began with 1.5 GiB more than under the other scopes)."""
    return sum(_drop_step_tensors(d) for _, d in _moe_dispatchers(model))


__all__ = ["transformer_config", "build_gpt_model", "to_bf16_params", "layer_spec", "recipe_of", "apply_fp8_dense_linears", "a2a_stats",
           "fp4moe_recompute_modules", "DISPATCHERS", "release_dispatcher_after_forward", "release_dispatcher_tensors",
           "count_routed_rows"]
