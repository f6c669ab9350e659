"""The recipe in your own megatron-core training: three calls around your own ``GPTModel``.

    from fp4moe.model import api
    from fp4moe.recipe import Recipe

    api.prepare()                                   # once per process, before building the model
    recipe = Recipe.preset("mxfp4")                 # or Recipe.from_config({...}) / fp8 / bf16
    spec = api.decoder_block_spec(config, recipe, recompute_modules=("layernorm", "moe_expert"))
    model = GPTModel(config=config, transformer_layer_spec=spec, ...,  position_embedding_type="none")
    api.finish(model, recipe)                       # after building it, before training

``config`` is your megatron-core 0.16.1 ``TransformerConfig`` / ``MLATransformerConfig`` (no Transformer Engine:
``fp4moe.model.build.transformer_config`` shows the settings fp4moe uses). The spec is megatron's local decoder-block
spec with fp4moe's SDPA core attention and, for fp8 / mxfp4, the recipe's MoE layer (quantized all-to-all
dispatcher, grouped FP8 experts with FP4-saved activations, FP8 shared expert); parameter names and checkpoint keys
stay megatron's, so a checkpoint moves between recipes. ``finish`` applies what needs the built model: FP8 dense
linears under ``scope: all_linears``, MXFP4 recompute caches under mxfp4, the routed-row counters
(``fp4moe.model.build.a2a_stats``). examples/megatron_own_model.py runs all of it (CPU or GPU); tests/model/
test_api.py runs that example.

Recompute: set megatron's own modules in ``config.recompute_modules`` as usual (``core_attn``, ``mla_up_proj``,
``mlp``; ``layernorm`` only together with ``prepare()``, which fixes megatron's no-TE crash), and pass fp4moe's own
(``moe_expert``, ``self_attention``) as ``recompute_modules``.
"""
from __future__ import annotations

from typing import Any

from fp4moe.config import FP4MOE_RECOMPUTE_MODULES, ConfigError, nested_in_self_attention


def prepare() -> None:
    """Process-wide set-up before a model is built: the CPU/gloo shims when CUDA is absent, fp4moe's fixed
    megatron checkpoints (the no-TE output-discarding checkpoint, the optional MXFP4 recompute cache), and an empty
    megatron per-layer MoE aux-loss log (process-global, sized by the first model that logs). Idempotent."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from fp4moe.model import cpu_shims
    from fp4moe.model import recompute as fp4moe_recompute

    cpu_shims.apply()
    get_moe_layer_wise_logging_tracker().clear()
    fp4moe_recompute.install()


def decoder_block_spec(config: Any, recipe: Any = None, recompute_modules: tuple[str, ...] = ()):
    """megatron-core's local decoder-block spec for ``config`` with the recipe inside (``recipe``: a
    ``fp4moe.recipe.Recipe``; None = bf16, megatron's own MoE path) and fp4moe's own recompute modules
    (``moe_expert``, ``self_attention``; ``layernorm`` goes in ``config.recompute_modules``). Raises ConfigError
    for what the recipe's modules do not support (TP or expert-TP > 1, a dispatcher other than alltoall, token
    dropping, shared-expert overlap) and for unknown or nested recompute modules."""
    from fp4moe.model.build import _check_recipe_parallel, layer_spec
    from fp4moe.recipe import Recipe

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
    from fp4moe.model.build import apply_fp8_dense_linears, count_routed_rows, release_dispatcher_after_forward
    from fp4moe.recipe import Recipe

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


__all__ = ["decoder_block_spec", "finish", "prepare"]
