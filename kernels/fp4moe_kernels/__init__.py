"""fp4moe_kernels: the FP4 path for Hopper GPUs (docs/formats.md).

MXFP4 (E2M1 elements, 32-element UE8M0 blocks) and FP8 E4M3 (1x128 / 128x128 power-of-two scales)
formats, their conversions, a pure-PyTorch reference (the specification, runs on CPU) and Triton
kernels that match it bit for bit on CUDA. Use the functions of ``fp4moe_kernels.convert``; they are
re-exported here.

Modules: ``constants`` (format numbers) and ``sizes`` (the formats' bytes from shapes), both torch-free;
``formats`` (typed containers, ragged ``Segments``), ``reference`` (the spec), ``convert`` (public API, validation,
device dispatch), ``triton_kernels`` (GPU kernels), ``cuda_kernels`` (CUDA C++), ``deepgemm`` (DeepGEMM's grouped
FP8 GEMM, an optional backend), ``selfcheck`` (kernels vs
reference on the present hardware), ``bench`` (the GPU benchmarks: ``bench.conversions``, ``bench.cuda_col``).

The re-exports and the submodules load on first use (PEP 562), so ``import fp4moe_kernels.constants`` or
``fp4moe_kernels.sizes`` does not import torch: the torch-free side of fp4moe (fp4moe.scale) counts bytes with them.
"""
from __future__ import annotations

import importlib

# re-exported name -> the submodule that defines it
_EXPORTS = {
    "FormatError": "formats",
    "FP8ColTensor": "formats",
    "FP8RowTensor": "formats",
    "MXFP4Tensor": "formats",
    "Segments": "formats",
    "bf16_to_fp4_and_fp8_row": "convert",
    "bf16_to_fp4_row": "convert",
    "bf16_to_fp8_col": "convert",
    "bf16_to_fp8_row": "convert",
    "bf16_to_fp8_row_col": "convert",
    "fp4_row_to_fp8_col": "convert",
    "fp4_row_to_fp8_row": "convert",
    "fp4_to_bf16": "convert",
    "fp8_row_to_fp4": "convert",
}
_SUBMODULES = ("bench", "constants", "convert", "cuda_kernels", "deepgemm", "formats",
               "reference", "selfcheck", "sizes", "triton_kernels")


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, *_SUBMODULES})


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
    "bf16_to_fp8_row_col",
    "fp4_row_to_fp8_col",
    "fp4_row_to_fp8_row",
    "fp4_to_bf16",
    "fp8_row_to_fp4",
]
