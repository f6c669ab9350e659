"""``python -m fp4moe.bench.swiglu_fusion``: the fused SwiGLU kernels against the unfused float32 torch ops they
replace, and against the copy bandwidth measured in the same run (one CUDA GPU).

For each shape ``T x F`` (routed-expert rows x expert FFN width; default the H200 proxy's experts at micro-batch
16: 524288 x 1024, and DeepSeek-V3's per-GPU expert shape 32768 x 2048), forward and backward, weighted by
routing probabilities (as the routed experts) and not (as the shared expert): median ms per call
(``fp4moe_kernels.bench.timing.do_bench``: CUDA-graph replays), the minimum bytes moved (forward: h read, z written,
probs read; backward: h and dz read, dh written, probs read and dprobs written), GB/s, % of the copy bandwidth, and
speedup = unfused ms / fused ms. With h stored as MXFP4 (the recipe's ``activation_fp4_store``) the fused
``swiglu_fwd_fp4`` / ``swiglu_bwd_fp4`` run against the two kernels they fuse (``swiglu_fwd`` + ``bf16_to_fp4_row``;
``fp4_to_bf16`` + ``swiglu_bwd``), in the "unfused" column of those rows; ``--fp4-tiles`` times the FP4-storing
forward again at each listed tile (blocks per program x warps) against the same unfused pair, and
``--bwd-fp4-tiles`` the backward from MXFP4 at each listed tile (``b`` blocks x rows x warps; ``tiles``: the previous
default, 2-D tiles) beside the default's row. The SwiGLU that writes the FP8 copies itself (``swiglu_fwd_fp8`` /
``swiglu_bwd_fp8``, the ``fused_swiglu_fp8`` switch; the T rows ragged over ``--experts`` experts, some empty) runs
against the kernels it fuses: forward ``swiglu_fwd`` + ``bf16_to_fp8_row`` + ``bf16_to_fp8_col`` of z (and without
columns, + the row quantizer only), backward ``swiglu_bwd`` (or ``swiglu_bwd_fp4`` from h's MXFP4) + the row and
column quantizers of dh; ``--fp8-tiles`` times those at each listed tile (BN channels per chunk x warps).
Writes ``<out>/swiglu_<gpu>_<date>_<commit>.{json,md}`` (default results/kernels/), again after every row: a run cut
short (a device call's time limit) leaves the rows it measured, marked incomplete.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch

from fp4moe_kernels.bench.timing import copy_bandwidth_gbps, do_bench, environment, gpu_file_name, out_problem


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        t, f = part.lower().split("x")
        out.append((int(t), int(f)))
    return out


def _tiles(text: str) -> list[tuple[int, int]]:
    """'64x2,128x4' -> [(64, 2), (128, 4)]: (32-column blocks per program, num_warps) of ``swiglu_fwd_fp4``, or
    (BN channels per chunk, num_warps) of ``swiglu_fwd_fp8`` / ``swiglu_bwd_fp8``."""
    return [tuple(int(v) for v in part.strip().lower().split("x")) for part in text.split(",") if part.strip()]


def _bwd_tiles(text: str) -> list:
    """'tiles,b16x4x2' -> ['tiles', ('blocks', 16, 4, 2)]: ``tile`` arguments of ``swiglu_bwd_fp4``: ``b`` blocks per
    tile x rows per program x warps (the default kernel), ``tiles`` the previous default (2-D tiles)."""
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        if part == "tiles":
            out.append(part)
        elif part.startswith("b"):
            out.append(("blocks", *(int(v) for v in part[1:].split("x"))))
        else:
            raise ValueError(f"--bwd-fp4-tiles: {part!r} is neither 'tiles' nor bCxRxN (e.g. b32x4x4)")
    return out


def _bwd_label(tile) -> str:
    return "2-D tiles (the previous default)" if tile == "tiles" else "tile " + "x".join(map(str, tile[1:]))


def fp8_bytes(t: int, k: int, mp: int, cols: bool) -> int:
    """Bytes of the FP8 copies of a ``[t, k]`` operand: 1x128 rows with float32 scales, and with ``cols`` the
    columns over the experts' rows padded to 128 (``mp``) with theirs."""
    return t * k + 4 * t * k // 128 + ((k * mp + 4 * k * mp // 128) if cols else 0)


