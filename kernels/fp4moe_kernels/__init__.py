"""fp4moe_kernels: the FP4 path for Hopper GPUs (SPEC §2-3).

MXFP4 (E2M1 elements, 32-element UE8M0 blocks) and FP8 E4M3 (1x128 / 128x128 power-of-two scales)
formats, their conversions, a pure-PyTorch reference (the specification, runs on CPU) and Triton
kernels that match it bit for bit on CUDA. Use the functions of ``fp4moe_kernels.ops``; they are
re-exported here.

Modules: ``constants`` (format numbers), ``formats`` (typed containers, ragged ``Segments``),
``reference`` (the spec), ``ops`` (public API, validation, device dispatch), ``triton_kernels`` (GPU kernels),
``selfcheck`` (kernels vs reference on the present hardware), ``bench`` (GPU benchmark CLI).
"""
from .formats import FormatError, FP8ColTensor, FP8RowTensor, MXFP4Tensor, Segments
from .ops import (
    bf16_to_fp4_and_fp8_row,
    bf16_to_fp4_row,
    bf16_to_fp8_col,
    bf16_to_fp8_row,
    fp4_row_to_fp8_col,
    fp4_row_to_fp8_row,
    fp4_to_bf16,
    fp8_row_to_fp4,
)

__all__ = [
    "FormatError",
    "FP8ColTensor",
    "FP8RowTensor",
    "MXFP4Tensor",
    "Segments",
    "bf16_to_fp4_and_fp8_row",
    "bf16_to_fp4_row",
    "bf16_to_fp8_col",
    "bf16_to_fp8_row",
    "fp4_row_to_fp8_col",
    "fp4_row_to_fp8_row",
    "fp4_to_bf16",
    "fp8_row_to_fp4",
]
