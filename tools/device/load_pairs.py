"""Tokens/GPU/s of T1 cells measured under equal load (tools/device/h200_p3.sh ``t1load``), standard library only.

    python3 tools/device/load_pairs.py STORE.db [STORE.db ...] [--ref fp8:attn_ln_mlp] [--ref-mb MB]

``t1load`` runs each cell on both GPUs at once (two processes, one per GPU), so every cell is measured beside a
copy of itself: the same host load for every cell, unlike a pair of two recipes side by side, where the lighter
one slows the heavier one less. Reads the store's trainer runs (MLflow sqlite, tables ``tags``, ``params``,
``latest_metrics``) and prints per cell (recipe, recompute scope, micro-batch): the two runs' median tokens/GPU/s
(``summary/tgs_median``), their mean, the spread between the two in %, the peak allocated GiB, and the ratio of the
mean to the ``--ref`` cell's mean at the same micro-batch (or, with ``--ref-mb``, at that micro-batch).
"""
from __future__ import annotations

import argparse
import os
import sqlite3
import sys
from collections import defaultdict


def read_runs(path: str) -> list[dict]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    tags, params, metrics = defaultdict(dict), defaultdict(dict), defaultdict(dict)
    for run, key, value in con.execute("SELECT run_uuid, key, value FROM tags"):
        tags[run][key] = value
    for run, key, value in con.execute("SELECT run_uuid, key, value FROM params"):
        params[run][key] = value
    for run, key, value in con.execute("SELECT run_uuid, key, value FROM latest_metrics"):
        metrics[run][key] = value
    out = []
    for run, m in metrics.items():
        if "summary/tgs_median" not in m:
            continue
        out.append({"recipe": tags[run].get("recipe"), "scope": tags[run].get("recompute"),
                    "micro_batch": int(params[run].get("parallel.micro_batch", 0)),
                    "tgs": float(m["summary/tgs_median"]), "peak_gib": m.get("summary/peak_mem_allocated_gb")})
    return out


def table(runs: list[dict], ref: str, ref_mb: int | None) -> list[str]:
    cells = defaultdict(list)
    for r in runs:
        cells[(r["recipe"], r["scope"], r["micro_batch"])].append(r)
    mean = {k: sum(r["tgs"] for r in v) / len(v) for k, v in cells.items()}
    ref_recipe, ref_scope = ref.split(":")
    lines = [f"| recipe | scope | micro-batch | runs | tokens/GPU/s each | mean | spread % | peak GiB | / {ref} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(cells):
        rs = cells[key]
        tgs = [r["tgs"] for r in rs]
        spread = 100.0 * (max(tgs) - min(tgs)) / min(tgs)
        peak = max((r["peak_gib"] for r in rs if r["peak_gib"] is not None), default=None)
        base = mean.get((ref_recipe, ref_scope, ref_mb if ref_mb else key[2]))
        ratio = f"{mean[key] / base:.3f}" if base else "-"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {len(rs)} | {', '.join(f'{t:.0f}' for t in tgs)} | "
                     f"{mean[key]:.0f} | {spread:.2f} | {'-' if peak is None else f'{peak:.2f}'} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stores", nargs="+", help="MLflow sqlite files (t1load's mlflow_t1load_gpu0.db, _gpu1.db)")
    ap.add_argument("--ref", default="fp8:attn_ln_mlp", help="recipe:scope every cell is divided by")
    ap.add_argument("--ref-mb", type=int, default=None, help="the reference's micro-batch (default: the cell's)")
    a = ap.parse_args(argv)
    missing = [p for p in a.stores if not os.path.isfile(p)]
    if missing:
        print(f"no such MLflow store: {', '.join(missing)} (t1load writes logs/device/mlflow_t1load_gpu*.db)",
              file=sys.stderr)
        return 2
    runs = [r for path in a.stores for r in read_runs(path)]
    if not runs:
        print("no finished trainer runs with summary/tgs_median in " + ", ".join(a.stores), file=sys.stderr)
        return 1
    print("\n".join(table(runs, a.ref, a.ref_mb)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
