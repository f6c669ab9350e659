"""Public API of the FP4 path: one function per conversion.

CUDA tensors run the Triton kernels (``fp4moe_kernels.triton_kernels``); CPU tensors run the reference
(``fp4moe_kernels.reference``), which is the specification the kernels match bit for bit. Inputs are
validated here, and errors name the fix.

``counts`` (optional, every conversion that emits FP8): tokens per expert, a sequence of ints or a 1-D
integer tensor (a device tensor costs one host synchronisation), any values >= 0 summing to M. Rows of
expert e are contiguous and experts are in order. No padding is needed on input. Outputs:
row formats keep one row per token (FP8 row scales are stored segment-major); the column format pads
each expert to a multiple of 128 tokens with zeros. See ``fp4moe_kernels.formats`` for every layout.
"""
from __future__ import annotations

import functools
import warnings

import torch

from . import reference as _ref
from . import switches
from .constants import FP8_GROUP, MX_BLOCK, SCALE_RULES
from .formats import FormatError, FP8ColTensor, FP8RowTensor, MXFP4Tensor, Segments, check_2d

_HIGH = (torch.bfloat16, torch.float32)


def _use_gpu(t: torch.Tensor) -> bool:
    """True for CUDA tensors (Triton kernels); they need FP8 conversion instructions (sm_89+)."""
    if not t.is_cuda:
        return False
    if torch.cuda.get_device_capability(t.device) < (8, 9):
        raise FormatError(
            f"{torch.cuda.get_device_name(t.device)} has no FP8 conversions (needs compute capability 8.9+, "
            "e.g. H100/H200): move the tensors to the CPU to use the reference implementation"
        )
    return True


def _kernels():
    from .triton_kernels import launchers  # imported lazily: triton is only needed for CUDA tensors

    return launchers


def _check_rule(rule: str) -> None:
    if rule not in SCALE_RULES:
        raise FormatError(f"scale rule {rule!r} is not one of {SCALE_RULES}")


def _check_fp4(a, name: str, k_multiple: int) -> None:
    if not isinstance(a, MXFP4Tensor):
        raise FormatError(f"{name} must be an MXFP4Tensor (make one with bf16_to_fp4_row), got {type(a).__name__}")
    if a.shape[1] % k_multiple != 0:
        raise FormatError(f"{name} has K={a.shape[1]}; this conversion needs K a multiple of {k_multiple}")


def bf16_to_fp4_row(x: torch.Tensor, rule: str = "ceil") -> MXFP4Tensor:
    """BF16ToFP4Row. x: ``[M, K]`` bfloat16 (float32 accepted), K % 32 == 0 -> MXFP4Tensor.

    On CUDA, float32 inputs are quantized from their float32 values, like the reference."""
    check_2d(x, "x", _HIGH, MX_BLOCK)
    _check_rule(rule)
    return _kernels().bf16_to_fp4_row(x, rule) if _use_gpu(x) else _ref.bf16_to_fp4_row(x, rule)


def fp4_to_bf16(a: MXFP4Tensor) -> torch.Tensor:
    """MXFP4 rows -> ``[M, K]`` bfloat16 (exact for every finite value inside the BF16 range)."""
    _check_fp4(a, "a", MX_BLOCK)
    return _kernels().fp4_to_bf16(a) if _use_gpu(a.data) else _ref.fp4_to_bf16(a)


def fp4_row_to_fp8_row(a: MXFP4Tensor, counts=None) -> FP8RowTensor:
    """FP4RowToFP8Row (fprop input of the FP8 GEMM), K % 128 == 0. Lossless when the four UE8M0 codes of
    a 128-group differ by <= 14; zeros stay zeros."""
    _check_fp4(a, "a", FP8_GROUP)
    seg = Segments.of(counts, a.shape[0])
    return _kernels().fp4_row_to_fp8_row(a, seg) if _use_gpu(a.data) else _ref.fp4_row_to_fp8_row(a, seg)


CUDA_COL_ENV = switches.ENV["cuda_col"]


def cuda_col_mode() -> str:
    """The ``cuda_col`` switch (``fp4moe_kernels.switches``; ``FP4MOE_CUDA_COL``): ``auto`` (the default) runs the
    CUDA C++ FP4RowToFP8Col where it can (a Hopper GPU and nvcc), ``1`` insists on it (a warning says why when it
    cannot run), ``0`` keeps the Triton kernel. ``switches.SwitchError`` (a ValueError) for another value."""
    return switches.current().cuda_col