def _fp8_cases(t: int, f: int, h, dz, p, q4, experts: int, fp8_tiles, pb: int):
    """(name, fused, unfused, bytes) of the SwiGLU writing FP8 copies, over T rows ragged across ``experts``."""
    from fp4moe_kernels import convert as kops
    from fp4moe_kernels.formats import Segments
    from fp4moe_kernels.selfcheck import make_counts
    from fp4moe_kernels.triton_kernels.fused_swiglu import (swiglu_bwd, swiglu_bwd_fp4, swiglu_bwd_fp8, swiglu_fwd,
                                                            swiglu_fwd_fp8)

    counts = make_counts(t, experts, seed=1)
    seg = Segments.of(counts, t)
    mp = seg.padded_total
    fp4b = t * f + t * f // 16

    def row_col(x):  # the two quantizers the fused kernels replace
        return kops.bf16_to_fp8_row(x, counts), kops.bf16_to_fp8_col(x, counts)

    cases = []
    for tile in (None, *fp8_tiles):
        at = "" if tile is None else f", tile {tile[0]}x{tile[1]}"
        cases += [
            (f"forward + z's FP8 rows and columns{at}", lambda tile=tile: swiglu_fwd_fp8(h, p, seg, True, tile=tile),
             lambda: row_col(swiglu_fwd(h, p)),
             4 * t * f + pb + fp8_bytes(t, f, mp, True)),
            (f"forward + z's FP8 rows{at}", lambda tile=tile: swiglu_fwd_fp8(h, p, seg, False, tile=tile),
             lambda: kops.bf16_to_fp8_row(swiglu_fwd(h, p), counts), 4 * t * f + pb + fp8_bytes(t, f, mp, False)),
            (f"backward + dh's FP8 rows and columns{at}",
             lambda tile=tile: swiglu_bwd_fp8(h, dz, p, seg, True, tile=tile),
             lambda: row_col(swiglu_bwd(h, dz, p)[0]),
             4 * t * f + 2 * t * f + 2 * pb + fp8_bytes(t, 2 * f, mp, True)),
        ]
        if tile is None or tile[0] >= 32:  # MXFP4 h is decoded in whole 32-element blocks
            cases.append((f"backward from MXFP4 + dh's FP8 rows and columns{at}",
                          lambda tile=tile: swiglu_bwd_fp8((q4.data, q4.scales), dz, p, seg, True, tile=tile),
                          lambda: row_col(swiglu_bwd_fp4(q4.data, q4.scales, dz, p)[0]),
                          fp4b + 2 * t * f + 2 * pb + fp8_bytes(t, 2 * f, mp, True)))
    return cases


