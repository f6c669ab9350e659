"""Pick the T1 twin's micro-batch from a probe sweep (tools/device/h200_p3.sh probe), standard library only.

    python3 tools/device/choose_t1_mb.py STORE.db [STORE.db ...] [--limit-gb 128] [--json OUT.json]

Reads every trainer run of the probe stores (MLflow sqlite, tables ``tags`` / ``params`` / ``latest_metrics``): per
recipe x recompute scope and probed micro-batch, the peak allocated memory (GB). With two or more micro-batches per
cell, the peak at micro-batch ``m`` is the least-squares line through them (activations, the fp32 cross-entropy
temporaries and the backward workspaces all scale with the micro-batch; parameters, gradients and optimizer state
do not). A cell probed at one micro-batch only is an error (the saved-bytes metric misses the transients: at
micro-batch 64 the logits' fp32 copies alone are 17 GB). A cell that went OOM at ``m0`` does not fit at ``m >= m0``.

Rule (the T1 shape): among even micro-batches 2..64, the one whose predicted fit/OOM pattern matches the paper's
T1 (conf/paper/numbers.yaml: the heaviest scope fits for every recipe; the two lighter scopes fit for mxfp4 only) in
the most cells; ties go to the larger micro-batch (the GPU as full as possible). ``--limit-gb``: the allocated
memory counted as available (default 120 of the H200's 140 GiB: the allocator's reserve, fragmentation and the
CUDA context). Prints the choice and the prediction per cell; ``--json`` writes them.
"""
from __future__ import annotations

import argparse
import json
import sqlite3
import sys

PAPER_FITS = {  # conf/paper/numbers.yaml t1.cells: oom false -> fits
    ("attn_ln_experts", "bf16"): True, ("attn_ln_experts", "fp8"): True, ("attn_ln_experts", "mxfp4"): True,
    ("attn_ln_mlp", "bf16"): False, ("attn_ln_mlp", "fp8"): False, ("attn_ln_mlp", "mxfp4"): True,
    ("mla_up_proj", "bf16"): False, ("mla_up_proj", "fp8"): False, ("mla_up_proj", "mxfp4"): True,
}


def read_cells(paths):
    """{(scope, recipe): [{"micro_batch", "oom", "peak_gb", "tgs"}, ...]} over every probe run."""
    cells = {}
    for path in paths:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        tags, metrics, mbs = {}, {}, {}
        for run, key, value in con.execute("SELECT run_uuid, key, value FROM tags"):
            tags.setdefault(run, {})[key] = value
        for run, key, value in con.execute("SELECT run_uuid, key, value FROM latest_metrics"):
            metrics.setdefault(run, {})[key] = value
        for run, value in con.execute("SELECT run_uuid, value FROM params WHERE key = 'parallel.micro_batch'"):
            mbs[run] = int(value)
        for run, t in tags.items():
            if "recipe" not in t or "recompute" not in t or run not in mbs:
                continue
            m, oom = metrics.get(run, {}), t.get("outcome") == "OOM"
            cells.setdefault((t["recompute"], t["recipe"]), []).append(
                {"micro_batch": mbs[run], "oom": oom, "peak_gb": None if oom else m.get("summary/peak_mem_allocated_gb"),
                 "tgs": None if oom else m.get("summary/tgs_median")})
    return cells


def line(points):
    """(intercept, slope) of peak GB vs micro-batch through the cell's measured points (least squares)."""
    pts = [(p["micro_batch"], p["peak_gb"]) for p in points if not p["oom"] and p["peak_gb"] is not None]
    xs = sorted({x for x, _ in pts})
    if len(xs) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return my - b * mx, b


def predict(points, m):
    """Predicted peak GB at micro-batch m, or None: OOM (an OOM probe at or below m)."""
    if any(p["oom"] and p["micro_batch"] <= m for p in points):
        return None
    fit = line(points)
    if fit is None:
        raise SystemExit(f"a cell was probed at one micro-batch only ({points}): probe at two (h200_p3.sh probe)")
    return fit[0] + fit[1] * m


def choose(cells, limit_gb):
    best = None
    for m in range(2, 65, 2):
        score = 0
        for key, fits in PAPER_FITS.items():
            if key not in cells:
                continue
            p = predict(cells[key], m)
            score += (p is not None and p <= limit_gb) == fits
        if best is None or score >= best[1]:
            best = (m, score)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stores", nargs="+")
    ap.add_argument("--limit-gb", type=float, default=120.0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    cells = read_cells(a.stores)
    if not cells:
        print("no trainer runs in the probe stores", file=sys.stderr)
        return 1
    m, score = choose(cells, a.limit_gb)
    rows = []
    for (scope, recipe), pts in sorted(cells.items()):
        p, fit = predict(pts, m), line(pts)
        rows.append({"scope": scope, "recipe": recipe, "probes": pts, "fit_gb": fit, "predicted_peak_gb": p,
                     "predicted_fits": p is not None and p <= a.limit_gb})
        probes = ", ".join(f"mb {q['micro_batch']}: " + ("OOM" if q["oom"] else f"{q['peak_gb']:.1f} GB") for q in pts)
        pred = "OOM" if p is None else f"{p:.1f} GB"
        fit_s = f"fit {fit[0]:.1f} + {fit[1]:.2f} GB/sample" if fit else "no fit"
        print(f"{scope:16s} {recipe:6s} {probes}; {fit_s} -> mb {m}: {pred}")
    print(f"micro_batch {m} (matches the paper's fit/OOM pattern in {score} of {len(PAPER_FITS)} cells, limit "
          f"{a.limit_gb} GB)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"micro_batch": m, "score": score, "limit_gb": a.limit_gb, "cells": rows}, f, indent=1)
    print(m, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