@functools.cache
def _cuda_col_unavailable(insist: bool = False) -> str | None:
    """None if the CUDA C++ FP4RowToFP8Col builds and loads here (once per process), else why not. A warning says
    why it cannot run when ``insist`` (FP4MOE_CUDA_COL=1) or when nvcc is there and the build itself failed."""
    from . import cuda_kernels

    why = cuda_kernels.available()
    build_failed = False
    if why is None:
        try:
            cuda_kernels._lib("fp4_row_to_fp8_col")
        except Exception as e:  # noqa: BLE001 - any build or load failure: report it and keep the Triton kernel
            why = f"its build failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            build_failed = True
    if why and (insist or build_failed):
        warnings.warn(f"the CUDA C++ FP4RowToFP8Col cannot run: {why}; using the Triton kernel "
                      f"({CUDA_COL_ENV}=0 chooses it without this warning)", stacklevel=3)
    return why


def fp4_row_to_fp8_col(a: MXFP4Tensor, counts=None) -> FP8ColTensor:
    """FP4RowToFP8Col (wgrad operand): per expert ``[K, tokens]`` FP8, tokens padded to 128, one power-of-two
    scale per (channel, 128 tokens). Lossless when the exponent spread over the 128 tokens is <= 14.

    On CUDA it runs the CUDA C++ kernel (``fp4moe_kernels.cuda_kernels``: bit for bit the Triton kernel's output,
    1.8-1.9x its speed on an H200, +1 % mxfp4 training throughput on the H200 proxy: results/kernels/README.md)
    where it builds (Hopper, nvcc) and the inputs are aligned, else the Triton kernel; ``FP4MOE_CUDA_COL``
    (``cuda_col_mode``) chooses."""
    _check_fp4(a, "a", FP8_GROUP)
    seg = Segments.of(counts, a.shape[0])
    if not _use_gpu(a.data):
        return _ref.fp4_row_to_fp8_col(a, seg)
    mode = cuda_col_mode()
    if mode != "0":
        from . import cuda_kernels

        if cuda_kernels.col_input_problem(a) is None and _cuda_col_unavailable(mode == "1") is None:
            return cuda_kernels.fp4_row_to_fp8_col(a, seg)
    return _kernels().fp4_row_to_fp8_col(a, seg)


def fp8_row_to_fp4(f: FP8RowTensor, rule: str = "ceil") -> MXFP4Tensor:
    """FP8ToFP4: FP8 1x128 rows -> MXFP4 rows, equal to BF16ToFP4Row of the exact FP8 values."""
    if not isinstance(f, FP8RowTensor):
        raise FormatError(f"f must be an FP8RowTensor (make one with bf16_to_fp8_row), got {type(f).__name__}")
    _check_rule(rule)
    return _kernels().fp8_row_to_fp4(f, rule) if _use_gpu(f.data) else _ref.fp8_row_to_fp4(f, rule)


def bf16_to_fp8_row(x: torch.Tensor, counts=None) -> FP8RowTensor:
    """BF16 -> FP8 E4M3 1x128 rows (the FP8 recipe's activation quantizer), K % 128 == 0."""
    check_2d(x, "x", _HIGH, FP8_GROUP)
    seg = Segments.of(counts, x.shape[0])
    return _kernels().bf16_to_fp8_row(x, seg) if _use_gpu(x) else _ref.bf16_to_fp8_row(x, seg)


def bf16_to_fp8_col(x: torch.Tensor, counts=None) -> FP8ColTensor:
    """BF16 -> FP8 E4M3 transposed columns (the FP8 recipe's wgrad quantizer), K % 128 == 0."""
    check_2d(x, "x", _HIGH, FP8_GROUP)
    seg = Segments.of(counts, x.shape[0])
    return _kernels().bf16_to_fp8_col(x, seg) if _use_gpu(x) else _ref.bf16_to_fp8_col(x, seg)


def bf16_to_fp8_row_col(x: torch.Tensor, counts=None) -> tuple[FP8RowTensor, FP8ColTensor]:
    """One read of BF16 ``[M, K]`` (K % 128 == 0) -> (FP8 1x128 rows, FP8 transposed columns): the FP8 recipe's two
    copies of one operand, the same bits as ``bf16_to_fp8_row`` and ``bf16_to_fp8_col``."""
    check_2d(x, "x", _HIGH, FP8_GROUP)
    seg = Segments.of(counts, x.shape[0])
    if _use_gpu(x):
        return _kernels().bf16_to_fp8_row_col(x, seg)
    return _ref.bf16_to_fp8_row_col(x, seg)


def bf16_to_fp4_and_fp8_row(x: torch.Tensor, counts=None, rule: str = "ceil") -> tuple[MXFP4Tensor, FP8RowTensor]:
    """One read of BF16 ``[M, K]`` (K % 128 == 0) -> (MXFP4 rows to save, FP8 rows to compute with)."""
    check_2d(x, "x", _HIGH, FP8_GROUP)
    _check_rule(rule)
    seg = Segments.of(counts, x.shape[0])
    if _use_gpu(x):
        return _kernels().bf16_to_fp4_and_fp8_row(x, seg, rule)
    return _ref.bf16_to_fp4_and_fp8_row(x, seg, rule)


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
