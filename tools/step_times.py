"""Step by step, how each trainer run spent its time: slow steps, jitter, and (with an nvidia-smi log) the GPU's
clock and power during them. For telling a host stall from a GPU-bound slowdown in T1 cells (results/train_proxy/
README.md section 17: fp8's slow steps ran at full SM clock with ~140 W less board power, the GPU waiting).

    python tools/step_times.py ARCHIVE.json|STORE [more] [--smi nvidia_smi.csv[.xz] ...] [--slow 1.2]

SOURCE: a runs archive (results/train_proxy/*.json) or an MLflow store (a .db file, a folder holding mlflow.db, a
tracking URI; exported to a temporary archive first). One row per run that logged ``step_time_s``, in start order:
recipe, recompute scope, micro-batch, the ``env.*`` switches it ran with, ``summary/tgs_median`` (tokens/GPU/s over
the measured window), the step times of that window (p10 / p50 / p90, s), and the slow steps of the whole run after
the first (slower than ``--slow`` x the window's median; their numbers). With ``--smi`` (the CSV of ``nvidia-smi
--query-gpu=timestamp,clocks.sm,...,power.draw,... --format=csv -lms 200``, plain or .xz, the GPU's local time =
the runs' UTC timestamps): the mean SM clock (MHz) and board power (W) of the samples inside the slow steps and
inside the other steps after the first. A step spans [its metric's timestamp - its time, its timestamp].
"""
from __future__ import annotations

import argparse
import csv
import io
import lzma
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ENV_LEFT_OUT = ("env.FP4MOE_CKPT_DIR", "env.FP4MOE_TOKENIZER", "env.CUDA_VISIBLE_DEVICES")


def read_runs(sources: list[str]) -> list[dict]:
    """Every run of the archives / stores in ``sources``, sorted by start time."""
    from fp4moe.runs.archive import SUFFIXES, export, load

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, src in enumerate(sources):
            path = Path(src)
            if not path.name.endswith(SUFFIXES):
                path = Path(tmp) / f"store{i}.json"
                export(src, path, note=f"read by tools/step_times.py: {src}")
            runs += load(path)["runs"]
    return sorted(runs, key=lambda r: r.get("start_time") or 0)


def read_smi(path: str) -> list[tuple[float, float, float]]:
    """(unix time s, SM clock MHz, power W) of every sample of an nvidia-smi CSV log (plain or .xz)."""
    raw = Path(path).read_bytes()
    text = (lzma.decompress(raw) if path.endswith(".xz") else raw).decode()
    rows = csv.reader(io.StringIO(text), skipinitialspace=True)
    head = [h.strip() for h in next(rows)]
    try:
        ti, ci = head.index("timestamp"), head.index("clocks.current.sm [MHz]")
        pi = head.index("power.draw [W]")
    except ValueError:
        raise SystemExit(f"{path}: needs the columns timestamp, clocks.sm and power.draw (got {head})") from None
    out = []
    for row in rows:
        if len(row) <= max(ti, ci, pi):
            continue
        try:
            t = datetime.strptime(row[ti].strip(), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
            out.append((t, float(row[ci].split()[0]), float(row[pi].split()[0])))
        except ValueError:
            continue  # a "[N/A]" or a truncated last line
    return out


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def analyse(run: dict, slow: float, smi: list[tuple[float, float, float]] | None = None) -> dict | None:
    """One run's row (see the module docstring); None when it logged no step times."""
    m, t, p = run["metrics"], run["tags"], run["params"]
    steps = sorted(m.get("step_time_s") or [])
    if len(steps) < 2:
        return None
    measured = int((m.get("summary/measured_steps") or [[0, len(steps) - 1]])[-1][1]) or len(steps) - 1
    window = [v for _, v, _ in steps[-measured:]]
    med = statistics.median(window)
    later = steps[1:]
    slow_steps = [(s, v, ts) for s, v, ts in later if v > slow * med]
    other = [(s, v, ts) for s, v, ts in later if v <= slow * med]
    env = {k[4:]: v for k, v in sorted(t.items()) if k.startswith("env.") and k not in ENV_LEFT_OUT}
    tgs = m.get("summary/tgs_median")
    row = {"recipe": t.get("recipe", "?"), "scope": t.get("recompute", "?"),
           "micro_batch": p.get("parallel.micro_batch", "?"), "env": env,
           "tgs": tgs[-1][1] if tgs else None, "p10": _quantile(window, 0.1), "p50": med,
           "p90": _quantile(window, 0.9), "slow": [s for s, _, _ in slow_steps]}
    if smi is not None:
        def gpu(sel):
            xs = [(c, w) for s, v, ts in sel for tt, c, w in smi if ts / 1e3 - v <= tt <= ts / 1e3]
            return (statistics.mean(c for c, _ in xs), statistics.mean(w for _, w in xs)) if xs else (None, None)
        row["slow_clock"], row["slow_power"] = gpu(slow_steps)
        row["other_clock"], row["other_power"] = gpu(other)
    return row


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(rows: list[dict], slow: float, with_smi: bool) -> str:
    """The Markdown table; the env column names only the settings that differ between the rows (those all rows
    share are listed once below it)."""
    common = {k: v for k, v in rows[0]["env"].items() if all(r["env"].get(k) == v for r in rows)}
    head = ["recipe", "scope", "mb", "env", "tokens/GPU/s", "window p10 / p50 / p90 (s)", f"slow steps (> {slow:g}x)"]
    if with_smi:
        head += ["SM MHz, power W: slow steps", "other steps"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        env = " ".join(f"{k}={v}" for k, v in r["env"].items() if k not in common)
        cells = [r["recipe"], r["scope"], str(r["micro_batch"]), env or "-", _f(r["tgs"], ".0f"),
                 f"{r['p10']:.3f} / {r['p50']:.3f} / {r['p90']:.3f}",
                 f"{len(r['slow'])}" + (f" ({', '.join(map(str, r['slow']))})" if r["slow"] else "")]
        if with_smi:
            cells += [f"{_f(r['slow_clock'], '.0f')}, {_f(r['slow_power'], '.0f')}",
                      f"{_f(r['other_clock'], '.0f')}, {_f(r['other_power'], '.0f')}"]
        lines.append("| " + " | ".join(cells) + " |")
    if common:
        lines += ["", "Every run: " + " ".join(f"{k}={v}" for k, v in common.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("sources", nargs="+", help="runs archives (.json) or MLflow stores")
    ap.add_argument("--smi", nargs="+", default=[], help="nvidia-smi CSV logs (.csv or .csv.xz) taken beside the runs")
    ap.add_argument("--slow", type=float, default=1.2, help="a step is slow above this x the window's median")
    a = ap.parse_args(argv)
    if a.slow <= 1:
        ap.error(f"--slow {a.slow}: give a factor above 1 (e.g. 1.2)")
    for s in a.sources:
        if s.endswith(".json") and not Path(s).is_file():
            ap.error(f"{s}: no such archive")
    for f in a.smi:
        if not Path(f).is_file():
            ap.error(f"--smi {f}: no such file")
    smi = sorted(x for f in a.smi for x in read_smi(f)) if a.smi else None
    rows = [r for r in (analyse(run, a.slow, smi) for run in read_runs(a.sources)) if r is not None]
    if not rows:
        print("no run logged step_time_s", file=sys.stderr)
        return 1
    sys.stdout.write(render(rows, a.slow, smi is not None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
