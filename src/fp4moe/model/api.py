"""The recipe in your own megatron-core training: three calls around your own ``GPTModel``.

    from fp4moe.model import api
    from fp4moe.recipe import Recipe

    with api.prepare():                             # fp4moe's patches of megatron / torch, while you build and train
        recipe = Recipe.preset("mxfp4")             # or Recipe.from_config({...}) / fp8 / bf16
        spec = api.decoder_block_spec(config, recipe, recompute_modules=("moe_expert",))
        model = GPTModel(config=config, transformer_layer_spec=spec, ...,  position_embedding_type="none")
        api.finish(model, recipe)                   # after building it, before training
        ...                                         # train

``config`` is your megatron-core 0.16.1 ``TransformerConfig`` / ``MLATransformerConfig`` (no Transformer Engine:
``fp4moe.model.gpt_model.transformer_config`` shows the settings fp4moe uses). The whole recipe is in the spec:
megatron's local decoder-block spec with fp4moe's SDPA core attention and, for fp8 / mxfp4, the recipe's MoE layer
(quantized all-to-all dispatcher, grouped FP8 experts with FP4-saved activations, FP8 shared expert, counters of the
routed rows), FP8 attention and dense-MLP linears under ``scope: all_linears``, layers with MXFP4 recompute caches
under ``recompute_cache_fp4``; parameter names and checkpoint keys stay megatron's, so a checkpoint moves between
recipes. With MTP, ``api.mtp_block_spec(config, spec, recipe)`` is megatron's MTP block spec on that spec.

``prepare()`` holds fp4moe's patches of megatron-core and torch (``fp4moe.model.cpu_shims``: the no-TE fixes, apex's
gradient-accumulation GEMMs, the checkpoint functions of the recompute modules, the CPU / gloo shims without CUDA)
from the call: ``with`` undoes them
all at the block's end; a bare ``api.prepare()`` keeps them for the rest of the process. ``finish`` checks that the
model was built from the recipe's spec and instruments megatron's own MoE layers (the bf16 recipe's: routed-row
counters, ``fp4moe.model.gpt_model.a2a_stats``; dropping what their dispatchers keep once each layer's forward returns).
examples/megatron_own_model.py runs all of it (CPU or GPU); tests/model/test_api.py runs that example.

Gradient-accumulation fusion: ``config.gradient_accumulation_fusion=True`` builds under ``prepare()`` without apex
(fp4moe stands in for its extension) and needs megatron DDP's ``main_grad``, as with apex; the recipe's routed
experts take it through ``fp4moe.ops.grouped_experts.fuse_wgrad_accumulation(their weights)`` after the DDP wrap
(``fp4moe.train.optim.fuse_wgrads`` does both for fp4moe's trainer).

Recompute: set megatron's own modules in ``config.recompute_modules`` as usual (``core_attn``, ``mla_up_proj``,
``mlp``; ``layernorm`` only under ``prepare()``, which fixes megatron's no-TE crash), and pass fp4moe's own
(``moe_expert``, ``self_attention``) as ``recompute_modules``.
"""
from __future__ import annotations

# The implementations live in fp4moe.model.gpt_model (its build_gpt_model makes the same calls); this module is the
# public door. Importing it imports megatron-core (build's layer spec).
from fp4moe.model.gpt_model import decoder_block_spec, finish, mtp_block_spec, prepare

__all__ = ["decoder_block_spec", "finish", "mtp_block_spec", "prepare"]
