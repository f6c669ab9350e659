"""``python -m fp4moe_kernels.bench.cuda_col``: FP4RowToFP8Col by the CUDA C++ kernel (each variant) against the
Triton kernel (``triton_kernels.launchers``, called directly: ``convert.fp4_row_to_fp8_col`` itself runs the CUDA
default where it builds), side by side in one run, with the copy bandwidth measured in the same run (one Hopper GPU).

Prints microseconds per call (CUDA-graph replays), GB/s over the conversion's minimum bytes, % of the copy
bandwidth and the speed-up over Triton; writes ``<out>/cuda_col_<gpu>_<date>_<commit>.json`` (``<gpu>`` as the
conversion benchmark names it, e.g. ``h100-80gb-hbm3``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .. import convert as ops
from ..triton_kernels import launchers
from ..cuda_kernels import VARIANTS, available, fp4_row_to_fp8_col
from .conversions import default_shapes, min_bytes
from .timing import copy_bandwidth_gbps, do_bench, environment, gpu_file_name, out_problem


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4moe_kernels.bench.cuda_col", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/kernels")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--warmup-ms", type=int, default=25)
    ap.add_argument("--rep-ms", type=int, default=50)
    a = ap.parse_args(argv)
    why = out_problem(a.out)
    if why:  # before the build and the timings
        ap.error(why)
    why = available()
    if why:
        print(f"fp4moe_kernels.bench.cuda_col: {why}", file=sys.stderr)
        return 2
    env = environment("python -m fp4moe_kernels.bench.cuda_col " + " ".join(argv or sys.argv[1:]), a.commit)
    copy = copy_bandwidth_gbps(a.warmup_ms, a.rep_ms)
    print(f"copy bandwidth {copy:.0f} GB/s")
    rows = []
    for shape in default_shapes():
        x = torch.randn(shape.m, shape.k, device="cuda", dtype=torch.bfloat16)
        q = ops.bf16_to_fp4_row(x)
        seg = shape.seg
        impls = {"triton": lambda: launchers.fp4_row_to_fp8_col(q, seg)}
        impls.update({f"cuda {v}": (lambda v=v: fp4_row_to_fp8_col(q, seg, v)) for v in VARIANTS})
        base = None
        for name, fn in impls.items():
            us = do_bench(fn, a.warmup_ms, a.rep_ms) * 1e3
            gbps = min_bytes("fp4_row_to_fp8_col", shape.m, shape.k, seg) / (us * 1e-6) / 1e9
            base = base or us
            rows.append(dict(shape=shape.name, impl=name, us=us, gbps=gbps, pct_copy=100 * gbps / copy, vs_triton=base / us))
            print(f"{shape.name:>24s} {name:14s} {us:8.1f} us {gbps:6.0f} GB/s {100 * gbps / copy:5.1f} % copy "
                  f"{base / us:5.2f}x Triton")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cuda_col_{gpu_file_name(env['gpu'])}_{env['date'][:10]}_{env['commit'][:7]}.json"
    path.write_text(json.dumps({"env": env, "copy_gbps": copy, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
