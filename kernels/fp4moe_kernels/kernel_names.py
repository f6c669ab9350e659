"""The names under which this package's GPU kernels appear in a profile, and what each one is.

A profiler (``torch.profiler``, nsys) shows a Triton kernel by its function's name (``grouped_wgrad_tma_kernel``) and
the CUDA kernel as ``void <name><template arguments>(<parameter types>)``. The names are read from the package's
sources (every ``@triton.jit`` function named ``*_kernel`` in ``triton_kernels/``, every ``__global__`` function in
``cuda_kernels/``), so a new or renamed kernel is counted without a list to keep::

    kernel_kind("grouped_wgrad_tma_kernel")            # "gemm": defined in triton_kernels/gemm.py
    kernel_kind("void fp4_row_to_fp8_col<4>(...)")     # "other": conversions, SwiGLU, permutation sums, quantizers
    kernel_kind("nvjet_sm90_tst_128x256_64x4_...")     # None: not this package's (cuBLAS here)
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_TRITON = re.compile(r"^@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def (\w+_kernel)\(", re.M)
_CUDA = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")


@functools.cache
def kernel_names() -> dict[str, str]:
    """Every GPU kernel of the package -> ``"gemm"`` (the grouped FP8 GEMMs: the kernels of
    ``triton_kernels/gemm.py``) or ``"other"`` (every other kernel: conversions, SwiGLU, permutation sums, the weight
    quantizer, the CUDA FP4RowToFP8Col)."""
    names: dict[str, str] = {}
    for src in sorted((_HERE / "triton_kernels").glob("*.py")):
        for name in _TRITON.findall(src.read_text()):
            names[name] = "gemm" if src.name == "gemm.py" else "other"
    for src in sorted((_HERE / "cuda_kernels").glob("*.cu")):
        for name in _CUDA.findall(src.read_text()):
            names[name] = "other"
    return names


def kernel_kind(profiled: str) -> str | None:
    """``"gemm"`` / ``"other"`` for a kernel of this package as a profiler names it (see the module's examples),
    None for anyone else's."""
    name = profiled.strip().removeprefix("void ").split("<", 1)[0].split("(", 1)[0].strip()
    return kernel_names().get(name)
