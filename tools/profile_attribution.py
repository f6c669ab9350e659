#!/usr/bin/env python3
"""Where the GPU time of a torch.profiler trace goes (standard library only; reads .json or .json.xz).

    python tools/profile_attribution.py TRACE.json[.xz] [--top 25]
    python tools/profile_attribution.py TRACE.json --kernels 'fp4|fp8'    # those kernels by grid and caller
    python tools/profile_attribution.py A.json --compare B.json           # kernel time by name, A beside B
    python tools/profile_attribution.py TRACE.json --gaps 1               # where the GPU waits for the host

The traces come from the trainer's ``train.profile.steps`` (fp4moe/train/profile.py). Prints:
1. the GPU time (sum of the durations of kernels and of the copy engine's memcpys / memsets; the kernels' own sum
   beside it) and its split into groups (``group_of``): grouped FP8 GEMMs (fp4moe's Triton GEMMs), fp4moe's other
   kernels (conversions, SwiGLU, permutation sums, the weight quantizer; both by name from
   ``fp4moe_kernels.kernel_names``), DeepGEMM's GEMMs, cuBLAS GEMMs (``nvjet``/``gemm``/``cutlass``/``xmma``
   names), attention (cuDNN/flash ``sdpa``), memcpys and memsets (``Memcpy DtoD``, e.g. a ``clone`` of a
   contiguous tensor, which no kernel runs), and the rest (torch elementwise, copies, cat, index, reductions).
   Before 2026-12-06 the groups were by pattern alone: the BF16 SwiGLU kernels (``_swiglu_fwd_kernel``,
   ``_swiglu_bwd_kernel``), the permutation sums and the CUDA FP4RowToFP8Col were in the rest, DeepGEMM in cuBLAS
   (results/train_proxy/README.md's tables up to section 39);
2. the top (innermost aten op, its input shapes, the nearest enclosing non-aten frame, e.g. an autograd Function)
   by the GPU time of the kernels and memcpys it launched. Each is tied to the op through its launch's correlation
   id; ``--kernels`` matches memcpy / memset names too (e.g. ``'Memcpy DtoD'``).
``--gaps MS`` instead lists every stretch of at least MS ms with nothing on the GPU (no kernel, copy or memset):
when it began, how long, the GPU work that ended it and the host ops that ran meanwhile on the thread that launched
that work (longest overlap first): in a GPU-bound step these are the host's Python between a sync and the next
launch.
"""
from __future__ import annotations

import argparse
import collections
import json
import lzma
import re
import sys


def load(path: str) -> list[dict]:
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # what occupies the GPU: kernels, the copy engine's work


def gpu_events(ev: list[dict]) -> list[dict]:
    """The trace's GPU work: kernels, memcpys and memsets (``GPU_CATS``)."""
    return [e for e in ev if e.get("cat") in GPU_CATS]


def _kernel_kind():
    """fp4moe_kernels.kernel_names.kernel_kind, loaded from its file (standard library only, as this tool; importing
    the package would import torch)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "kernels" / "fp4moe_kernels" / "kernel_names.py"
    spec = importlib.util.spec_from_file_location("_fp4moe_kernel_names", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.kernel_kind


KERNEL_KIND = _kernel_kind()


def group_of(name: str, cat: str = "kernel") -> str:
    """The group of a GPU event: fp4moe's own kernels by name (``fp4moe_kernels.kernel_names``: its grouped GEMMs,
    and the rest: conversions, SwiGLU, permutation sums, the weight quantizer, the CUDA FP4RowToFP8Col), then
    DeepGEMM, cuBLAS and attention by pattern, then torch's."""
    if cat != "kernel":
        return "memcpys and memsets (copy engine)"
    own = KERNEL_KIND(name)
    if own == "gemm":
        return "grouped FP8 GEMMs (Triton)"
    if own is not None:
        return "fp4moe kernels (conversions, SwiGLU, sums)"
    low = name.lower()
    if "deep_gemm" in low:
        return "DeepGEMM GEMMs"
    if any(s in low for s in ("nvjet", "gemm", "cutlass", "xmma")):
        return "cuBLAS GEMMs"
    if "sdpa" in low or "flash" in low:
        return "attention (cuDNN)"
    return "torch elementwise / copy / cat / index / reductions"


