"""fp4moe.ops: autograd-level building blocks on plain torch tensors (no megatron), over ``fp4moe_kernels``.

- ``fp8_gemm``: the 128x128 weight quantizer and ``fp8_mm``, the three blockwise FP8 GEMMs of a linear
  (fprop, dgrad, wgrad) over ``F.scaled_mm`` on CUDA, an exact-math emulation on CPU (docs/formats.md).
- ``fp8_linear``: ``FP8Linear`` / ``fp8_linear``, a linear whose GEMMs run in FP8 and whose saved input follows
  the recipe (FP8 row + column copies for fp8, MXFP4 for mxfp4's save_fp4), and ``linear_saved_bytes``.
- ``all_to_all``: ``quantized_all_to_all``, the expert-parallel all-to-all with an MXFP4 / FP8 / BF16 wire
  format forward and BF16 / FP8 backward, and its byte accounting (``A2AStats``, ``a2a_payload_bytes``).
- ``grouped_experts``: ``grouped_expert_mlp``, the routed experts of one rank over ragged per-expert counts
  (FP8 GEMM loop, weighted SwiGLU, saved tensors per recipe) and ``expert_saved_bytes``.
- ``swiglu``: the (unweighted) SwiGLU of dense/shared MLPs, saving its input as BF16 or MXFP4 per recipe.
- ``fp4_store``: ``fp4_saved_tensors()``, a saved-tensors context that keeps eligible saved activations as MXFP4
  (the generic mechanism for FP4 recompute caches).

Status: CPU-tested (gloo for the all-to-all) and GPU-tested on H200s (``F.scaled_mm`` layouts, the grouped
Triton GEMMs, NCCL with 2 GPUs): results/moe_layer/gpu_tests_*.log.
"""
from fp4moe_kernels.ops import cuda_col_mode

from .all_to_all import dispatch_quantize_mode
from .fp8_gemm import dequantize_weight_128x128, fp8_mm, quantize_weight_128x128, transpose_weight_128x128
from .fp8_linear import FP8Linear, fp8_linear, linear_saved_bytes, saved_bytes
from .grouped_experts import expert_saved_bytes, grouped_expert_mlp
from .fp4_store import FP4Store, fp4_saved_tensors
from .swiglu import swiglu


def check_env() -> None:
    """Read now the environment switches of the ops and kernels that a typo would otherwise break mid-run
    (``FP4MOE_CUDA_COL`` at the first backward, ``FP4MOE_DISPATCH_QUANTIZE`` at the model's build): a ValueError
    (``FormatError`` is one) naming the variable and its values. The trainer calls it among its config checks."""
    cuda_col_mode()
    dispatch_quantize_mode()


__all__ = [
    "FP4Store",
    "FP8Linear",
    "check_env",
    "dequantize_weight_128x128",
    "expert_saved_bytes",
    "fp4_saved_tensors",
    "fp8_linear",
    "fp8_mm",
    "grouped_expert_mlp",
    "linear_saved_bytes",
    "quantize_weight_128x128",
    "saved_bytes",
    "swiglu",
    "transpose_weight_128x128",
]
