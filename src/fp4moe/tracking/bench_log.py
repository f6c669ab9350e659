"""``python -m fp4moe.tracking.bench_log <kernels_*.json | folder> ...``: log kernel benchmarks to MLflow.

Reads the JSON that ``fp4moe_kernels.bench.conversions`` writes (``kernels_<gpu>_<date>_<commit>.json``)::

    {"env": {"date", "commit", "gpu", "gpu_count", "torch", "triton", "cuda", "python", "command",
             "timing"},
     "copy_gbps": float,
     "rows": [{"shape", "kernel", "impl", "ms", "bytes", "gbps", "pct_copy", "note", "extra"}, ...],
     "summary": [...], "notes": [...], "sweep": [...]}

and logs it through ``fp4moe.tracking.mlflow_store`` into the MLflow experiment ``kernels``:

* one run per row, named ``<shape>/<kernel>/<impl>``, tag ``kind=row``: params shape, kernel, impl,
  gpu, commit, date, command (and bytes, the minimum bytes the conversion moves); metrics time_us,
  gbps, pct_copy;
* one summary run, named ``summary <gpu> <date>``, tag ``kind=summary``: the env as params,
  metric copy_gbps, and the JSON file plus its ``.md`` and ``.csv`` siblings (when present) as
  artifacts.

Every run carries the tags ``bench_id`` (a hash of env.date, env.commit and env.gpu: one
benchmark run) and ``source_file_sha256`` (the file's bytes). The tags that ``fp4moe.tracking.mlflow_store`` adds
about the machine are replaced by what the benchmark recorded (commit, torch, python), since the
logging machine is usually not the GPU machine; ``logged_from`` names the machine that logged.

Idempotent: before logging, the experiment is searched for finished runs with the same
``bench_id``; only rows (and the summary) not found there are logged, so a second call adds nothing
and a call that was interrupted half-way is completed. A file with other bytes but the same date,
commit and GPU is the same measurement and is not logged again (a note says so).

mlflow is needed (``pip install -e .``; the GPU image does not have it): on the GPU machine, copy
``results/kernels/`` to a machine with the venv and run ``make log-bench`` there.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import socket
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

EXPERIMENT = "kernels"
ROW_PARAMS = ("shape", "kernel", "impl")
ENV_PARAMS = ("gpu", "commit", "date", "command")
ENV_REQUIRED = ("date", "commit", "gpu")
ROW_REQUIRED = ("shape", "kernel", "impl", "ms", "gbps", "pct_copy")
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
GLOB = "kernels_*.json"


class BenchFileError(ValueError):
    """A file is not a kernel-benchmark JSON; the message names the file and what is wrong."""


@dataclass
class LogResult:
    """What one file's logging did: runs logged now, runs already in the store, notes."""

    path: Path
    bench_id: str
    logged: list[str] = field(default_factory=list)  # run ids created by this call
    existing: int = 0  # matching finished runs found before logging
    notes: list[str] = field(default_factory=list)


def load(path: str | Path) -> tuple[dict, str]:
    """The payload of ``path`` and the sha256 of its bytes; BenchFileError if malformed."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as err:
        raise BenchFileError(f"{path}: not JSON ({err})") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("env"), dict):
        raise BenchFileError(f"{path}: no 'env' object; is it a fp4moe_kernels.bench.conversions result?")
    missing = [k for k in ENV_REQUIRED if k not in payload["env"]]
    if missing:
        raise BenchFileError(f"{path}: env lacks {missing}")
    if "copy_gbps" not in payload or not isinstance(payload.get("rows"), list):
        raise BenchFileError(f"{path}: needs 'copy_gbps' and a 'rows' list")
    for i, row in enumerate(payload["rows"]):
        lacking = [k for k in ROW_REQUIRED if k not in row]
        if lacking:
            raise BenchFileError(f"{path}: row {i} lacks {lacking}: {row}")
    return payload, hashlib.sha256(raw).hexdigest()


def bench_id(env: Mapping[str, object]) -> str:
    """Identity of one benchmark run: a hash of its date, commit and GPU."""
    key = "\n".join(str(env[k]) for k in ENV_REQUIRED)
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _param(value: object) -> str:
    text = str(value)
    return text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 3] + "..."


def _row_key(values: Mapping[str, object]) -> tuple[str, ...]:
    return tuple(str(values[k]) for k in ROW_PARAMS)


def _existing_runs(uri: str, bid: str, experiment_name: str = EXPERIMENT, tag: str = "bench_id") -> list:
    """Finished runs of ``experiment_name`` tagged ``tag=bid`` (every page)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return []
    from fp4moe.tracking.mlflow_store import search_all_runs

    return list(search_all_runs(client, [experiment.experiment_id],
                                f"tags.{tag} = '{bid}' and attributes.status = 'FINISHED'"))


