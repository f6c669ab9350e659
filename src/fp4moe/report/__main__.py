"""``python -m fp4moe.report [--tracking-uri URI] [--out DIR]``: write results/report/ from MLflow + numbers.yaml.

Exit status: 0 written; 2 the store cannot be read or the output folder cannot be written (one line on stderr naming
it and the fix, within seconds, before anything is written)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from .render import build_report, write_report


def main(argv: Sequence[str] | None = None) -> int:
    from fp4moe.atomic_write import unwritable
    from fp4moe.paths import results_dir
    from fp4moe.tracking.mlflow_store import TrackingUnavailable

    ap = argparse.ArgumentParser(prog="python -m fp4moe.report", description=(
        "Write the report (Markdown, CSV, PNG): the paper's T1/F3/F4/F5 numbers (conf/paper/numbers.yaml) beside "
        "the runs measured in MLflow and the paper-scale model's prediction."))
    ap.add_argument("--tracking-uri", default=None, metavar="URI",
                    help="MLflow store: a URI, an existing .db file or a folder holding mlflow.db (default: "
                         "$MLFLOW_TRACKING_URI, else <repo>/mlruns/mlflow.db, empty if absent)")
    ap.add_argument("--out", default=None, metavar="DIR", help="output folder (default: <repo>/results/report)")
    ap.add_argument("--no-model", action="store_true", help="leave out the paper-scale model's columns")
    args = ap.parse_args(argv)
    if args.tracking_uri is not None:
        # a store named here that does not exist is a typo, not an empty store: the report would be written (over
        # results/report/ by default) without a single run
        from fp4moe.tracking.mlflow_store import normalize_uri, sqlite_file

        db = sqlite_file(normalize_uri(args.tracking_uri))
        if db is not None and not db.is_file():
            print(f"fp4moe.report: --tracking-uri {args.tracking_uri}: no MLflow store there ({db} does not exist); "
                  "give a URI, a .db file or a folder holding mlflow.db (without the option: $MLFLOW_TRACKING_URI, "
                  "else <repo>/mlruns/mlflow.db)", file=sys.stderr)
            return 2
    out = Path(args.out) if args.out else results_dir() / "report"
    why = unwritable(out)
    if why:  # before the report is built (tens of seconds with the model): nothing could be written
        print(f"fp4moe.report: --out {out}: {why}; give a folder this process can create or write "
              "(default: <repo>/results/report)", file=sys.stderr)
        return 2
    try:
        rep = build_report(args.tracking_uri, with_model=not args.no_model)
    except TrackingUnavailable as e:  # one line naming the store and the fix (no traceback)
        print(f"fp4moe.report: {e}", file=sys.stderr)
        return 2
    paths = write_report(rep, out)
    print(f"report: {rep.counts['trainer']} trainer, {rep.counts['kernels']} kernels, {rep.counts['moe_layer']} "
          f"moe_layer runs from {rep.store_label} -> {out}/ ({', '.join(p.name for p in paths)})")
    if rep.model_error:
        print(f"report: the paper-scale model failed: {rep.model_error}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
