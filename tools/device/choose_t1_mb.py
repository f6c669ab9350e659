"""Pick the T1 twin's micro-batch from a probe sweep (tools/device/h200_p3.sh probe), standard library only.

    python3 tools/device/choose_t1_mb.py STORE.db [STORE.db ...] [--limit-gb 128] [--json OUT.json]

Reads every trainer run of the probe stores (MLflow sqlite, tables ``tags`` / ``latest_metrics``): per recipe x
recompute scope at the probed micro-batch ``m0``, the peak allocated memory P0 (GB) and the bytes one micro-batch
saves for backward S0. Predicts the peak at micro-batch ``m`` as ``P0 + (m - m0) / m0 * S0`` (activations scale
with the micro-batch; parameters, gradients and optimizer state do not). An OOM probe cell is "does not fit" at
any ``m >= m0``.

Rule (the T1 shape): among even micro-batches 2..64, the one whose predicted fit/OOM pattern matches the paper's
T1 (conf/paper/numbers.yaml: the heaviest scope fits for every recipe; the two lighter scopes fit for mxfp4 only) in
the most cells; ties go to the larger micro-batch (the GPU as full as possible). ``--limit-gb``: the memory
counted as available (default 128 of the H200's 140 GiB: the allocator's reserve and fragmentation). Prints the
choice and the prediction per cell; ``--json`` writes them.
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
    cells = {}
    for path in paths:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        tags = {}
        for run, key, value in con.execute("SELECT run_uuid, key, value FROM tags"):
            tags.setdefault(run, {})[key] = value
        metrics = {}
        for run, key, value in con.execute("SELECT run_uuid, key, value FROM latest_metrics"):
            metrics.setdefault(run, {})[key] = value
        params = {}
        for run, key, value in con.execute("SELECT run_uuid, key, value FROM params WHERE key = 'parallel.micro_batch'"):
            params[run] = int(value)
        for run, t in tags.items():
            if "recipe" not in t or "recompute" not in t:
                continue
            m = metrics.get(run, {})
            oom = t.get("outcome") == "OOM"
            cells[(t["recompute"], t["recipe"])] = {
                "micro_batch": params.get(run), "oom": oom,
                "peak_gb": None if oom else m.get("summary/peak_mem_allocated_gb"),
                "saved_gb": (m.get("saved_activation_bytes_per_micro_batch") or 0) / 1e9,
                "tgs": None if oom else m.get("summary/tgs_median")}
    return cells


def predict(cell, m):
    if cell["oom"] or cell["peak_gb"] is None:
        return None
    m0 = cell["micro_batch"]
    return cell["peak_gb"] + (m - m0) / m0 * cell["saved_gb"]


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
    ap.add_argument("--limit-gb", type=float, default=128.0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    cells = read_cells(a.stores)
    if not cells:
        print("no trainer runs in the probe stores", file=sys.stderr)
        return 1
    m, score = choose(cells, a.limit_gb)
    rows = []
    for (scope, recipe), c in sorted(cells.items()):
        p = predict(c, m)
        rows.append({"scope": scope, "recipe": recipe, **c, "predicted_peak_gb": p,
                     "predicted_fits": p is not None and p <= a.limit_gb})
        print(f"{scope:16s} {recipe:6s} probe mb {c['micro_batch']}: peak {c['peak_gb']} GB, saved {c['saved_gb']:.2f} "
              f"GB, tgs {c['tgs']} -> mb {m}: {'OOM' if p is None else f'{p:.1f} GB'}")
    print(f"micro_batch {m} (matches the paper's fit/OOM pattern in {score} of {len(PAPER_FITS)} cells, limit "
          f"{a.limit_gb} GB)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"micro_batch": m, "score": score, "limit_gb": a.limit_gb, "cells": rows}, f, indent=1)
    print(m, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
