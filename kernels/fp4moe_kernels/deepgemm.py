"""DeepGEMM's grouped FP8 GEMM as the expert GEMMs' fprop / dgrad backend (switch ``grouped_gemm=deepgemm``).

DeepGEMM (github.com/deepseek-ai/DeepGEMM; PyPI ``deepinfer-gemm``) is a persistent, warp-specialized Hopper
kernel library whose m-grouped contiguous FP8 GEMM computes, for every expert e, ``C_e = A_e B_e^T`` with the
same scales as ours (A: 1x128 FP32 per row, B: 128x128 FP32), at 0.89-1.07x of one dense ``F.scaled_mm`` of equal
work on an H200, where fp4moe's grouped Triton kernel reaches 0.46-0.53x (results/moe_layer/README.md, section
"DeepGEMM"). Its wgrad (k-grouped) kernel ran at 0.58x, so wgrad stays on ours.

Layout it needs: every expert's rows start at a multiple of :data:`ALIGN` (128) rows, i.e. the rows are in
*row-aligned segments*: ``Segments`` whose counts are all multiples of 128 (padding rows are zero; see
``fp4moe.ops.grouped_experts``, which pads the routed rows when this backend is on). Each row's expert index
(``m_indices``, int32) is built here from the segments; padding rows carry their expert's index, so they are
computed (as zeros) rather than skipped.

Where ``deep_gemm`` comes from, first found wins:

1. an installed package (``pip install deepinfer-gemm`` on a machine with nvcc and torch; it JIT-compiles its
   kernels with NVCC on first use and caches them under ``~/.deep_gemm``);
2. ``$FP4MOE_DEEPGEMM_DIR``: a folder written by ``python -m fp4moe_kernels.deepgemm build --sdist <sdist> --out
   <dir>``, which compiles the sdist's C++ extension with torch's extension loader (for machines without
   internet or pip builds; the GPU machines of this project). Its C++ includes elfutils' headers
   (``elfutils/libdwfl.h``; Debian: libdw-dev, libelf-dev); ``--headers`` points at them when the system has none.
   A process that loaded an older libstdc++ than the compiler's crashes in the extension's first ``std::regex``:
   start it with ``LD_PRELOAD=<the compiler's libstdc++.so.6>``.

:func:`available` / :func:`why_unavailable` say whether it loads (the reason names the fix); :func:`load` returns
the module or raises :class:`DeepGEMMUnavailable`.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path

import torch

from .constants import FP8_GROUP
from .formats import FormatError, FP8RowTensor, Segments, host_to_device

ALIGN = 128  # rows per block of DeepGEMM's m-grouped contiguous layout (get_mk_alignment_for_contiguous_layout)
ENV_DIR = "FP4MOE_DEEPGEMM_DIR"


class DeepGEMMUnavailable(RuntimeError):
    """``deep_gemm`` cannot be imported here; the message says why and how to get it."""


def _from_dir(folder: Path):
    """Import ``deep_gemm`` from a folder :func:`build` wrote (``src/`` the unpacked package, ``build/_C.so``)."""
    so = folder / "build" / "_C.so"
    pkg = next(iter(sorted((folder / "src").glob("deepinfer_gemm-*"))), None)
    if not so.is_file() or pkg is None:
        raise DeepGEMMUnavailable(f"${ENV_DIR}={folder} is not a DeepGEMM build (no build/_C.so or src/deepinfer_gemm-*): "
                                  f"write it with python -m fp4moe_kernels.deepgemm build --sdist <sdist> --out {folder}")
    spec = importlib.util.spec_from_file_location("deep_gemm._C", so)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    sys.modules["deep_gemm._C"] = ext
    for name in dir(ext):  # pybind submodules: deep_gemm imports `from ._C.<submodule> import ...`
        if type(getattr(ext, name)) is type(ext):
            sys.modules[f"deep_gemm._C.{name}"] = getattr(ext, name)
    sys.path.insert(0, str(pkg))
    import deep_gemm

    return deep_gemm


@functools.lru_cache(maxsize=1)
def _load():
    """(module, None) or (None, why)."""
    try:
        import deep_gemm  # an installed deepinfer-gemm

        return deep_gemm, None
    except ImportError as exc:
        installed_err = f"{type(exc).__name__}: {exc}"
    folder = os.environ.get(ENV_DIR)
    if not folder:
        return None, (f"DeepGEMM is not installed ({installed_err}) and ${ENV_DIR} is not set: pip install "
                      f"deepinfer-gemm (needs nvcc), or build its sdist with python -m fp4moe_kernels.deepgemm build "
                      f"--sdist deepinfer_gemm-<v>.tar.gz --out <dir> and export {ENV_DIR}=<dir>")
    try:
        return _from_dir(Path(folder)), None
    except DeepGEMMUnavailable as exc:
        return None, str(exc)
    except Exception as exc:  # a broken build: say what failed, not a traceback from inside the import
        return None, f"DeepGEMM from ${ENV_DIR}={folder} did not import: {type(exc).__name__}: {exc}"


def why_unavailable() -> str | None:
    """None when ``deep_gemm`` loads, else why not and the fix (one line)."""
    if not torch.cuda.is_available():
        return "DeepGEMM needs a CUDA GPU (Hopper)"
    return _load()[1]


def available() -> bool:
    return why_unavailable() is None


def load():
    """The ``deep_gemm`` module; :class:`DeepGEMMUnavailable` naming the fix when it cannot be imported."""
    why = why_unavailable()
    if why:
        raise DeepGEMMUnavailable(f"kernels.grouped_gemm=deepgemm: {why} (or use grouped_gemm=triton)")
    return _load()[0]


# ----------------------------------------------------------------------------------------------- the GEMM


def row_aligned(seg: Segments) -> bool:
    """Whether every segment's rows start at a multiple of :data:`ALIGN` (all counts are multiples of it)."""
    return all(c % ALIGN == 0 for c in seg.counts)