def log_file(path: str | Path, uri: str | None = None) -> LogResult:
    """Log one benchmark JSON (see the module docstring); skip what the store holds already."""
    from fp4moe.tracking import mlflow_store

    path = Path(path)
    payload, sha = load(path)
    env = payload["env"]
    uri = uri or mlflow_store.tracking_uri()
    mlflow_store.check_reachable(uri)
    result = LogResult(path, bench_id(env))

    existing = _existing_runs(uri, result.bench_id)
    result.existing = len(existing)
    shas = {r.data.tags.get("source_file_sha256") for r in existing} - {sha, None}
    if shas:
        result.notes.append(
            f"runs of this benchmark (date {env['date']}, commit {env['commit']}, "
            f"gpu {env['gpu']}) were logged from a file with other bytes "
            f"(sha256 {', '.join(sorted(shas))}); those runs are kept, only missing ones are added")
    have_rows = Counter(_row_key(r.data.params) for r in existing
                        if r.data.tags.get("kind") == "row")
    have_summary = any(r.data.tags.get("kind") == "summary" for r in existing)

    tags = {
        "bench_id": result.bench_id,
        "source_file_sha256": sha,
        "source_file": path.name,
        # Where the numbers came from, not the machine that logs them (fp4moe.tracking.mlflow_store's defaults).
        "mlflow.source.git.commit": str(env["commit"]),
        "git_dirty": "unknown",
        "host": str(env.get("host", "unknown")),
        "torch": str(env.get("torch", "unknown")),
        "python": str(env.get("python", "unknown")),
        "logged_from": socket.gethostname(),
    }
    common = {k: _param(env[k]) for k in ENV_PARAMS if k in env}

    seen: Counter = Counter()
    for row in payload["rows"]:
        key = _row_key(row)
        seen[key] += 1
        if seen[key] <= have_rows[key]:
            continue
        params = {**common, **{k: _param(row[k]) for k in ROW_PARAMS}}
        if row.get("bytes") is not None:
            params["bytes"] = row["bytes"]
        if row.get("note"):
            params["note"] = _param(row["note"])
        ms = row["ms"]
        metrics = {"time_us": None if ms is None else ms * 1e3,
                   "gbps": row["gbps"], "pct_copy": row["pct_copy"]}
        result.logged.append(mlflow_store.log_run(
            EXPERIMENT, "/".join(key), params, metrics, tags={**tags, "kind": "row"}, uri=uri))

    if not have_summary:
        params = {**{k: _param(v) for k, v in env.items()}, "rows": len(payload["rows"])}
        if payload.get("notes"):
            params["notes"] = _param(" | ".join(map(str, payload["notes"])))
        artifacts = [path] + [p for p in (path.with_suffix(".md"), path.with_suffix(".csv"))
                              if p.is_file()]
        result.logged.append(mlflow_store.log_run(
            EXPERIMENT, f"summary {env['gpu']} {env['date']}", params,
            {"copy_gbps": payload["copy_gbps"]}, tags={**tags, "kind": "summary"},
            artifacts=artifacts, uri=uri))
    return result


def expand(paths: Iterable[str | Path], glob: str = GLOB, allow_empty: bool = False) -> list[Path]:
    """Files as given; a folder stands for its ``glob`` files (FileNotFoundError if it has none, unless
    ``allow_empty``). FileNotFoundError for a path that does not exist."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob(glob))
            if not found and not allow_empty:
                raise FileNotFoundError(f"{p}: no {glob} to log")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
    return out


def log_files(paths: Sequence[str | Path], uri: str | None = None, log=print) -> bool:
    """Log every file; print one line per file. Return False if any file failed (others go on)."""
    from fp4moe.tracking import mlflow_store

    uri = uri or mlflow_store.tracking_uri()
    ok = True
    for path in paths:
        try:
            res = log_file(path, uri)
        except (OSError, BenchFileError, mlflow_store.TrackingUnavailable) as err:
            log(f"bench_log: {path}: NOT logged: {err}")
            ok = False
            continue
        for note in res.notes:
            log(f"bench_log: {path}: note: {note}")
        if res.logged:
            log(f"bench_log: {path}: logged {len(res.logged)} runs to experiment '{EXPERIMENT}' "
                f"at {uri} ({res.existing} were already there)")
        else:
            log(f"bench_log: {path}: already logged ({res.existing} runs in '{EXPERIMENT}' at "
                f"{uri}); nothing added")
    return ok


def command_for(paths: Iterable[str | Path]) -> str:
    """The command that logs ``paths`` on a machine with the venv (shown where mlflow is absent)."""
    return ".venv/bin/python -m fp4moe.tracking.bench_log " + " ".join(str(p) for p in paths)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fp4moe.tracking.bench_log",
        description="Log fp4moe_kernels.bench.conversions JSON results to MLflow (experiment 'kernels'): one "
                    "run per (shape, kernel, impl) row plus a summary run with the files as "
                    "artifacts. Logging the same benchmark again adds nothing.",
        epilog="Store: $MLFLOW_TRACKING_URI, else sqlite under <repo>/mlruns/ (fp4moe.tracking.mlflow_store).",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help=f"a benchmark JSON, or a folder (its {GLOB})")
    args = parser.parse_args(argv)
    try:
        paths = expand(args.paths)
    except FileNotFoundError as err:
        print(f"bench_log: {err}", file=sys.stderr)
        return 1
    if importlib.util.find_spec("mlflow") is None:
        print(f"bench_log: mlflow is not installed for {sys.executable}, nothing logged. On a "
              f"machine with the venv (make venv), copy the files there and run: "
              f"{command_for(paths)}", file=sys.stderr)
        return 1
    return 0 if log_files(paths) else 1


if __name__ == "__main__":
    sys.exit(main())