def run(shapes, warmup_ms: int, rep_ms: int, log=print, fp4_tiles=(), bwd_fp4_tiles=(), experts: int = 32,
        fp8_tiles=(), on_row=None) -> tuple[float, list[dict]]:
    """(copy bandwidth GB/s, one row per case); ``on_row(copy, rows)`` is called after each row (main writes the
    results files there, so a run cut short keeps what it measured)."""
    from fp4moe_kernels import convert as kops
    from fp4moe_kernels.formats import MXFP4Tensor
    from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_bwd, swiglu_bwd_fp4, swiglu_fwd, swiglu_fwd_fp4

    ops = importlib.import_module("fp4moe.ops.swiglu")  # the unfused torch formulas (FP4MOE_FUSED_SWIGLU=0)
    os.environ[ops.FUSED_ENV] = "0"
    copy = copy_bandwidth_gbps(warmup_ms, rep_ms)
    log(f"copy bandwidth {copy:.0f} GB/s")
    rows = []
    for t, f in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(t, 2 * f, device="cuda", generator=g).to(torch.bfloat16)
        dz = torch.randn(t, f, device="cuda", generator=g).to(torch.bfloat16)
        for weighted in (True, False):
            p = torch.rand(t, device="cuda", generator=g) if weighted else None
            pb = 4 * t if weighted else 0
            cases = (("forward", lambda: swiglu_fwd(h, p), lambda: ops.swiglu_math(h, p), 2 * t * 2 * f + 2 * t * f + pb),
                     ("backward", lambda: swiglu_bwd(h, dz, p), lambda: ops.swiglu_math_backward(h, dz, p),
                      2 * t * 2 * f + 2 * t * f + 2 * t * 2 * f + 2 * pb))
            q4 = kops.bf16_to_fp4_row(h)
            fp4b = t * f + t * f // 16  # h's MXFP4 [T, 2F]: data + scales
            cases += (("forward, h stored as MXFP4", lambda: swiglu_fwd_fp4(h, p),
                       lambda: (swiglu_fwd(h, p), kops.bf16_to_fp4_row(h)), 2 * t * 2 * f + 2 * t * f + fp4b + pb),
                      ("backward, h from MXFP4", lambda: swiglu_bwd_fp4(q4.data, q4.scales, dz, p),
                       lambda: swiglu_bwd(kops.fp4_to_bf16(MXFP4Tensor(q4.data, q4.scales, (t, 2 * f))), dz, p),
                       fp4b + 2 * t * f + 2 * t * 2 * f + 2 * pb))
            cases += tuple((f"forward, h stored as MXFP4, tile {r}x{w}", lambda r=r, w=w: swiglu_fwd_fp4(h, p, tile=(r, w)),
                            cases[2][2], cases[2][3]) for r, w in fp4_tiles)
            cases += tuple((f"backward, h from MXFP4, {_bwd_label(bt)}",
                            lambda bt=bt: swiglu_bwd_fp4(q4.data, q4.scales, dz, p, tile=bt), cases[3][2], cases[3][3])
                           for bt in bwd_fp4_tiles)
            if f % 128 == 0:
                cases += tuple(_fp8_cases(t, f, h, dz, p, q4, experts, fp8_tiles, pb))
            for name, fused, unfused, nbytes in cases:
                ms_f, ms_u = do_bench(fused, warmup_ms, rep_ms), do_bench(unfused, warmup_ms, rep_ms)
                gbps = nbytes / (ms_f * 1e-3) / 1e9
                row = {"shape": f"{t}x{f}" + (f" ragged {experts}e" if "FP8" in name else ""), "pass": name, "probs": weighted, "fused_ms": ms_f, "unfused_ms": ms_u,
                       "bytes": nbytes, "gbps": gbps, "pct_copy": 100 * gbps / copy, "speedup": ms_u / ms_f}
                rows.append(row)
                if on_row is not None:
                    on_row(copy, rows)
                log(f"{row['shape']:>12s} {name:40s} probs={weighted!s:5s} fused {ms_f:.3f} ms ({gbps:.0f} GB/s, "
                    f"{row['pct_copy']:.1f} % of copy), unfused {ms_u:.3f} ms, speedup {row['speedup']:.2f}x")
    return copy, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4moe.bench.swiglu_fusion", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="524288x1024,32768x2048", help="comma-separated TxF (default: %(default)s)")
    ap.add_argument("--fp4-tiles", default="",
                    help="also time swiglu_fwd_fp4 at these tiles, e.g. 64x2,128x4")
    ap.add_argument("--bwd-fp4-tiles", default="",
                    help="also time swiglu_bwd_fp4 at these tiles: bCxRxN (blocks x rows x warps) or 'tiles' (the "
                         "previous default), e.g. tiles,b32x8x4")
    ap.add_argument("--experts", type=int, default=32,
                    help="experts the rows are ragged over for the FP8-writing SwiGLU (default %(default)s)")
    ap.add_argument("--fp8-tiles", default="",
                    help="also time swiglu_fwd_fp8 / swiglu_bwd_fp8 at these tiles: BNxWARPS, e.g. 16x4,32x8,128x8")
    ap.add_argument("--warmup-ms", type=int, default=25)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--out", default=os.environ.get("BENCH_OUT", "results/kernels"))
    ap.add_argument("--commit", default=None, help="commit to record (default: git, or FP4MOE_COMMIT)")
    a = ap.parse_args(argv)
    try:  # the spellings first: a typo is refused before any GPU work, on any machine
        shapes, fp4_tiles, fp8_tiles = _shapes(a.shapes), _tiles(a.fp4_tiles), _tiles(a.fp8_tiles)
        bwd_fp4_tiles = _bwd_tiles(a.bwd_fp4_tiles)
    except ValueError as e:
        ap.error(f"{e}: --shapes are TxF (e.g. 524288x1024), --fp4-tiles / --fp8-tiles AxB (e.g. 32x4), "
                 "--bwd-fp4-tiles bCxRxN or 'tiles'")
    if any(len(t) != 2 for t in (*fp4_tiles, *fp8_tiles)) or any(len(s) != 2 for s in shapes):
        ap.error("--shapes are TxF, --fp4-tiles / --fp8-tiles AxB: two numbers each")
    if any(t != "tiles" and len(t) != 4 for t in bwd_fp4_tiles):
        ap.error("--bwd-fp4-tiles are bCxRxN (blocks x rows x warps, e.g. b32x4x4) or 'tiles'; the AxB forms are "
                 "--fp4-tiles / --fp8-tiles")
    why = out_problem(a.out)
    if why:
        ap.error(why)
    if not torch.cuda.is_available():
        print("fp4moe.bench.swiglu_fusion needs a CUDA GPU (the fused kernels and the timings are GPU-only)", file=sys.stderr)
        return 2
    command = "python -m fp4moe.bench.swiglu_fusion " + " ".join(argv if argv is not None else sys.argv[1:])
    env = environment(command.strip(), a.commit)
    stem = Path(a.out) / f"swiglu_{gpu_file_name(env['gpu'])}_{env['date'][:10]}_{env['commit'][:7]}"
    copy, rows = run(shapes, a.warmup_ms, a.rep_ms, fp4_tiles=fp4_tiles, bwd_fp4_tiles=bwd_fp4_tiles,
                     experts=a.experts, fp8_tiles=fp8_tiles,
                     on_row=lambda copy, rows: write_results(stem, env, copy, rows, complete=False))
    write_results(stem, env, copy, rows, complete=True)
    print(f"wrote {stem}.json and .md")
    return 0


