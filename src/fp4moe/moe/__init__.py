"""fp4moe.moe: the recipe-aware MoE layer on plain torch / torch.distributed (no megatron-core).

``MoELayer``: fp32 top-k router, permutation by destination rank and local expert, quantized dispatch
all-to-all, grouped FP8 experts with FP4-saved activations, BF16 combine, optional shared expert.
"""
from .layer import MoELayer

__all__ = ["MoELayer"]
