"""Issue P8: how many bytes per second the SMs of one Hopper GPU read from its L2 cache, beside DRAM and beside the
grouped FP8 wgrad's L2 -> SM operand traffic. The question it answers: is the wgrad (0.62x of dense at its 64x128
tile) bound by L2 bandwidth rather than by the promotion (results/moe_layer/README.md, "The grouped wgrad: what
its tile asks of the L2")?

What it measures. A Triton kernel in which every program sums its own window of one buffer ``--reps`` times with
loads that bypass L1 (``cache_modifier=".cg"``), windows side by side over the whole buffer, ``--programs-per-sm``
programs per SM:

* ``l2``: a buffer of ``--l2-mib`` (default 24 MiB, well inside the H100 / H200's 50 MB L2): after the first pass
  every load is an L2 hit;
* ``dram``: a buffer of ``--dram-mib`` (default 2048 MiB), read once per repetition: DRAM bandwidth for the same code.

GB/s = bytes loaded / median time (``triton.testing.do_bench``); the sum each program writes is checked against
torch's. The file also holds the wgrad's L2 -> SM operand bytes per GEMM at each tile (``(BN + BK) x 128`` bytes per
128-token block and output tile, DeepSeek-V3's counts as tools/device/bench_wgrad.py has them) and the rate they need
at the wgrad's and at the dense GEMM's measured times (``--wgrad-run``, a tools/device/bench_wgrad.py JSON; default
results/moe_layer/wgrad_candidates_h200_2026-12-05_0b74f1a.json).

    python tools/device/l2_bandwidth.py --out $OUT/l2       # GPU: a few seconds
    python tools/device/l2_bandwidth.py --cpu-check         # CPU, TRITON_INTERPRET=1 (set by the script): the sums
    python tools/device/l2_bandwidth.py --sass-check        # CPU: compiled for sm_90, every pass's loads in the loop
    python tools/device/l2_bandwidth.py --traffic --wgrad-run RUN.json   # CPU: the traffic table of another run
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

if "--cpu-check" in sys.argv:  # before triton is imported: kernels are interpreted iff this is set at import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WGRAD_RUN = ROOT / "results/moe_layer/wgrad_candidates_h200_2026-12-05_0b74f1a.json"
BLOCK = 2048   # int32 per load step of one program: 8 KiB, 16 B per thread and load at 4 warps


@triton.jit
def _window_pass(base, offs, r, total, steps: tl.constexpr, BLOCK: tl.constexpr, CG: tl.constexpr,
                 ROTATE: tl.constexpr):
    """``total`` + pass r's loads of the window at ``base`` (``steps`` loads of BLOCK int32)."""
    for i in range(0, steps):
        if ROTATE:
            at = base + ((i + r) % steps) * BLOCK + offs
        else:
            at = base + i * BLOCK + offs
        if CG:
            total += tl.load(at, cache_modifier=".cg")
        else:
            total += tl.load(at)
    return total


@triton.jit
def window_sum_kernel(x_ptr, out_ptr, reps, WINDOW: tl.constexpr, BLOCK: tl.constexpr, CG: tl.constexpr,
                      ROTATE: tl.constexpr = True, HOST_REPS: tl.constexpr = 0):
    """out[p] = reps x the sum of ``x[p * WINDOW : (p + 1) * WINDOW]`` (int32; the callers' values keep it from
    overflowing), every pass loaded again. With ``ROTATE`` pass r reads the window's steps rotated by r (step
    (i + r) mod steps): the same bytes, but at addresses that depend on the pass, so the compiler cannot hoist the
    loads out of the passes loop; ``reps`` is a run-time value, so it cannot unroll that loop either (unrolled, the
    passes of a window of few steps load the same few addresses, and the compiler loaded each once: an H100 run
    with 5 steps per window reported 23 TB/s). ``ROTATE=False`` is the probe's first form, the negative control of
    ``loads_in_passes_loop``: the same addresses every pass, and ptxas loaded the window once and only added in the
    loop (an H100 run of it reported 27 TB/s). ``HOST_REPS`` > 0 (the interpreter, whose loops need a host int)
    loops that many passes instead of ``reps``."""
    base = x_ptr + tl.program_id(0).to(tl.int64) * WINDOW
    offs = tl.arange(0, BLOCK)
    total = tl.zeros((BLOCK,), dtype=tl.int32)
    steps: tl.constexpr = WINDOW // BLOCK
    if HOST_REPS > 0:
        for r in range(0, HOST_REPS):
            total = _window_pass(base, offs, r, total, steps, BLOCK, CG, ROTATE)
    else:
        for r in range(0, reps):
            total = _window_pass(base, offs, r, total, steps, BLOCK, CG, ROTATE)
    tl.store(out_ptr + tl.program_id(0), tl.sum(total, axis=0))


