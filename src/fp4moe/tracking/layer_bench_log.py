"""``python -m fp4moe.tracking.layer_bench_log <moe_layer_*.json | folder> ...``: log MoE layer benchmarks to MLflow.

Reads what ``fp4moe.bench.moe_layer`` writes (``moe_layer_<gpu>_ep<W>_<date>_<commit>.json``: ``env``, ``shape``,
``recipes`` rows, ``ratios``, ``gemm``) and logs, into the MLflow experiment ``moe_layer``, one run per recipe
row, named ``<gpu> EP=<W> <recipe>``: params gpu, world_size, commit, date, recipe, command, the shape; metrics
ms_per_iter, gpu_ms_per_iter (where profiled), tokens_per_s, peak_gib, peak_over_base_gib, saved_bytes(_per_token), expert_saved_bytes,
dispatch/combine bytes and ms; tag ``layer_bench_id`` (hash of date, commit, gpu, world size, a non-default shape, the
variant and the time it was measured: one benchmark run). Idempotent: rows whose (layer_bench_id, recipe) is already
logged are skipped. ``date`` is the measuring time (``env.measured_at``, UTC ISO) where the file has it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Iterable, Sequence

from fp4moe.tracking import bench_log

EXPERIMENT = "moe_layer"
GLOB = "moe_layer_*.json"
METRICS = ("ms_per_iter", "gpu_ms_per_iter", "tokens_per_s", "peak_gib", "peak_over_base_gib", "saved_bytes", "saved_bytes_per_token",
           "expert_saved_bytes", "dispatch_fwd_bytes", "dispatch_bwd_bytes", "combine_fwd_bytes", "combine_bwd_bytes",
           "dispatch_ms", "combine_ms")


class LayerBenchFileError(ValueError):
    """A file is not a layer-benchmark JSON; the message names the file and what is wrong."""


def load(path: str | Path) -> dict:
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LayerBenchFileError(f"{p}: cannot read a JSON document ({exc})") from None
    for key in ("env", "shape", "recipes"):
        if key not in doc:
            raise LayerBenchFileError(f"{p}: no '{key}' key: not written by python -m fp4moe.bench.moe_layer")
    for key in ("date", "commit", "gpu", "world_size"):
        if key not in doc["env"]:
            raise LayerBenchFileError(f"{p}: env has no '{key}'")
    env = doc["env"]
    # a file written before the benchmark recorded measured_at, as a second run of its day and commit: the benchmark
    # named it <...>_<date>_<commit>_<HHMMSS>.json, the local time it was written; that time tells the runs apart
    stem, tail = p.stem.rsplit("_", 1) if "_" in p.stem else (p.stem, "")
    if ("measured_at" not in env and len(tail) == 6 and tail.isdigit()
            and stem.endswith(f"_{env['date']}_{env['commit']}")):
        env["measured_at"] = f"{env['date']}T{tail[:2]}:{tail[2:4]}:{tail[4:]}"
    return doc


# fp4moe.bench.moe_layer's default shape (DeepSeek-V3's MoE layer as one EP rank holds it; its argument defaults)
DEFAULT_SHAPE = {"hidden": 7168, "ffn": 2048, "local_experts": 32, "top_k": 8, "tokens": 4096, "shared_ffn": 2048}


def layer_bench_id(env: dict, shape: dict | None = None) -> str:
    """One benchmark run: date, commit, gpu, world size and, where it differs from DEFAULT_SHAPE, the shape, and the
    variant (``variant(env)``) when there is one, and the time it was measured (``measured_at``) where the file has
    it (files of the default shape and no variant keep the id they were logged under before shapes and variants were
    part of it, and files written before ``measured_at`` theirs; :func:`load` gives such a file written as a second run
    of its day and commit, ``..._<HHMMSS>.json``, the time in its name)."""
    key = f"{env['date']}|{env['commit']}|{env['gpu']}|{env['world_size']}"
    other = {k: v for k, v in sorted((shape or {}).items()) if k in DEFAULT_SHAPE and DEFAULT_SHAPE[k] != v}
    if other:
        key += "|" + ",".join(f"{k}={v}" for k, v in other.items())
    if variant(env):
        key += "|" + variant(env)
    if env.get("measured_at"):
        key += "|" + env["measured_at"]
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def variant(env: dict) -> str:
    """The benchmark's options that change what it measures beyond code and shape, joined by '+':
    ``fp8_weight_cache`` (FP8 weight copies made once per optimizer step, ``--fp8-weight-cache``),
    ``main_grads_fp32`` / ``main_grads_bf16`` (gradients added into main gradients as megatron DDP does,
    ``--main-grads``); '' for the default path."""
    parts = ["fp8_weight_cache"] if env.get("fp8_weight_cache") else []
    if env.get("main_grads"):
        parts.append(f"main_grads_{env['main_grads']}")
    return "+".join(parts)


def expand(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given; a folder stands for its ``moe_layer_*.json`` (none: nothing to log)."""
    try:
        return bench_log.expand(paths, GLOB, allow_empty=True)
    except FileNotFoundError as exc:
        raise LayerBenchFileError(str(exc)) from None


def _logged(uri: str, bid: str) -> set[str]:
    """Recipes already logged for benchmark run ``bid``."""
    return {r.data.params.get("recipe", "") for r in bench_log._existing_runs(uri, bid, EXPERIMENT, "layer_bench_id")}


def log_file(path: str | Path, uri: str | None = None) -> tuple[int, int]:
    """(rows logged, rows already there) for one file."""
    from fp4moe.tracking.mlflow_store import check_reachable, log_run, tracking_uri

    doc = load(path)
    uri = uri or tracking_uri()
    check_reachable(uri)
    env = doc["env"]
    bid = layer_bench_id(env, doc["shape"])
    done = _logged(uri, bid)
    logged = 0
    for row in doc["recipes"]:
        if row["recipe"] in done:
            continue
        # date: the measuring time where the file has it (an ISO time, as the kernel benchmark's), so that the report's
        # newest benchmark of a day is the one measured last, not the one whose file name sorts last
        params = {"gpu": env["gpu"], "world_size": env["world_size"], "commit": env["commit"],
                  "date": env.get("measured_at") or env["date"],
                  "recipe": row["recipe"], "command": env.get("command", ""), "variant": variant(env),
                  **{f"shape.{k}": v for k, v in doc["shape"].items()}}
        metrics = {k: row.get(k) for k in METRICS}
        tags = {"layer_bench_id": bid, "commit": env["commit"], "torch": env.get("torch", ""),
                "source_file": Path(path).name}
        log_run(EXPERIMENT, f"{env['gpu']} EP={env['world_size']} {row['recipe']}", params, metrics, tags, uri=uri)
        logged += 1
    return logged, len(doc["recipes"]) - logged


def log_files(paths: Sequence[str | Path], uri: str | None = None, log=print) -> bool:
    for p in expand(paths):
        new, old = log_file(p, uri)
        log(f"layer_bench_log: {p}: logged {new} runs to '{EXPERIMENT}'" + (f", {old} already there" if old else ""))
    return True


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4moe.tracking.layer_bench_log", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", help="moe_layer_*.json files or folders holding them")
    ap.add_argument("--uri", default=None, help="MLflow tracking URI (default: MLFLOW_TRACKING_URI or the local store)")
    args = ap.parse_args(argv)
    try:
        log_files(args.paths, args.uri)
    except LayerBenchFileError as exc:
        print(f"layer_bench_log: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
