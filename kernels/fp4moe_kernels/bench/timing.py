"""How the kernel benchmarks measure, and what each result records about its run (one CUDA GPU).

* :func:`do_bench`: median milliseconds per call over CUDA-graph replays (``TIMING["method"] = "events"``: plain
  CUDA events instead, the conversions benchmark's ``--timing events``);
* :func:`copy_bandwidth_gbps`: the device-to-device copy bandwidth of this GPU in this run, the yardstick every
  benchmark divides its GB/s by;
* :func:`environment`: date, commit, GPU, versions and the command, the ``env`` object of every results file;
* :func:`out_problem`: why ``--out`` cannot take the results, asked before any GPU time is spent.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

TIMING = {"method": "cuda-graph"}


def do_bench(fn, warmup_ms: int, rep_ms: int) -> float:
    """Median milliseconds per call. Replays of a CUDA graph of the call (``do_bench_cudagraph``: no host
    launch overhead, which otherwise dominates Python-heavy peers); falls back to plain CUDA-event timing
    (``do_bench``, L2 flushed between runs) when the call cannot be captured. Every input here is several
    times the 60 MB L2, so graph replays without a flush do not time the cache."""
    from triton.testing import do_bench as _db
    from triton.testing import do_bench_cudagraph as _dbg

    fn()  # warm-up outside any capture: compilation, autotuning, cached tables
    torch.cuda.synchronize()
    if TIMING["method"] == "cuda-graph":
        try:
            return float(_dbg(fn, rep=rep_ms, return_mode="median"))
        except Exception:  # noqa: BLE001 - not capturable: time with events instead
            torch.cuda.synchronize()
    return float(_db(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def copy_bandwidth_gbps(warmup_ms: int, rep_ms: int, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy of a 1 GiB BF16 tensor, counting bytes read + written (GB/s, 1e9): the best of
    graph-replay and plain-event timings, after 0.5 s of copies to bring the clocks up."""
    from triton.testing import do_bench as _db

    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    _db(lambda: dst.copy_(src), warmup=500, rep=50)
    ms = min(do_bench(lambda: dst.copy_(src), warmup_ms, rep_ms),
             float(_db(lambda: dst.copy_(src), warmup=warmup_ms, rep=rep_ms, return_mode="median")))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def out_problem(out: str | os.PathLike) -> str | None:
    """Why the results folder ``out`` cannot be created or written (its nearest existing ancestor is a file, or a
    folder this process cannot write), else None. Leaves nothing behind (an empty folder made there and removed:
    root passes every permission check, yet cannot write in /proc or an NFS export that squashes root): the
    benchmarks ask before measuring, so that a wrong ``--out`` costs no GPU time and no run ends with its results
    unwritten."""
    out = Path(out).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    what = ("is not a folder" if not existing.is_dir() else
            None if os.access(existing, os.W_OK | os.X_OK) and _can_create_in(existing) else "is not writable")
    return what and f"--out {out}: {existing} {what}; give a folder this process can create or write"


def _can_create_in(folder: Path) -> bool:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fp4moe-probe-", dir=folder))
    except OSError:
        return False
    return True


def gpu_file_name(gpu: str) -> str:
    """The GPU part of a benchmark's file names, from torch's device name: ``NVIDIA H100 80GB HBM3`` ->
    ``h100-80gb-hbm3``, ``NVIDIA H200`` -> ``h200``."""
    return gpu.replace("NVIDIA ", "").replace(" ", "-").lower()


def environment(command: str, commit: str | None) -> dict:
    """What a benchmark result records about its run: date, commit, GPU, versions and ``command`` (in this
    repository its machine's folders written portably: fp4moe.tracking.mlflow_store.portable, e.g. ``--out
    <repo>/results/kernels``; the kernels package used on its own, without fp4moe, records it as given)."""
    try:
        from fp4moe.tracking.mlflow_store import portable
    except ImportError:  # fp4moe_kernels stands alone: fp4moe sits above it
        def portable(text: str) -> str:
            return text

    def _git():
        try:
            return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    import triton

    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit or os.environ.get("FP4MOE_COMMIT") or _git() or "unknown",
        "gpu": torch.cuda.get_device_name(),
        "gpu_count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": portable(command),
    }
