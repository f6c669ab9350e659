"""Kernel benchmark (docs/training.md, issue P1 part E): ``python -m fp4moe_kernels.bench.conversions --help``.

For every conversion at 32768x7168 (one segment, and ragged over 32 experts) and 32768x2048 (ragged over
32 experts; --tokens / --experts change these) it measures the median time per call over CUDA-graph
replays after a warm-up call (``--timing events``: plain CUDA events, ``triton.testing.do_bench``), the
achieved GB/s counted from the *minimum* bytes the conversion must read and write, and that as a
percentage of the device-to-device copy bandwidth measured in the same run (before and after the
kernels; the higher is used). ``--sweep`` first times several tile / warp configs per kernel and uses
the fastest. Side by side in the same run:

* the unfused round trip the fused kernels replace: MXFP4 -> BF16 in HBM -> FP8 with torch ops, eager and
  ``torch.compile``d (each stage its own graph, so BF16 goes through memory, like separate
  quantize/dequantize ops), plus the whole round trip compiled as one graph;
* torchao's peers when torchao is importable: ``to_mx`` to MXFP4 (compiled) against BF16ToFP4Row, and
  torchao's blockwise-FP8 Triton quantizers against our BF16 -> FP8 row / column.

Then the expert-weight quantizer (``launchers.quantize_weight_128x128``, 128x128 FP8 blocks and the transposed
copy W_e^T) at DeepSeek-V3's expert weights: ``--experts`` x fc1 ``[4096, 7168]`` and x fc2 ``[7168, 2048]``, each
a refill with the transpose, bytes counted as read 2 B/elem + written 1 B/elem and 4 B per 128x128 scale per copy.

Writes ``kernels_<gpu>_<date>_<commit>.{json,csv,md}`` into ``--out``. Needs a CUDA GPU (sm_89+).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import torch

from .. import convert as ops
from .. import switches
from ..formats import MXFP4Tensor, Segments
from ..selfcheck import make_counts
from . import timing
from .timing import copy_bandwidth_gbps, do_bench, environment, gpu_file_name, out_problem

# ----------------------------------------------------------------------------------------- bytes


def min_bytes(kernel: str, m: int, k: int, seg: Segments) -> int:
    """Fewest bytes a conversion must move: each input read once, each output written once."""
    fp4 = m * k // 2 + m * k // 32  # data + UE8M0 scales
    fp8_row = m * k + 4 * m * k // 128
    mp = seg.padded_total
    fp8_col = k * mp + 4 * k * mp // 128
    bf16 = 2 * m * k
    return {
        "bf16_to_fp4_row": bf16 + fp4,
        "fp4_to_bf16": fp4 + bf16,
        "fp4_row_to_fp8_row": fp4 + fp8_row,
        "fp4_row_to_fp8_col": fp4 + fp8_col,
        "fp8_row_to_fp4": fp8_row + fp4,
        "bf16_to_fp8_row": bf16 + fp8_row,
        "bf16_to_fp8_col": bf16 + fp8_col,
        "bf16_to_fp4_and_fp8_row": bf16 + fp4 + fp8_row,
        "bf16_to_fp8_row_col": bf16 + fp8_row + fp8_col,
    }[kernel]


@dataclass
class WeightShape:
    """``experts`` expert weights ``[n, k]`` bf16, stacked as one ``[experts * n, k]`` tensor."""

    name: str
    experts: int
    n: int
    k: int


def default_weight_shapes(experts: int = 32) -> list[WeightShape]:
    """DeepSeek-V3's expert weights: fc1 ``[4096, 7168]`` (gate and up) and fc2 ``[7168, 2048]``, per expert."""
    return [WeightShape(f"{experts}x[4096,7168] +T", experts, 4096, 7168),
            WeightShape(f"{experts}x[7168,2048] +T", experts, 7168, 2048)]