def loads_in_passes_loop(rotate: bool = True, window: int = 10 * BLOCK) -> bool:
    """Compile ``window_sum_kernel`` (``ROTATE=rotate``) for sm_90 with Triton's ptxas and say whether every global
    load of the SASS lies inside a loop (between a backward branch and its target): False means the compiler loaded
    the window once and repeated only the additions, so the GB/s would count bytes never read."""
    import re

    from fp4moe_kernels.triton_kernels.aot import sm90_sass
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"x_ptr": "*i32", "out_ptr": "*i32", "reps": "i32", "WINDOW": "constexpr", "BLOCK": "constexpr",
           "CG": "constexpr", "ROTATE": "constexpr", "HOST_REPS": "constexpr"}
    src = ASTSource(fn=window_sum_kernel, signature=sig,
                    constexprs={"WINDOW": window, "BLOCK": BLOCK, "CG": True, "ROTATE": rotate, "HOST_REPS": 0},
                    attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
    _, sass = sm90_sass(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"])
    ins = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)]
    loops = [(int(t, 16), a) for a, op in ins for t in re.findall(r"\bBRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", op)
             if int(t, 16) < a]
    loads = [a for a, op in ins if re.search(r"\bLDG\b", op)]
    return bool(loads) and all(any(lo <= a <= hi for lo, hi in loops) for a in loads)


def window_sums(x: torch.Tensor, programs: int, reps: int) -> torch.Tensor:
    """out[p] = ``reps`` x the sum of program p's window (``x.numel() // programs`` int32, a multiple of BLOCK), as
    the kernel forms it."""
    window = x.numel() // programs
    if window % BLOCK or window == 0:
        raise ValueError(f"{x.numel()} int32 over {programs} programs: the window must be a multiple of {BLOCK}")
    out = torch.empty(programs, dtype=torch.int32, device=x.device)
    cuda = x.device.type == "cuda"
    window_sum_kernel[(programs,)](x, out, reps, WINDOW=window, BLOCK=BLOCK, CG=cuda, HOST_REPS=0 if cuda else reps,
                                   num_warps=4)
    return out


def reference_sums(x: torch.Tensor, programs: int, reps: int) -> torch.Tensor:
    """The same sums by torch."""
    return (x.view(programs, -1).to(torch.int64).sum(1) * reps).to(torch.int32)


def values(n: int, device, generator=None) -> torch.Tensor:
    """n int32 in [-100, 100]: window x passes x 100 stays below 2**31 for the probe's buffers (about 10**4 int32
    per window over 200 L2 passes, 10**6 in one DRAM pass)."""
    return torch.randint(-100, 101, (n,), generator=generator, dtype=torch.int32).to(device)


