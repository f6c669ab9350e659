"""CUDA C++ kernels where Triton cannot place the data (see each ``.cu`` file's header), built on first use with
torch's extension loader (``torch.utils.cpp_extension.load``: needs ``nvcc`` and ``ninja``) into
``$FP4MOE_CUDA_BUILD`` (default ``~/.cache/fp4moe/cuda``), one folder per torch / CUDA version and per source text
(``build_name``), so that two copies of this package in one process (the kernel benchmark's ``--baseline``) each run
their own kernel. The library has no Python binding: it exports C functions that take device pointers and a CUDA
stream, called through ctypes.

Status: ``fp4moe_kernels.convert.fp4_row_to_fp8_col`` (and so the trainer) runs it by default where it builds (a
Hopper GPU and nvcc; ``FP4MOE_CUDA_COL``: ``auto``, ``1``, ``0``, see ``convert.cuda_col_mode``), since it measured
+1 % mxfp4 training throughput on the H200 proxy (results/kernels/README.md, 2026-12-01 third section).
``fp4_row_to_fp8_col`` is measured against the Triton kernel by ``python -m fp4moe_kernels.bench.cuda_col``
(results/kernels/cuda_col_h200_*.json: 1.8-1.9x) and tested bit for bit against the reference by
tests/kernels/test_cuda_col.py (GPU); tests/kernels/test_cuda_build.py compiles it for sm_90 wherever nvcc is
(CPU machines too).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
from pathlib import Path

import torch

from ..formats import FormatError, FP8ColTensor, MXFP4Tensor, Segments

SOURCES = {"fp4_row_to_fp8_col": Path(__file__).with_name("fp4_row_to_fp8_col.cu")}
# fp4_row_to_fp8_col: general path only; SWAR fast path + general fallback; the prmt fast path + general fallback;
# the same with four tiles per block (the next tile's loads in flight during the conversion); those two held to 96
# registers (5 blocks per SM instead of 4). The default, prmt4_b5, was the fastest bit-exact one measured side by side
# (1.20-1.25x swar on an H100, 2026-12-05: results/kernels/cuda_col_h100_2026-12-05_0156b2e.json, whose "triton" rows
# were swar too: results/kernels/README.md)
DEFAULT_VARIANT = "prmt4_b5"
VARIANTS = {"general": 0, "swar": 1, "prmt": 2, "prmt4": 3, "prmt_b5": 4, "prmt4_b5": 5}


def available() -> str | None:
    """None if the CUDA kernels can be built and run here, else why not (one line)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if torch.cuda.get_device_capability() < (9, 0):
        return f"{torch.cuda.get_device_name()} is not a Hopper GPU (the kernels are built for sm_90)"
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return "nvcc not found: put the CUDA toolkit's bin on PATH or set CUDA_HOME"
    return None


def build_name(name: str) -> str:
    """The library's module and folder name: ``fp4moe_<name>_<first 12 hex of the source's SHA-256>``. One name per
    source text: torch's loader names a rebuild from changed sources ``<name>_v1`` and a process keeps the first
    library it opened under a path, so a second copy of this package with another source (an older commit's, timed
    beside this one) would otherwise run this copy's kernel."""
    return f"fp4moe_{name}_{hashlib.sha256(SOURCES[name].read_bytes()).hexdigest()[:12]}"


@functools.cache
def _lib(name: str) -> ctypes.CDLL:
    why = available()
    if why:
        raise FormatError(f"the CUDA C++ kernel {name!r} cannot run here: {why}")
    from torch.utils import cpp_extension

    root = Path(os.environ.get("FP4MOE_CUDA_BUILD", Path.home() / ".cache" / "fp4moe" / "cuda"))
    mod = build_name(name)
    build = root / f"torch{torch.__version__}_cuda{torch.version.cuda}" / mod
    build.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=mod, sources=[str(SOURCES[name])], build_directory=str(build),
                       extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90"],
                       is_python_module=False, verbose=False)
    return ctypes.CDLL(str(build / f"{mod}.so"))


@functools.cache
def _col_fn():
    """The C entry point of fp4_row_to_fp8_col.cu, its ctypes signature set once."""
    fn = _lib("fp4_row_to_fp8_col").fp4moe_fp4_row_to_fp8_col
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def col_input_problem(a: MXFP4Tensor) -> str | None:
    """None if ``fp4_row_to_fp8_col`` takes ``a`` as it is, else what is wrong: K a multiple of 128, data and
    scales contiguous, data 16-byte and scales 2-byte aligned (its vector loads), fewer than 2**31 scale bytes."""
    if a.shape[1] % 128 or not (a.data.is_contiguous() and a.scales.is_contiguous()):
        return f"K={a.shape[1]} must be a multiple of 128 and data/scales contiguous"
    if a.data.data_ptr() % 16 or a.scales.data_ptr() % 2:
        return "data must be 16-byte and scales 2-byte aligned (make a copy)"
    if a.scales.numel() >= 2**31:
        return "scales must have fewer than 2**31 bytes (the kernel's scale offsets are int32)"
    return None


def fp4_row_to_fp8_col(a: MXFP4Tensor, seg: Segments, variant: str = DEFAULT_VARIANT) -> FP8ColTensor:
    """FP4RowToFP8Col by the CUDA C++ kernel: the same output as ``fp4moe_kernels.convert.fp4_row_to_fp8_col``.
    ``a`` on a CUDA device, as ``col_input_problem`` accepts it."""
    from ..triton_kernels.launchers import _col_tiles

    problem = col_input_problem(a)
    if problem:
        raise FormatError(f"fp4_row_to_fp8_col (CUDA): {problem}")
    k = a.shape[1]
    mp = seg.padded_total
    o = torch.empty(k * mp, dtype=torch.float8_e4m3fn, device=a.device)
    s = torch.empty(mp // 128, k, dtype=torch.float32, device=a.device)
    tiles = _col_tiles(seg, a.device)
    rc = _col_fn()(a.data.data_ptr(), a.scales.data_ptr(), o.data_ptr(), s.data_ptr(), tiles.data_ptr(),
                   tiles.shape[0], k, VARIANTS[variant], torch.cuda.current_stream(a.device).cuda_stream)
    if rc:
        raise RuntimeError(f"fp4_row_to_fp8_col (CUDA) launch failed: cudaError {rc}")
    return FP8ColTensor(o, s, seg, k)


__all__ = ["available", "col_input_problem", "fp4_row_to_fp8_col", "SOURCES", "VARIANTS"]