def weight_bytes(shape: WeightShape, transpose: bool = True) -> int:
    """Fewest bytes of one refill: the bf16 weights read once (2 B/elem), each FP8 copy written once (1 B/elem and
    a float32 scale per 128x128 block); two copies with ``transpose`` (W and every W_e^T)."""
    el = shape.experts * shape.n * shape.k
    return 2 * el + (2 if transpose else 1) * (el + 4 * el // (128 * 128))


BASELINE_MODULE = "fp4moe_kernels_baseline"  # the first baseline's package name; the n-th (n >= 1) adds _<n>


def baseline_weight_quantizer(name: str = BASELINE_MODULE):
    """The loaded baseline ``name``'s ``launchers.quantize_weight_128x128`` (see ``load_baseline``), or None where
    that package predates it (or is not loaded)."""
    import importlib

    try:
        mod = importlib.import_module(f"{name}.triton_kernels.launchers")
    except ImportError:
        return None
    return getattr(mod, "quantize_weight_128x128", None)


def _weight_fns(shape: WeightShape, w: torch.Tensor, quantize=None) -> dict:
    """kernel -> callable refilling the FP8 copies of ``w`` (``[experts * n, k]`` bf16) with this package's
    launcher (or ``quantize``, a baseline's)."""
    if quantize is None:
        from ..triton_kernels.launchers import quantize_weight_128x128 as quantize
    return {"quantize_weight_128x128": lambda: quantize(w, shape.n, transpose=True)}


# ------------------------------------------------------------------- unfused torch-op round trips

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def torch_fp4_to_bf16(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantize MXFP4 with plain torch ops (the 'separate dequantize' of the round trip)."""
    m = data.shape[0]
    lut = torch.tensor(_E2M1, dtype=torch.float32, device=data.device)
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(m, -1, 32).long()
    s = torch.exp2(scales.float() - 127).unsqueeze(-1)
    return (lut[codes] * s).reshape(m, -1).to(torch.bfloat16)


def torch_bf16_to_fp8_row(x: torch.Tensor):
    """Quantize to FP8 1x128 rows with torch ops (power-of-two scales; the 'separate quantize')."""
    m, k = x.shape
    xg = x.float().reshape(m, k // 128, 128)
    amax = xg.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (xg / scale).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(m, k)
    return q, scale.reshape(m, k // 128).t().contiguous()


def torch_bf16_to_fp8_col(x: torch.Tensor):
    """FP8 of x^T [K, M] with 1x128 scales along tokens, torch ops (M a multiple of 128: pad first)."""
    return torch_bf16_to_fp8_row(x.t().contiguous())


def pad_index(seg: Segments, device) -> torch.Tensor:
    """Destination row of every token in the 128-padded per-expert layout (for the ragged torch baseline)."""
    idx = [p + i for r0, c, p in zip(seg.offsets, seg.counts, seg.padded_offsets) for i in range(c)]
    return torch.tensor(idx, dtype=torch.long, device=device)


def torch_pad(x: torch.Tensor, dest: torch.Tensor, mp: int) -> torch.Tensor:
    return torch.zeros(mp, x.shape[1], dtype=x.dtype, device=x.device).index_copy_(0, dest, x)


@dataclass
class Row:
    """One timed implementation of one conversion at one shape."""

    shape: str
    kernel: str
    impl: str  # "fp4moe" | "torch eager (unfused)" | ... | "torchao ..."
    ms: float
    bytes: int  # minimum bytes of the conversion (same for every impl of it)
    gbps: float = 0.0
    pct_copy: float = 0.0
    note: str = ""
    extra: dict = field(default_factory=dict)


@dataclass
class Shape:
    name: str
    m: int
    k: int
    counts: list[int] | None

    @property
    def seg(self) -> Segments:
        return Segments.of(self.counts, self.m)


def default_shapes(tokens: int = 32768, experts: int = 32, seed: int = 0) -> list[Shape]:
    return [
        Shape(f"{tokens}x7168", tokens, 7168, None),
        Shape(f"{tokens}x7168 ragged {experts}e", tokens, 7168, make_counts(tokens, experts, seed, zero_frac=0.1)),
        Shape(f"{tokens}x2048 ragged {experts}e", tokens, 2048, make_counts(tokens, experts, seed + 1, zero_frac=0.1)),
    ]


def baseline_problem(path: str) -> str | None:
    """Why ``path`` is not a copy of this package that ``--baseline`` can load, else None (asked before GPU work)."""
    if os.path.isfile(os.path.join(path, "__init__.py")) and os.path.isfile(os.path.join(path, "formats.py")):
        return None
    return (f"--baseline {path}: no fp4moe_kernels package there (__init__.py and formats.py); give the unpacked "
            "fp4moe_kernels folder of the other commit (git archive <commit> kernels/fp4moe_kernels | tar x)")


def load_baseline(path: str, name: str = BASELINE_MODULE):
    """An older copy of this package (e.g. ``git archive <commit> kernels/fp4moe_kernels``, unpacked) imported
    under another name (``name``: one per copy, so that several load side by side), so that its kernels run side
    by side with these in one process: (convert, formats)."""
    import importlib
    import importlib.util

    why = baseline_problem(path)
    if why:
        raise FileNotFoundError(why)
    init = os.path.join(path, "__init__.py")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    # the public API's module: convert.py, ops.py before the rename (issue P9)
    api = "convert" if os.path.isfile(os.path.join(path, "convert.py")) else "ops"
    return importlib.import_module(f"{name}.{api}"), importlib.import_module(f"{name}.formats")


def _ours(shape: Shape, x, a: MXFP4Tensor, f, lib=None, fmt=None):
    """kernel -> callable of this package's ``convert`` (or of a baseline's ``lib``/``fmt``, on the same inputs)."""
    counts = shape.counts
    if lib is not None:
        a = fmt.MXFP4Tensor(a.data, a.scales, a.shape)
        f = fmt.FP8RowTensor(f.data, f.scales, fmt.Segments.of(counts, shape.m))
    else:
        lib = ops
    fns = {
        "bf16_to_fp4_row": lambda: lib.bf16_to_fp4_row(x),
        "fp4_to_bf16": lambda: lib.fp4_to_bf16(a),
        "fp4_row_to_fp8_row": lambda: lib.fp4_row_to_fp8_row(a, counts),
        "fp4_row_to_fp8_col": lambda: lib.fp4_row_to_fp8_col(a, counts),
        "fp8_row_to_fp4": lambda: lib.fp8_row_to_fp4(f),
        "bf16_to_fp8_row": lambda: lib.bf16_to_fp8_row(x, counts),
        "bf16_to_fp8_col": lambda: lib.bf16_to_fp8_col(x, counts),
        "bf16_to_fp4_and_fp8_row": lambda: lib.bf16_to_fp4_and_fp8_row(x, counts),
    }
    if hasattr(lib, "bf16_to_fp8_row_col"):  # copies of commits before it have none
        fns["bf16_to_fp8_row_col"] = lambda: lib.bf16_to_fp8_row_col(x, counts)
    return fns


def _round_trips(shape: Shape, a: MXFP4Tensor):
    """name -> (kernel it competes with, callable) for the unfused MXFP4 -> BF16 -> FP8 round trips."""
    seg = shape.seg
    ragged = shape.counts is not None
    dest = pad_index(seg, a.device) if ragged else None
    mp = seg.padded_total

    def row_eager():
        return torch_bf16_to_fp8_row(torch_fp4_to_bf16(a.data, a.scales))

    def col_eager():
        x = torch_fp4_to_bf16(a.data, a.scales)
        return torch_bf16_to_fp8_col(torch_pad(x, dest, mp) if ragged else x)

    deq_c = torch.compile(torch_fp4_to_bf16)
    row_c = torch.compile(torch_bf16_to_fp8_row)
    col_c = torch.compile(torch_bf16_to_fp8_col)
    pad_c = torch.compile(torch_pad)

    def row_compiled():
        return row_c(deq_c(a.data, a.scales))

    def col_compiled():
        x = deq_c(a.data, a.scales)
        return col_c(pad_c(x, dest, mp) if ragged else x)

    whole_row = torch.compile(lambda d, s: torch_bf16_to_fp8_row(torch_fp4_to_bf16(d, s)))
    return {
        "torch eager (unfused)": [("fp4_row_to_fp8_row", row_eager), ("fp4_row_to_fp8_col", col_eager)],
        "torch.compile (unfused, BF16 in HBM)": [("fp4_row_to_fp8_row", row_compiled), ("fp4_row_to_fp8_col", col_compiled)],
        "torch.compile (one graph)": [("fp4_row_to_fp8_row", lambda: whole_row(a.data, a.scales))],
    }


def _peers(x):
    """torchao peers (name -> (kernel it competes with, callable)), or a reason they are missing."""
    try:
        from .peers import torchao_peers
    except ImportError as e:  # pragma: no cover - depends on the machine
        return {}, f"torchao peers unavailable: {e}"
    try:
        peers = torchao_peers()
    except Exception as e:  # noqa: BLE001 - report any import/setup failure of the optional peer
        return {}, f"torchao peers unavailable: {type(e).__name__}: {e}"
    out = {}
    for name, (kernel, make) in peers.items():
        out[name] = (kernel, make(x))
    return out, ""


def run(shapes: list[Shape], warmup_ms: int, rep_ms: int, peers: bool = True, log=print,
        baselines=(), weight_shapes=()) -> tuple[float, list[Row], list[str]]:
    """Every kernel on every shape (and, for each of ``baselines`` = (label, convert, formats, package name), that
    copy's kernels), then the weight quantizer on every ``weight_shapes`` (``WeightShape``; each baseline's too where
    it has one)."""
    copy = copy_bandwidth_gbps(warmup_ms, rep_ms)
    log(f"copy bandwidth (1 GiB bf16 D2D, read+write): {copy:.0f} GB/s")
    rows: list[Row] = []
    notes: list[str] = []
    for shape in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(shape.m, shape.k, device="cuda", dtype=torch.bfloat16, generator=g)
        a = ops.bf16_to_fp4_row(x)
        f = ops.bf16_to_fp8_row(x, shape.counts)
        seg = shape.seg

        def add(kernel, impl, fn, note=""):
            ms = do_bench(fn, warmup_ms, rep_ms)
            nb = min_bytes(kernel, shape.m, shape.k, seg)
            gbps = nb / (ms * 1e-3) / 1e9
            rows.append(Row(shape.name, kernel, impl, ms, nb, gbps, 100 * gbps / copy, note))
            log(f"  {shape.name:>24} {kernel:>24} {impl:<38} {ms * 1e3:9.1f} us {gbps:7.0f} GB/s {100 * gbps / copy:5.1f}%")

        for kernel, fn in _ours(shape, x, a, f).items():
            add(kernel, "fp4moe", fn)
        # what the fused row + column quantizer replaces: the two kernels, each reading x
        add("bf16_to_fp8_row_col", "fp4moe row, then col (two kernels)",
            lambda: (ops.bf16_to_fp8_row(x, shape.counts), ops.bf16_to_fp8_col(x, shape.counts)))
        for label, bops, bfmt, _ in baselines:
            for kernel, fn in _ours(shape, x, a, f, bops, bfmt).items():
                add(kernel, f"fp4moe {label}", fn)
        for impl, items in _round_trips(shape, a).items():
            for kernel, fn in items:
                add(kernel, impl, fn)
        if peers:
            peer_fns, why = _peers(x)
            if why and why not in notes:
                notes.append(why)
                log(why)
            for impl, (kernel, fn) in peer_fns.items():
                if shape.counts is not None and kernel.endswith("_col"):
                    continue  # torchao's column quantizer has no ragged segments: dense shape only
                add(kernel, impl, fn)
        del x, a, f
        torch.cuda.empty_cache()
    if weight_shapes:
        bases = []
        for label, _, _, name in baselines:
            quantize = baseline_weight_quantizer(name)
            if quantize is None:
                notes.append(f"baseline {label} has no launchers.quantize_weight_128x128: weight rows without it")
                log(notes[-1])
            else:
                bases.append((label, quantize))
        rows += run_weights(weight_shapes, copy, warmup_ms, rep_ms, bases, log)
    return copy, rows, notes


def run_weights(shapes: list[WeightShape], copy: float, warmup_ms: int, rep_ms: int, baselines=(), log=print,
                device="cuda") -> list[Row]:
    """The weight quantizer on every shape (random bf16 weights, seed 0) and, for each of ``baselines`` = (label,
    quantize), that baseline's launcher beside it; % of ``copy`` GB/s."""
    rows = []
    for shape in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(shape.experts * shape.n, shape.k, device=device, dtype=torch.bfloat16, generator=g)
        nb = weight_bytes(shape)
        impls = [("fp4moe", _weight_fns(shape, w))]
        impls += [(f"fp4moe {label}", _weight_fns(shape, w, quantize)) for label, quantize in baselines]
        for impl, fns in impls:
            for kernel, fn in fns.items():
                ms = do_bench(fn, warmup_ms, rep_ms)
                gbps = nb / (ms * 1e-3) / 1e9
                rows.append(Row(shape.name, kernel, impl, ms, nb, gbps, 100 * gbps / copy))
                log(f"  {shape.name:>24} {kernel:>24} {impl:<38} {ms * 1e3:9.1f} us {gbps:7.0f} GB/s "
                    f"{100 * gbps / copy:5.1f}%")
        del w
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def sweep(shape: Shape, warmup_ms: int, rep_ms: int, kernels=None, log=print) -> list[dict]:
    """Time each kernel (all, or ``kernels``) under several (tile, warps) configs; one record per config.
    Leaves the launcher's TILES unchanged (see ``adopt_best``)."""
    from ..triton_kernels import launchers

    x = torch.randn(shape.m, shape.k, device="cuda", dtype=torch.bfloat16)
    a = ops.bf16_to_fp4_row(x)
    f = ops.bf16_to_fp8_row(x, shape.counts)
    fns = _ours(shape, x, a, f)
    out = []
    saved = dict(launchers.TILES)
    try:
        for kernel, fn in fns.items():
            if kernels and kernel not in kernels:
                continue
            if kernel == "bf16_to_fp8_row_col":  # 128 tokens x 128 channels per program, in chunks of BN channels
                configs = [(bn, 0, w) for bn in (32, 64, 128) for w in (1, 2, 4, 8)]
            elif kernel.endswith("_col"):
                configs = [(32, 0, 1), (32, 0, 2), (32, 0, 4), (64, 0, 2), (64, 0, 4), (64, 0, 8), (128, 0, 4), (128, 0, 8)]
            elif kernel in ("bf16_to_fp4_row", "fp4_to_bf16"):  # R = 32-element blocks per program
                configs = [(r, 0, w) for r in (32, 64, 128, 256) for w in (2, 4, 8)]
            else:  # R = 128-element groups per program; FP8RowToFP4, FP4RowToFP8Row and the fused kernel (BF16
                # input) hold one group per thread, so R = 32 * warps there (smaller R repeats work across threads)
                configs = [(16, 0, 2), (16, 0, 4), (32, 0, 2), (32, 0, 4), (32, 0, 8), (64, 0, 4), (64, 0, 8),
                           (32, 0, 1), (64, 0, 2), (128, 0, 4), (256, 0, 8)]
            for t in configs:
                launchers.TILES[kernel] = t
                try:
                    ms = do_bench(fn, warmup_ms, rep_ms)
                except Exception as e:  # noqa: BLE001 - a config may exceed resources; record and go on
                    out.append(dict(kernel=kernel, tile=list(t), ms=None, error=str(e)[:200]))
                    continue
                gbps = min_bytes(kernel, shape.m, shape.k, shape.seg) / (ms * 1e-3) / 1e9
                out.append(dict(kernel=kernel, tile=list(t), ms=ms, gbps=gbps))
                log(f"  sweep {kernel:>24} tile {t}: {ms * 1e3:8.1f} us {gbps:6.0f} GB/s")
            launchers.TILES[kernel] = saved[kernel]
    finally:
        launchers.TILES.update(saved)
    return out


def adopt_best(sweep_rows: list[dict]) -> dict:
    """Set the launcher's TILES to the fastest swept config of each kernel; return what was set."""
    from ..triton_kernels import launchers

    best = {}
    for r in sweep_rows:
        if r.get("ms") is not None and (r["kernel"] not in best or r["ms"] < best[r["kernel"]]["ms"]):
            best[r["kernel"]] = r
    for kernel, r in best.items():
        launchers.TILES[kernel] = tuple(r["tile"])
    return {k: list(v["tile"]) for k, v in best.items()}


# --------------------------------------------------------------------------------------- output


def summary(rows: list[Row]) -> list[dict]:
    """One line per (shape, kernel): our time, GB/s, % copy and the ratio over every other implementation."""
    out = []
    for r in rows:
        if r.impl != "fp4moe":
            continue
        line = {"shape": r.shape, "kernel": r.kernel, "us": round(r.ms * 1e3, 1), "GB/s": round(r.gbps),
                "% copy": round(r.pct_copy, 1)}
        for o in rows:
            if o.shape == r.shape and o.kernel == r.kernel and o.impl != "fp4moe":
                line[f"x vs {o.impl}"] = round(o.ms / r.ms, 2)
        out.append(line)
    return out


def markdown(env: dict, copy: float, rows: list[Row], notes: list[str]) -> str:
    lines = [
        f"# Kernel benchmark: {env['gpu']}",
        "",
        f"Measured {env['date']} at commit `{env['commit']}` on {env['gpu']} (torch {env['torch']}, triton "
        f"{env['triton']}, CUDA {env['cuda']}). Command: `{env['command']}`.",
        "",
        f"Copy bandwidth measured in the same run: **{copy:.0f} GB/s** (1 GiB BF16 device-to-device, read + write).",
        ("Times are medians over CUDA-graph replays of each call (triton do_bench_cudagraph) after a warm-up call"
         if env.get("timing") == "cuda-graph" else "Times are medians of CUDA-event timings after warm-up")
        + "; GB/s counts the minimum bytes of the conversion.",
        "",
        "| shape | kernel | impl | time (us) | GB/s | % copy |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r.shape} | {r.kernel} | {r.impl} | {r.ms * 1e3:.1f} | {r.gbps:.0f} | {r.pct_copy:.1f} |")
    lines += ["", "## Ratios (their time / our time; > 1 means fp4moe is faster)", ""]
    summ = summary(rows)
    impls = sorted({k for s in summ for k in s if k.startswith("x vs ")})
    lines.append("| shape | kernel | us | % copy | " + " | ".join(i[5:] for i in impls) + " |")
    lines.append("|---|---|---:|---:|" + "---:|" * len(impls))
    for s in summ:
        lines.append(f"| {s['shape']} | {s['kernel']} | {s['us']} | {s['% copy']} | "
                     + " | ".join(str(s.get(i, "")) for i in impls) + " |")
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write(out_dir: str, env: dict, copy: float, rows: list[Row], notes: list[str], sweep_rows=None) -> str:
    """Write json/csv/md; return the path stem (``kernels_<gpu>_<date>_<commit>``, plus ``_<HHMMSS>`` where a file of
    that name exists: a second run of the day at that commit). Files are written to a temporary name and renamed."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"kernels_{gpu_file_name(env['gpu'])}_{env['date'][:10]}_{env['commit'][:7]}")
    if os.path.exists(f"{stem}.json"):  # measured again the same day at the same commit: keep both
        stem += "_" + env["date"][11:19].replace(":", "")
    payload = {"env": env, "copy_gbps": copy, "rows": [asdict(r) for r in rows], "summary": summary(rows),
               "notes": notes, "sweep": sweep_rows or []}
    for ext, text in (("json", json.dumps(payload, indent=1)), ("md", markdown(env, copy, rows, notes))):
        with open(f"{stem}.{ext}.tmp", "w") as fh:
            fh.write(text)
        os.replace(f"{stem}.{ext}.tmp", f"{stem}.{ext}")
    with open(f"{stem}.csv.tmp", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["date", "commit", "gpu", "command", "copy_gbps", "shape", "kernel", "impl", "time_us", "bytes", "gbps", "pct_copy"])
        for r in rows:
            w.writerow([env["date"], env["commit"], env["gpu"], env["command"], f"{copy:.0f}", r.shape, r.kernel,
                        r.impl, f"{r.ms * 1e3:.2f}", r.bytes, f"{r.gbps:.1f}", f"{r.pct_copy:.2f}"])
    os.replace(f"{stem}.csv.tmp", f"{stem}.csv")
    return stem


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp4moe_kernels.bench.conversions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Needs a CUDA GPU with FP8 (sm_89+); run the self-check first.")
    p.add_argument("--out", default="results/kernels", help="directory for json/csv/md (default results/kernels)")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per shape (default 32768)")
    p.add_argument("--experts", type=int, default=32,
                   help="experts of the ragged shapes and of the weight quantizer's (default 32)")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--no-peers", action="store_true", help="skip the torchao peers")
    p.add_argument("--no-weights", action="store_true",
                   help="skip the expert-weight quantizer (--experts x DeepSeek-V3 fc1 and fc2, with W_e^T)")
    p.add_argument("--weights-only", action="store_true",
                   help="time only the expert-weight quantizer (and the copy bandwidth), not the token-shape kernels")
    p.add_argument("--sweep", action="store_true",
                   help="first sweep tile/warp configs per kernel and use the fastest for the table (slow)")
    p.add_argument("--sweep-kernels", default="", help="comma-separated kernels to sweep (default: all)")
    p.add_argument("--baseline", action="append", default=[], metavar="DIR[:LABEL]",
                   help="also time an older copy of fp4moe_kernels (its folder; LABEL, e.g. its commit, names the "
                        "column) on the same inputs, side by side; repeat it for several copies (candidates)")
    p.add_argument("--commit", default=None, help="git commit to record (default: FP4MOE_COMMIT or git)")
    p.add_argument("--timing", choices=("cuda-graph", "events"), default="cuda-graph",
                   help="cuda-graph replays (default) or plain CUDA events around each call")
    args = p.parse_args(argv)
    if args.weights_only and (args.sweep or args.no_weights):
        p.error("--weights-only times only the weight quantizer: no --sweep (token shapes), no --no-weights")
    specs = {}  # label -> folder, in the order given
    for spec in args.baseline:
        path, _, label = spec.partition(":")
        label = label or os.path.basename(os.path.normpath(path))
        if label in specs:
            p.error(f"--baseline {spec}: the label {label!r} is taken by another --baseline; give each its own "
                    "(DIR:LABEL)")
        specs[label] = path
    # the arguments first, so that a typo costs no GPU time
    for why in [out_problem(args.out)] + [baseline_problem(path) for path in specs.values()]:
        if why:
            p.error(why)
    for flag, value in (("--tokens", args.tokens), ("--experts", args.experts), ("--warmup-ms", args.warmup_ms),
                        ("--rep-ms", args.rep_ms)):
        if value < 1:
            p.error(f"{flag} {value}: give a whole number >= 1")
    if args.sweep_kernels:
        from ..triton_kernels.launchers import TILES

        if not args.sweep:
            p.error("--sweep-kernels picks what --sweep sweeps: add --sweep")
        bad = [k for k in args.sweep_kernels.split(",") if k and k not in TILES]
        if bad:
            p.error(f"--sweep-kernels: {', '.join(bad)} not among the kernels with tiles: {', '.join(TILES)}")
    if not torch.cuda.is_available():
        print("the kernel benchmark needs a CUDA GPU (H100/H200); results measured on an H200 are in results/kernels/",
              file=sys.stderr)
        return 2
    command = "python -m fp4moe_kernels.bench.conversions " + " ".join(argv if argv is not None else sys.argv[1:])
    timing.TIMING["method"] = args.timing
    env = environment(command.strip(), args.commit)
    env["timing"] = args.timing
    print(f"kernel benchmark on {env['gpu']} (torch {env['torch']}, triton {env['triton']})")
    shapes = [] if args.weights_only else default_shapes(args.tokens, args.experts)
    from ..triton_kernels import launchers

    torch.cuda.init()  # this GPU's tiles (launchers.GPU_TILES, under FP4MOE_TILES) before any sweep sets one
    launchers.apply_tiles(switches.current())
    sweep_rows = None
    if args.sweep:
        sweep_rows = sweep(shapes[1], args.warmup_ms, args.rep_ms,
                           kernels=[k for k in args.sweep_kernels.split(",") if k] or None)
        env["tiles_adopted"] = adopt_best(sweep_rows)
    env["tiles"] = {k: list(v) for k, v in launchers.TILES.items()}
    baselines = []
    for i, (label, path) in enumerate(specs.items()):
        name = BASELINE_MODULE + (f"_{i}" if i else "")
        baselines.append((label, *load_baseline(path, name), name))
    if baselines:
        env["baseline"] = baselines[0][0]
        env["baselines"] = [b[0] for b in baselines]
    copy, rows, notes = run(shapes, args.warmup_ms, args.rep_ms, peers=not args.no_peers, baselines=baselines,
                            weight_shapes=[] if args.no_weights else default_weight_shapes(args.experts))
    copy_end = copy_bandwidth_gbps(args.warmup_ms, args.rep_ms)
    if copy_end > copy:  # report against the best copy seen in the run, and say so
        notes.append(f"copy bandwidth re-measured after the kernels: {copy_end:.0f} GB/s (was {copy:.0f}); "
                     "percentages use the higher")
        for r in rows:
            r.pct_copy = 100 * r.gbps / copy_end
        copy = copy_end
    stem = write(args.out, env, copy, rows, notes, sweep_rows)
    print()
    print(markdown(env, copy, rows, notes).split("## Ratios")[1])
    print(f"wrote {stem}.json/.csv/.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