def _cpu_ops_by_thread(ev: list[dict]) -> dict[int, list[dict]]:
    """thread id -> its ``cpu_op`` events."""
    ops = collections.defaultdict(list)
    for o in ev:
        if o.get("cat") == "cpu_op":
            ops[o["tid"]].append(o)
    return ops


def _launch_frames(ev: list[dict]) -> dict[int, list[str]]:
    """correlation id -> names of the CPU ops around the kernel's launch (cuda_runtime or cuda_driver event, same
    thread), innermost first."""
    ops = _cpu_ops_by_thread(ev)
    out = {}
    for r in ev:
        c = r.get("args", {}).get("correlation")
        if r.get("cat") not in ("cuda_runtime", "cuda_driver") or c is None:
            continue
        around = sorted((o for o in ops[r["tid"]] if o["ts"] <= r["ts"] <= o["ts"] + o["dur"]), key=lambda o: o["dur"])
        out[c] = [o["name"] for o in around]
    return out


def kernel_rows(ev: list[dict], pattern: str) -> list[tuple[str, str, str, float, int]]:
    """Kernels whose name matches the regular expression ``pattern``, aggregated by (name, grid, the nearest three
    non-aten frames around the launch): (name, grid, frames, total us, calls), largest total first."""
    frames = _launch_frames(ev)
    tot, cnt = collections.Counter(), collections.Counter()
    rx = re.compile(pattern)
    for k in gpu_events(ev):
        if not rx.search(k["name"]):
            continue
        fr = [f for f in frames.get(k.get("args", {}).get("correlation"), []) if not f.startswith("aten::")][:3]
        key = (k["name"], str(k.get("args", {}).get("grid", "")), " < ".join(fr) or "-")
        tot[key] += k["dur"]
        cnt[key] += 1
    return [(*key, us, cnt[key]) for key, us in tot.most_common()]


def kernel_time_by_name(ev: list[dict]) -> collections.Counter:
    """GPU time (us) per kernel (or memcpy / memset) name."""
    t = collections.Counter()
    for k in gpu_events(ev):
        t[k["name"]] += k["dur"]
    return t


def compare_rows(a: list[dict], b: list[dict]) -> list[tuple[str, float, float]]:
    """(kernel name, A us, B us) for every kernel name of either trace, largest |B - A| first."""
    ta, tb = kernel_time_by_name(a), kernel_time_by_name(b)
    names = set(ta) | set(tb)
    return sorted(((n, ta.get(n, 0.0), tb.get(n, 0.0)) for n in names), key=lambda r: (-abs(r[2] - r[1]), r[0]))


