#!/usr/bin/env python3
"""Where the GPU time of a torch.profiler trace goes (standard library only; reads .json or .json.xz).

    python tools/profile_attribution.py TRACE.json[.xz] [--top 25]

The traces come from the trainer's ``train.profile.steps`` (fp4moe/train/profile.py). Prints:
1. the GPU kernel time (sum of kernel durations) and its split into groups: grouped FP8 GEMMs (our Triton
   ``grouped_*`` kernels), cuBLAS GEMMs (``nvjet``/``gemm``/``cutlass``/``xmma`` names), attention (cuDNN/flash
   ``sdpa``), fp4moe conversion kernels (``*_kernel`` names with fp4/fp8/quantize), and the rest (torch
   elementwise, copies, cat, index, reductions);
2. the top (innermost aten op, its input shapes, the nearest enclosing non-aten frame, e.g. an autograd Function)
   by the GPU time of the kernels it launched. A kernel is tied to the op through its launch's correlation id.
"""
from __future__ import annotations

import argparse
import collections
import json
import lzma
import sys


def load(path: str) -> list[dict]:
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def group_of(name: str) -> str:
    low = name.lower()
    if name.startswith("grouped_"):
        return "grouped FP8 GEMMs (Triton)"
    if any(s in low for s in ("nvjet", "gemm", "cutlass", "xmma")):
        return "cuBLAS GEMMs"
    if "sdpa" in low or "flash" in low:
        return "attention (cuDNN)"
    if name.endswith("_kernel") and any(s in name for s in ("fp4", "fp8", "quantize")):
        return "fp4moe conversion kernels"
    return "torch elementwise / copy / cat / index / reductions"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    ev = load(a.trace)
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    if not kernels:
        print(f"{a.trace}: no GPU kernels in the trace (a CPU run?)", file=sys.stderr)
        return 1
    total = sum(e["dur"] for e in kernels)
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    print(f"GPU kernel time {total / 1e3:.1f} ms in a window of {span / 1e3:.1f} ms ({len(kernels)} kernels)")
    groups = collections.Counter()
    for e in kernels:
        groups[group_of(e["name"])] += e["dur"]
    for g, v in groups.most_common():
        print(f"  {v / 1e3:9.1f} ms  {100 * v / total:5.1f} %  {g}")
    dur = {e["args"]["correlation"]: e["dur"] for e in kernels if "correlation" in e.get("args", {})}
    ops = collections.defaultdict(list)
    for o in ev:
        if o.get("cat") == "cpu_op":
            ops[o["tid"]].append(o)
    agg, cnt = collections.Counter(), collections.Counter()
    for r in ev:
        c = r.get("args", {}).get("correlation")
        if r.get("cat") != "cuda_runtime" or c not in dur:
            continue
        around = [o for o in ops[r["tid"]] if o["ts"] <= r["ts"] <= o["ts"] + o["dur"]]
        if not around:
            continue
        around.sort(key=lambda o: o["dur"])
        frame = next((o["name"] for o in around if not o["name"].startswith("aten::")), "-")
        key = (around[0]["name"], str(around[0].get("args", {}).get("Input Dims", ""))[:80], frame[:40])
        agg[key] += dur[c]
        cnt[key] += 1
    print(f"\ntop {a.top} (op, enclosing frame, input shapes) by GPU time:")
    for (op, dims, frame), v in agg.most_common(a.top):
        print(f"  {v / 1e3:8.1f} ms {cnt[(op, dims, frame)]:5d}x  {op:28s} {frame:40s} {dims}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
