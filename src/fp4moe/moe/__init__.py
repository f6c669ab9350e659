"""fp4moe.moe: the MoE data path under a precision recipe, on plain torch / torch.distributed (no megatron-core).

- :mod:`fp4moe.moe.dispatch`: the row operations, router output -> permutation 1 -> dispatch all-to-all ->
  permutation 2 and back -> combine all-to-all -> un-permutation (quantized wire formats, split sizes)
- :mod:`fp4moe.moe.experts`: the routed experts (grouped, optional recompute) and the shared expert
- :mod:`fp4moe.moe.layer`: ``MoELayer``, a standalone layer (fp32 top-k router + the path above) for the benchmark
  (:mod:`fp4moe.bench.moe_layer`) and the tests; megatron's MoE layer runs the same path in training
  (``fp4moe.model.recipe_moe``, a thin adapter)
"""
from .layer import MoELayer

__all__ = ["MoELayer"]
