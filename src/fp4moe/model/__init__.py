"""megatron-core glue (P3): everything megatron-specific lives in this package.

- :mod:`fp4moe.model.build`: fp4moe config -> ``MLATransformerConfig`` / ``GPTModel`` (MLA + MoE, no TE)
- :mod:`fp4moe.model.attention`: SDPA core attention for MLA (q/k head dim != v head dim)
- :mod:`fp4moe.model.cpu_shims`: CPU/gloo shims, applied only when CUDA is absent

Importing this package does not import megatron-core; the submodules do.
"""