@functools.lru_cache(maxsize=4)
def expert_of_rows(seg: Segments, device: torch.device) -> torch.Tensor:
    """m_indices int32 ``[M]``: each row's expert (DeepGEMM's grouped layout), built on ``device``. Cached for the
    last few segmentations: one micro-batch's fc1 / fc2 fprop and dgrad share one."""
    return seg.row_segments(device)


@functools.lru_cache(maxsize=4)
def _scale_chunks(seg: Segments, groups: int, device: torch.device) -> torch.Tensor:
    """int64 ``[groups * M/128]``: for the MN-major scale matrix ``[groups, M]`` read as 128-float chunks, chunk
    ``(kb, t)`` (k-block kb, row tile t of 128 rows) is chunk ``groups * T0_e + kb * n_e + (t - T0_e)`` of the
    segment-major scales, where tile t lies in expert e, which starts at tile T0_e and has n_e tiles (row-aligned
    segments: no tile spans two experts). Built with a few device ops whatever the expert count."""
    n = host_to_device(torch.tensor([c // ALIGN for c in seg.counts], dtype=torch.int64), device)
    t0 = torch.cumsum(n, 0) - n
    tiles = seg.total // ALIGN
    e = torch.repeat_interleave(torch.arange(seg.num, device=device), n, output_size=tiles)
    t = torch.arange(tiles, device=device)
    first = (groups - 1) * t0[e] + t                    # = groups * T0_e + (t - T0_e)
    kb = torch.arange(groups, device=device)[:, None]
    return (first[None, :] + kb * n[e][None, :]).reshape(-1)


def mn_major_scales(a: FP8RowTensor) -> torch.Tensor:
    """fp4moe's segment-major row scales (segment e's ``[K/128, m_e]`` block after segment e-1's, as
    ``FP8RowTensor.segment`` reads them) as one ``[K/128, M]`` matrix, DeepGEMM's SM90 (MN-major) scale layout. On
    row-aligned segments one gather of 128-float chunks (:func:`_scale_chunks`, an index of ``K/128 * M/128``
    entries: 15 MB at 4M rows and K 7168), else a concatenation of the segments' blocks."""
    seg, groups = a.segments, a.data.shape[1] // FP8_GROUP
    if not row_aligned(seg):
        return torch.cat([a.segment(e)[1].t() for e in range(seg.num)], dim=1)
    chunks = a.scales.view(-1, ALIGN).index_select(0, _scale_chunks(seg, groups, a.scales.device))
    return chunks.view(groups, seg.total)


def m_grouped_rows(a: FP8RowTensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """C ``[M, N]`` = per expert e ``A_e @ B_e^T`` (DeepGEMM ``m_grouped_fp8_gemm_nt_contiguous``), the same
    contract as ``triton_kernels.launchers.grouped_fp8_rows``: a an ``FP8RowTensor`` ``[M, K]`` over E row-aligned
    segments (counts multiples of :data:`ALIGN`), b ``[E, N, K]`` E4M3, b_scale ``[E, N/128, K/128]`` float32."""
    seg = a.segments
    if not row_aligned(seg):
        raise FormatError(f"DeepGEMM's grouped GEMM needs every expert's row count a multiple of {ALIGN}, got "
                          f"{[c for c in seg.counts if c % ALIGN][:4]}...: pad the rows (fp4moe.ops.grouped_experts does)")
    if out_dtype != torch.bfloat16:
        raise FormatError(f"DeepGEMM's grouped GEMM writes bfloat16, asked for {out_dtype}")
    m, k = a.data.shape
    e, n, _ = b.shape
    out = torch.empty(m, n, dtype=out_dtype, device=a.data.device)
    if m == 0 or n == 0:
        return out
    sfa = mn_major_scales(a).t()  # [M, K/128] with strides (1, M): MN-major, as DeepGEMM's SM90 kernel reads it
    load().m_grouped_fp8_gemm_nt_contiguous((a.data, sfa), (b, b_scale), out, expert_of_rows(seg, a.data.device))
    return out


# --------------------------------------------------------------------------------------- building the sdist


def build(sdist: Path, out: Path, headers: Path | None = None) -> float:
    """Compile DeepGEMM's sdist into ``out`` (``src/`` the unpacked sources with CUTLASS / CuTe where the package
    looks for them, ``build/_C.so`` the extension, compiled with torch's extension loader); returns the seconds it
    took. ``headers``: a folder with elfutils' development headers when the system has none."""
    from torch.utils.cpp_extension import CUDA_HOME, load as load_extension

    t0 = time.time()
    src_root, build_dir = out / "src", out / "build"
    src_root.mkdir(parents=True, exist_ok=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tf:
        tf.extractall(src_root, filter="data")
    src = next(iter(sorted(src_root.glob("deepinfer_gemm-*"))))
    inc = src / "deep_gemm" / "include"
    for d in ("cute", "cutlass"):  # setup.py copies these next to the package's own headers (the JIT reads them)
        if not (inc / d).exists():
            shutil.copytree(src / "third-party" / "cutlass" / "include" / d, inc / d)
    (src / "deep_gemm" / "envs.py").write_text("persistent_envs = dict()\n")  # setup.py writes this file
    abi = int(torch.compiled_with_cxx11_abi())
    load_extension(name="_C", sources=[str(src / "csrc" / "python_api.cpp")],
                   extra_include_paths=[*([str(headers)] if headers else []), f"{CUDA_HOME}/include",
                                        f"{CUDA_HOME}/include/cccl", str(inc),
                                        str(src / "third-party" / "deep_jit" / "include"),
                                        str(src / "third-party" / "cutlass" / "include")],
                   extra_cflags=["-std=c++20", "-O3", "-fPIC", "-Wno-psabi", "-Wno-deprecated-declarations",
                                 f"-D_GLIBCXX_USE_CXX11_ABI={abi}"],
                   extra_ldflags=[f"-L{CUDA_HOME}/lib64", "-lcudart"], build_directory=str(build_dir),
                   with_cuda=True, verbose=False)
    return time.time() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m fp4moe_kernels.deepgemm",
                                description="Build DeepGEMM's sdist (PyPI deepinfer-gemm) for fp4moe's grouped_gemm="
                                            "deepgemm switch, or check that it loads.")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the sdist into --out; then export FP4MOE_DEEPGEMM_DIR=<out>")
    b.add_argument("--sdist", required=True, type=Path, help="deepinfer_gemm-<v>.tar.gz")
    b.add_argument("--out", required=True, type=Path, help="folder to write (src/, build/_C.so)")
    b.add_argument("--headers", type=Path, default=None,
                   help="elfutils development headers (elfutils/libdwfl.h) when the system has none")
    sub.add_parser("check", help="say whether deep_gemm loads (exit 1 with the reason if not)")
    args = p.parse_args(argv)
    if args.cmd == "build":
        if not args.sdist.is_file():
            p.error(f"--sdist {args.sdist}: no such file (download it: pip download --no-deps --no-binary :all: "
                    "deepinfer-gemm)")
        secs = build(args.sdist, args.out, args.headers if args.headers and args.headers.is_dir() else None)
        print(f"built DeepGEMM in {secs:.0f} s: export {ENV_DIR}={args.out.resolve()}")
        return
    why = why_unavailable()
    if why:
        sys.exit(f"DeepGEMM unavailable: {why}")
    print(f"DeepGEMM loads: {load().__file__}")


if __name__ == "__main__":
    main()