def idle_gaps(ev: list[dict], min_us: float) -> tuple[float, float, list[tuple[float, float, str, list[str]]]]:
    """(window us, idle us in all gaps, [(start us from the window's start, length us, next GPU op, host ops)] for
    the gaps of at least ``min_us``): the GPU timeline is the union of kernels, copies and memsets; host ops are
    the ``cpu_op`` events of the launching thread overlapping the gap, by overlap (longest first)."""
    gpu = sorted(gpu_events(ev), key=lambda e: e["ts"])
    if not gpu:
        return 0.0, 0.0, []
    launch_tid = {r["args"]["correlation"]: r["tid"] for r in ev
                  if r.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in r.get("args", {})}
    ops = _cpu_ops_by_thread(ev)
    t0, end, idle, out = gpu[0]["ts"], gpu[0]["ts"], 0.0, []
    for e in gpu:
        if e["ts"] > end:
            idle += e["ts"] - end
            if e["ts"] - end >= min_us:
                tid = launch_tid.get(e.get("args", {}).get("correlation"))
                over = sorted(((min(e["ts"], o["ts"] + o["dur"]) - max(end, o["ts"]), o["name"]) for o in ops.get(tid, [])
                               if o["ts"] < e["ts"] and o["ts"] + o["dur"] > end), reverse=True)
                out.append((end - t0, e["ts"] - end, e["name"], [f"{n} ({v / 1e3:.2f} ms)" for v, n in over]))
        end = max(end, e["ts"] + e["dur"])
    return end - t0, idle, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--kernels", metavar="REGEX", help="list the kernels matching REGEX by grid and calling frames")
    ap.add_argument("--compare", metavar="TRACE_B", help="kernel time per name of TRACE beside TRACE_B (and groups)")
    ap.add_argument("--gaps", metavar="MS", type=float, help="list the GPU's idle stretches of at least MS ms")
    a = ap.parse_args(argv)
    ev = load(a.trace)
    if a.gaps is not None:
        window, idle, gaps = idle_gaps(ev, a.gaps * 1e3)
        print(f"GPU idle {idle / 1e3:.1f} ms of a {window / 1e3:.1f} ms window; {len(gaps)} stretches of at least "
              f"{a.gaps:g} ms ({sum(g[1] for g in gaps) / 1e3:.1f} ms):")
        for start, length, nxt, host in gaps[: a.top]:
            print(f"  at {start / 1e3:8.1f} ms  {length / 1e3:6.2f} ms idle, then {nxt[:40]:40s} | host: "
                  f"{'; '.join(host[:3])[:120]}")
        return 0
    if a.kernels:
        rows = kernel_rows(ev, a.kernels)
        print(f"{len(rows)} (kernel, grid, frames) matching {a.kernels!r}, by GPU time:")
        for name, grid, fr, us, n in rows[: a.top]:
            print(f"  {us / 1e3:8.2f} ms {n:4d}x {us / n:8.0f} us  {name[:32]:32s} {grid:16s} {fr[:100]}")
        return 0
    if a.compare:
        other = load(a.compare)
        ga, gb = collections.Counter(), collections.Counter()
        for ev_, g in ((ev, ga), (other, gb)):
            for k in gpu_events(ev_):
                g[group_of(k["name"], k["cat"])] += k["dur"]
        print(f"GPU time (kernels, memcpys, memsets), A = {a.trace}, B = {a.compare} (ms):")
        for grp in sorted(set(ga) | set(gb), key=lambda x: -(ga[x] + gb[x])):
            print(f"  {ga[grp] / 1e3:9.1f} {gb[grp] / 1e3:9.1f} {(gb[grp] - ga[grp]) / 1e3:+9.1f}  {grp}")
        print(f"  {sum(ga.values()) / 1e3:9.1f} {sum(gb.values()) / 1e3:9.1f} {(sum(gb.values()) - sum(ga.values())) / 1e3:+9.1f}  total")
        print(f"\nkernels by |B - A| (ms), top {a.top}:")
        for name, ta, tb in compare_rows(ev, other)[: a.top]:
            print(f"  {ta / 1e3:9.2f} {tb / 1e3:9.2f} {(tb - ta) / 1e3:+9.2f}  {name[:110]}")
        return 0
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    if not kernels:
        print(f"{a.trace}: no GPU kernels in the trace (a CPU run?)", file=sys.stderr)
        return 1
    work = gpu_events(ev)
    total = sum(e["dur"] for e in work)
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    print(f"GPU time {total / 1e3:.1f} ms in a window of {span / 1e3:.1f} ms: {len(kernels)} kernels "
          f"{sum(e['dur'] for e in kernels) / 1e3:.1f} ms, {len(work) - len(kernels)} memcpys / memsets "
          f"{(total - sum(e['dur'] for e in kernels)) / 1e3:.1f} ms")
    groups = collections.Counter()
    for e in work:
        groups[group_of(e["name"], e["cat"])] += e["dur"]
    for g, v in groups.most_common():
        print(f"  {v / 1e3:9.1f} ms  {100 * v / total:5.1f} %  {g}")
    dur = {e["args"]["correlation"]: e["dur"] for e in work if "correlation" in e.get("args", {})}
    ops = _cpu_ops_by_thread(ev)
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
