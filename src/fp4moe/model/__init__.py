"""megatron-core glue (P3): everything megatron-specific lives in this package.

- :mod:`fp4moe.model.api`: the recipe in a ``GPTModel`` you configure yourself (prepare, decoder_block_spec, finish;
  examples/megatron_own_model.py)
- :mod:`fp4moe.model.gpt_model`: fp4moe config -> ``MLATransformerConfig`` / ``GPTModel`` (MLA + MoE, no TE)
- :mod:`fp4moe.model.attention`: SDPA core attention for MLA (q/k head dim != v head dim)
- :mod:`fp4moe.model.recipe_moe`: the precision recipe in megatron's MoE layer, a thin adapter over fp4moe.moe's data
  path (quantized all-to-all dispatcher, grouped FP8 experts, FP8 shared expert), parameter names unchanged
- :mod:`fp4moe.model.recipe_dense`: the recipe in the attention and dense MLPs (``scope: all_linears``): FP8
  subclasses of megatron's linears for the layer spec
- :mod:`fp4moe.model.recompute`: fp4moe's recompute modules (layernorm, moe_expert, self_attention) and the MXFP4
  recompute cache (a layer class of the spec)
- :mod:`fp4moe.model.cpu_shims`: every patch of megatron-core and torch (no TE; CPU / gloo when CUDA is absent),
  held only inside ``cpu_shims.active()`` (reference-counted; every original back on exit)
- :mod:`fp4moe.model.megatron_import`: megatron-core imported with its fused functions eager (CPU runs: ~3 s less
  per process)

Importing this package does not import megatron-core; the submodules do.
"""