def write_results(stem: Path, env: dict, copy: float, rows: list[dict], complete: bool) -> None:
    """``<stem>.json`` and ``.md``, each replaced atomically; main writes them after every row with ``complete``
    false (the JSON's ``complete`` field, a line in the Markdown saying the run stopped there), then once at the end."""
    from fp4moe.atomic_write import write_bytes_atomic

    doc = {"env": env, "copy_gbps": copy, "complete": complete, "rows": rows}
    write_bytes_atomic(stem.with_suffix(".json"), json.dumps(doc, indent=1).encode())
    lines = [f"# Fused SwiGLU vs unfused torch, {env['gpu']}, commit {env['commit'][:7]}, {env['date']}", "",
             f"Command: `{env['command']}`. Copy bandwidth in the same run: {copy:.0f} GB/s.", ""]
    if not complete:
        lines += [f"**Incomplete**: the run stopped after these {len(rows)} rows (the file is rewritten after each).", ""]
    lines += ["| shape | pass | probs | fused ms | GB/s | % of copy | unfused ms | speedup |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['pass']} | {r['probs']} | {r['fused_ms']:.3f} | {r['gbps']:.0f} | {r['pct_copy']:.1f} "
              f"| {r['unfused_ms']:.3f} | {r['speedup']:.2f}x |" for r in rows]
    write_bytes_atomic(stem.with_suffix(".md"), ("\n".join(lines) + "\n").encode())


if __name__ == "__main__":
    sys.exit(main())