def wgrad_traffic(run: dict) -> list[dict]:
    """L2 -> SM operand bytes of the grouped wgrad at each tile, and the rate they need at the measured times."""
    pad = [-(-c // 128) * 128 for c in run["counts"]]
    out = []
    for gemm in dict.fromkeys(r["gemm"] for r in run["rows"]):
        rows = [r for r in run["rows"] if r["gemm"] == gemm]
        n, k = rows[0]["N"], rows[0]["K"]
        dense = next(r["ms"] for r in rows if r["candidate"].startswith("dense"))
        current = next(r["ms"] for r in rows if r["candidate"].startswith("current"))
        for bn, bk in ((64, 128), (128, 128), (128, 256)):
            tiles = (-(-n // bn)) * (-(-k // bk))
            nbytes = sum(tiles * (p // 128) * (bn + bk) * 128 for p in pad)
            out.append({"gemm": gemm, "tile": f"{bn}x{bk}", "l2_to_sm_gb": nbytes / 1e9,
                        "gb_s_at_wgrad_ms": nbytes / current / 1e6, "gb_s_at_dense_ms": nbytes / dense / 1e6,
                        "wgrad_ms": current, "dense_ms": dense})
    return out


def cpu_check() -> int:
    g = torch.Generator().manual_seed(0)
    for programs, reps in ((3, 1), (4, 2)):
        x = values(programs * 2 * BLOCK, "cpu", g)
        got, want = window_sums(x, programs, reps), reference_sums(x, programs, reps)
        assert torch.equal(got, want), (got, want)
    print("cpu-check: window sums equal torch's (interpreted kernel)")
    return 0


def sass_check() -> int:
    """0 iff the probe's compiled loads are inside its passes loop at windows of 2, 5 (the default L2 buffer over
    132 SMs x 4 programs) and 10 steps, and the negative control's (10 steps) are not. (A window of one step has
    nothing to rotate: every pass reads the same addresses, and the GPU run's own check reports False there.)"""
    probe = all(loads_in_passes_loop(window=steps * BLOCK) for steps in (2, 5, 10))
    control = loads_in_passes_loop(rotate=False)
    print(f"loads inside the passes loop (sm_90 SASS): window_sum_kernel: {probe}, ROTATE=False (the first form): "
          f"{control}")
    return 0 if probe and not control else 1


def gpu_run(args) -> dict:
    from triton.testing import do_bench

    if not torch.cuda.is_available():
        sys.exit("l2_bandwidth: needs a CUDA GPU; --cpu-check runs on the CPU")

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    programs = sms * args.programs_per_sm
    doc = {"date": datetime.date.today().isoformat(), "commit": os.environ.get("FP4MOE_COMMIT"),
           "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
           "sms": sms, "programs": programs, "rows": []}
    for name, mib, reps in (("l2", args.l2_mib, args.reps), ("dram", args.dram_mib, 1)):
        n = mib * 2**20 // 4 // (programs * BLOCK) * (programs * BLOCK)
        if name == "l2":  # the compiled kernel at this window and pass count loads in every pass (else GB/s is void)
            try:
                doc["loads_in_passes_loop"] = loads_in_passes_loop(window=n // programs)
            except (OSError, subprocess.CalledProcessError) as exc:  # the measurement still counts; say why unchecked
                doc["loads_in_passes_loop"] = f"not checked: {exc}"
        x = values(n, dev)
        ok = torch.equal(window_sums(x, programs, reps), reference_sums(x, programs, reps))
        ms = do_bench(lambda: window_sums(x, programs, reps), warmup=25, rep=200)
        nbytes = 4 * n * reps
        doc["rows"].append({"buffer": name, "mib": n * 4 / 2**20, "reps": reps, "ms": ms, "gb_s": nbytes / ms / 1e6,
                            "sums_equal_torch": ok})
        print(json.dumps(doc["rows"][-1]), flush=True)
    run = Path(args.wgrad_run)
    if run.exists():
        from fp4moe.tracking.mlflow_store import portable  # results/ names no machine's folder (tests/test_docs.py)

        doc["wgrad_run"] = portable(str(run.resolve()))
        doc["wgrad_traffic"] = wgrad_traffic(json.loads(run.read_text()))
    return doc


def markdown(doc: dict) -> str:
    lines = [f"# L2 and DRAM read bandwidth: {doc['gpu']}, {doc['date']}, commit {doc['commit']}", "",
             f"{doc['programs']} programs ({doc['sms']} SMs), torch {doc['torch']}, Triton {doc['triton']}. "
             f"Every pass's loads inside the compiled loop: {doc.get('loads_in_passes_loop')}.", "",
             "| buffer | MiB | passes | ms | GB/s | sums equal torch's |", "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['buffer']} | {r['mib']:.0f} | {r['reps']} | {r['ms']:.3f} | {r['gb_s']:.0f} | "
              f"{r['sums_equal_torch']} |" for r in doc["rows"]]
    if doc.get("wgrad_traffic"):
        lines += ["", traffic_markdown(doc["wgrad_traffic"], doc.get("wgrad_run"))]
    return "\n".join(lines) + "\n"


def traffic_markdown(rows: list[dict], source: str | None) -> str:
    """The wgrad_traffic table, under a line naming the bench_wgrad.py run its times come from."""
    lines = [f"The grouped wgrad's L2 -> SM operand bytes (DeepSeek-V3's counts) and the rate they need (times: "
             f"{source or 'not named'}):", "",
             "| GEMM | tile | GB | GB/s at the wgrad's ms | GB/s at the dense GEMM's ms |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['gemm']} | {r['tile']} | {r['l2_to_sm_gb']:.1f} | {r['gb_s_at_wgrad_ms']:.0f} | "
              f"{r['gb_s_at_dense_ms']:.0f} |" for r in rows]
    return "\n".join(lines)


OPTIONS = {  # flag: (type, default, help); --cpu-check is separate
    "--out": (str, "results/kernels/l2", "folder for l2_<gpu>.md / .json"),
    "--l2-mib": (int, 24, "buffer read from L2 (MiB)"),
    "--dram-mib": (int, 2048, "buffer read from DRAM (MiB)"),
    # 20 passes (0.07 ms a launch on an H100) read 6.4 TB/s, 100-200 passes 7.1-7.5 (results/kernels/README.md,
    # the twenty-seventh session): the launch must be long enough that its ramp does not count
    "--reps": (int, 200, "passes over the L2 buffer per launch"),
    "--wgrad-run": (str, str(WGRAD_RUN), "a tools/device/bench_wgrad.py JSON: the wgrad and dense times of the traffic "
                    "table (measure both on the GPU the probe runs on)"),
    "--programs-per-sm": (int, 4, "programs per SM"),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, (kind, default, text) in OPTIONS.items():
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument("--cpu-check", action="store_true", help="the kernel's sums under the interpreter")
    p.add_argument("--traffic", action="store_true",
                   help="no GPU: print the wgrad traffic table of --wgrad-run (to set beside a probe run's GB/s)")
    p.add_argument("--sass-check", action="store_true",
                   help="compile for sm_90 (no GPU needed) and check that every pass's loads stay in the loop")
    args = p.parse_args(argv)
    if args.sass_check:
        return sass_check()
    if args.traffic:
        print(traffic_markdown(wgrad_traffic(json.loads(Path(args.wgrad_run).read_text())), args.wgrad_run))
        return 0
    return cpu_check() if args.cpu_check else write(gpu_run(args), Path(args.out))


def write(doc: dict, out: Path) -> int:
    """``doc`` as ``out/l2_<gpu>.json`` and ``.md``; the table printed."""
    from fp4moe.bench.moe_layer import gpu_slug

    stem = out / f"l2_{gpu_slug(doc['gpu'])}"
    out.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    stem.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
