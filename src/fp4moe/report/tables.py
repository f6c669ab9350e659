"""The report's tables as plain rows (dicts), from paper numbers, run records and model rows. No I/O here.

Every row says where its numbers come from: ``source`` is ``paper (<numbers.yaml source>)``, ``measured`` (with
the setup: hardware, model config, layout, MLflow run id) or ``fp4moe.report.predictions.MODEL_LABEL`` (the model for
experiment=paper_t1). A value that does not exist is ``None`` with a ``status`` saying why (``OOM``, ``not
measured``); nothing is filled in.
"""
from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from .predictions import MODEL_LABEL
from .store import KERNELS, MOE_LAYER, RunRecord

NOT_MEASURED = "not measured"
OOM = "OOM"
WITHDRAWN = "withdrawn (wrong when measured: the archive's withdrawn_metrics)"
LOSS_SMOOTH_STEPS = 10  # the smoothed training loss is the mean of the last this-many logged `loss` values


# ---------------------------------------------------------------------------------------------- setups

@dataclass(frozen=True, order=True)
class Setup:
    """Where and at what scale trainer runs were measured: one column group of the T1 table."""

    experiment: str
    model: str
    hardware: str
    world_size: str
    layout: str       # TP/PP/EP/DP
    batch: str        # micro x seq, global batch
    archive: str = ""  # the runs archive the runs came from (fp4moe.runs.archive; its name holds the commit), if any

    @property
    def label(self) -> str:
        where = f"MLflow experiment `{self.experiment}`" + (f", archive `{self.archive}`" if self.archive else "")
        return (f"{self.model} on {self.hardware}, world size {self.world_size}, {self.layout}, {self.batch} "
                f"({where})")


def setup_of(run: RunRecord) -> Setup:
    p = run.params
    layout = " ".join(f"{n}{p.get(f'parallel.{k}', '?')}" for n, k in
                      (("TP", "tensor"), ("PP", "pipeline"), ("EP", "expert"), ("DP", "data")))
    batch = (f"micro {p.get('parallel.micro_batch', '?')} x seq {p.get('parallel.seq_length', '?')}, "
             f"global batch {p.get('parallel.global_batch', '?')}")
    # runs measured elsewhere come from archives, one per code version and session: keep them apart
    return Setup(run.experiment, run.tags["model"], run.tags["hardware"],
                 run.tags.get("world_size", p.get("parallel.world_size", "?")), layout, batch,
                 run.tags.get("fp4moe.archive", ""))


# Settings that choose which code a trainer run timed, each with its default (conf/kernels/default.yaml,
# conf/train/default.yaml), a label and the recipes it acts on: a measured cell run with another value names it, so
# that runs of one setup with different kernels are not read as the same code (e.g. bf16 on megatron-core's
# SequentialMLP experts against bf16 on fp4moe's grouped BF16 layer, results/train_proxy/README.md section 35).
CODE_SETTINGS = (("kernels.bf16_moe", "megatron", "BF16 experts", ("bf16",)),
                 ("kernels.grouped_gemm", "triton", "expert GEMMs", ("fp8", "mxfp4")),
                 ("kernels.wgrad_gemm", "triton", "expert wgrad", ("fp8", "mxfp4")),
                 ("kernels.fp8_row_col", "0", "FP8 rows + columns in one kernel", ("fp8", "mxfp4")),
                 ("kernels.fused_swiglu_fp8", "0", "SwiGLU writes FP8", ("fp8", "mxfp4")),
                 ("kernels.gather_sum", "triton", "permutation sums", ("bf16", "fp8", "mxfp4")),
                 ("train.wgrad_accumulation_fusion", "True", "wgrad accumulation fusion", ("bf16", "fp8", "mxfp4")))


def code_note(run: RunRecord) -> str:
    """The run's non-default code choices among CODE_SETTINGS for its recipe, e.g. "BF16 experts: fp4moe", and
    "GPU shared by N runs" where its tag ``gpu_shared_by`` says that N > 1 runs trained on its GPU at once (convergence
    runs side by side: their tokens/s are not the recipe's alone); "" if none. Runs logged before a setting existed
    read as its default, also where that default changed since (kernels.gather_sum, torch until 2026-12-06;
    train.wgrad_accumulation_fusion, False until 2026-12-06): such runs are set apart by their archive and commit,
    like any other change of the code."""
    recipe = run.tags.get("recipe", "")
    notes = [f"{label}: {run.params[key]}" for key, default, label, recipes in CODE_SETTINGS
             if recipe in recipes and run.params.get(key, default) != default]
    shared = run.tags.get("gpu_shared_by", "1")
    if shared.isdigit() and int(shared) > 1:
        notes.append(f"GPU shared by {shared} runs")
    return ", ".join(notes)


def _usable(run: RunRecord) -> bool:
    """A finished run with throughput, or one that ran out of memory (tag ``outcome=OOM``)."""
    return run.tags.get("outcome") == OOM or (run.status == "FINISHED" and "summary/tgs_median" in run.metrics)


def setups(trainer_runs: Iterable[RunRecord]) -> list[Setup]:
    return sorted({setup_of(r) for r in trainer_runs if _usable(r)})


# ---------------------------------------------------------------------------------------------- T1

def code_key(run: RunRecord) -> tuple[str, str]:
    """Which code a trainer run timed: (its commit, :func:`code_note`)."""
    return run.tags.get("mlflow.source.git.commit", ""), code_note(run)


def measured_cell(runs: Iterable[RunRecord], setup: Setup, scope: str, recipe: str) -> dict[str, Any]:
    """The latest usable trainer run of (setup, scope, recipe): status measured / OOM / not measured. ``others``: the
    latest run of each other code (:func:`code_key`) among the cell's runs, newest first, each a cell of its own with
    its ``commit`` ("" where it is the latest run's): an archive that holds an A/B pair (two commits, or a kernel
    switch on and off) shows both sides, while repeats of one code still show the latest only."""
    newest_first = sorted((r for r in runs if _usable(r) and r.tags["recompute"] == scope
                           and r.tags["recipe"] == recipe and setup_of(r) == setup),
                          key=lambda r: (r.start_time, r.run_id), reverse=True)
    latest_of: dict[tuple[str, str], RunRecord] = {}  # code -> its newest run, codes in the order of those runs
    for r in newest_first:
        latest_of.setdefault(code_key(r), r)
    if not latest_of:
        return _cell_of(None)
    (code, run), *others = latest_of.items()
    cell = _cell_of(run)
    for (commit, _), r in others:
        other = _cell_of(r)
        other.update(note=other["memory_note"], commit="" if commit == code[0] else commit)  # note: t1_rows' key
        cell["others"].append(other)
    return cell


def _cell_of(run: RunRecord | None) -> dict[str, Any]:
    cell: dict[str, Any] = {"status": NOT_MEASURED, "tgs": None, "tgs_min": None, "tgs_max": None,
                            "peak_memory_gb": None, "peak_memory_pct": None, "run_id": None, "memory_note": "",
                            "code": "", "others": []}
    if run is None:
        return cell
    cell.update(run_id=run.run_id, code=code_note(run))
    if run.tags.get("outcome") == OOM:
        cell["status"] = OOM
        return cell
    m = run.metrics
    cell.update(status="measured", tgs=m.get("summary/tgs_median"), tgs_min=m.get("summary/tgs_min"),
                tgs_max=m.get("summary/tgs_max"), peak_memory_gb=m.get("summary/peak_mem_allocated_gb"),
                peak_memory_pct=m.get("summary/peak_mem_pct"))
    if cell["peak_memory_gb"] is None:  # withdrawn from its archive (fp4moe.runs.archive), or a CPU run
        note = run.tags.get("peak_memory", "")
        cell["memory_note"] = (WITHDRAWN if "fp4moe.withdrawn_metrics" in run.tags
                               else note if note.startswith(NOT_MEASURED) else NOT_MEASURED)
    return cell


def t1_rows(paper_cells: list[dict], trainer_runs: list[RunRecord], model_rows: list[dict] | None,
            paper_source: str, gpu_memory_gb: float) -> tuple[list[dict], list[Setup]]:
    """Long-form T1: one row per (scope, recipe, source[, setup]). Scopes and recipes: the paper's, then any
    other that was measured. Peak memory pct: paper and model of ``gpu_memory_gb``; measured of the GPU's own."""
    found = setups(trainer_runs)
    scopes = list(dict.fromkeys(c["scope"] for c in paper_cells))
    recipes = list(dict.fromkeys(c["recipe"] for c in paper_cells))
    usable = [r for r in trainer_runs if _usable(r)]
    scopes += sorted({r.tags["recompute"] for r in usable} - set(scopes))
    recipes += sorted({r.tags["recipe"] for r in usable} - set(recipes))
    paper = {(c["scope"], c["recipe"]): c for c in paper_cells}
    model = {(m["scope"], m["recipe"]): m for m in model_rows or []}
    rows = []
    for scope in scopes:
        for recipe in recipes:
            base = {"scope": scope, "recipe": recipe}
            c = paper.get((scope, recipe))
            if c is None:
                rows.append({**base, "source": f"paper ({paper_source})", "setup": "", "status": "not in paper"})
            else:
                rows.append({**base, "source": f"paper ({paper_source})", "setup": "",
                             "status": OOM if c["oom"] else "reported", "tgs": c["tgs"],
                             "peak_memory_pct": c["peak_memory_pct"], "pct_basis": f"{gpu_memory_gb:g} GB"})
            if not found:
                rows.append({**base, "source": "measured", "setup": "", "status": NOT_MEASURED})
            for i, s in enumerate(found, 1):
                cell = measured_cell(usable, s, scope, recipe)
                rows.append({**base, "source": "measured", "setup": f"M{i}", "status": cell["status"],
                             "tgs": cell["tgs"], "tgs_min": cell["tgs_min"], "tgs_max": cell["tgs_max"],
                             "peak_memory_gb": cell["peak_memory_gb"], "peak_memory_pct": cell["peak_memory_pct"],
                             "pct_basis": "the GPU's memory" if cell["peak_memory_pct"] is not None else "",
                             "note": cell["memory_note"], "code": cell["code"], "run_id": cell["run_id"] or "",
                             "others": cell["others"]})  # not in the CSV: one row per cell there
            m = model.get((scope, recipe))
            if model_rows is not None:
                if m is None:
                    rows.append({**base, "source": MODEL_LABEL, "setup": "experiment=paper_t1", "status": "not modelled"})
                else:
                    rows.append({**base, "source": MODEL_LABEL, "setup": "experiment=paper_t1",
                                 "status": "fits" if m["fits"] else OOM, "peak_memory_gb": m["total_gb"],
                                 "peak_memory_pct": m["pct_of_gpu"], "pct_basis": f"{gpu_memory_gb:g} GB"})
    return rows, found


T1_COLUMNS = ("scope", "recipe", "source", "setup", "status", "tgs", "tgs_min", "tgs_max", "peak_memory_gb",
              "peak_memory_pct", "pct_basis", "note", "code", "run_id")


# ---------------------------------------------------------------------------------------------- F3 kernels

BASELINES = (("torch.compile (unfused", "vs_compiled_unfused"), ("torch.compile (one graph", "vs_compiled_one_graph"),
             ("torch eager", "vs_eager"), ("torchao", "vs_torchao"))
F3_COLUMNS = ("gpu", "commit", "date", "shape", "kernel", "time_us", "gbps", "pct_copy", "copy_gbps",
              *(c for _, c in BASELINES), "run_id")


# Our performance targets (issue P8), not the paper's numbers (those are in conf/paper/numbers.yaml): conversion
# kernels at >= 85 % of the copy bandwidth measured in the same run, BF16 -> FP8 faster than torchao's quantizers;
# the MoE layer's fp8 >= 1.3x bf16 and mxfp4 >= 1.0x fp8 tokens/s.
F3_PCT_COPY_TARGET = 85.0
F3_PCT_COPY_KERNELS = ("bf16_to_fp4_row", "fp4_to_bf16", "fp4_row_to_fp8_row", "fp4_row_to_fp8_col", "fp8_row_to_fp4",
                       "bf16_to_fp4_and_fp8_row")
F3_VS_TORCHAO_KERNELS = ("bf16_to_fp8_row", "bf16_to_fp8_col")
# the targets read each recipe's fastest entry of the benchmark (fp8, fp8@<GEMM backend>, fp8+<switch>: f4_rows'
# *_best keys), bf16's included (bf16+gsum ran the same permutation kernel as fp8@deepgemm+gsum); a benchmark without
# such entries gives the plain recipes' ratios
F4_TARGETS = (("tokens_per_s_fp8_best_over_bf16", "fp8 / bf16 tokens/s", 1.3),
              ("tokens_per_s_mxfp4_best_over_fp8_best", "mxfp4 / fp8 tokens/s", 1.0))


def f3_target(row: dict) -> str:
    """Our target for one F3 row and whether it is met: '>= 85 % of copy: met', 'faster than torchao: missed'..."""
    if row["kernel"] in F3_PCT_COPY_KERNELS:
        if row.get("pct_copy") is None:
            return f">= {F3_PCT_COPY_TARGET:g} % of copy: not measured"
        return f">= {F3_PCT_COPY_TARGET:g} % of copy: " + ("met" if row["pct_copy"] >= F3_PCT_COPY_TARGET else "missed")
    if row["kernel"] in F3_VS_TORCHAO_KERNELS:
        if row.get("vs_torchao") is None:
            return "faster than torchao: not measured"
        return "faster than torchao: " + ("met" if row["vs_torchao"] > 1.0 else "missed")
    return "-"


def f3_rows(kernel_runs: list[RunRecord]) -> list[dict]:
    """One row per (benchmark, shape, kernel) of our kernels (impl ``fp4moe``): time, GB/s, % of the copy
    bandwidth measured in the same run, and speedups = baseline time / our time (same benchmark, shape, kernel)."""
    by_bench: dict[str, list[RunRecord]] = defaultdict(list)
    for r in kernel_runs:
        if r.status == "FINISHED" and r.tags.get("bench_id"):
            by_bench[r.tags["bench_id"]].append(r)
    out = []
    for runs in by_bench.values():
        copy = next((r.metrics.get("copy_gbps") for r in runs if r.tags.get("kind") == "summary"), None)
        rows = [r for r in runs if r.tags.get("kind") == "row"]
        times: dict[tuple, dict[str, float]] = defaultdict(dict)
        for r in rows:
            t = r.metrics.get("time_us")
            if t:
                times[(r.params.get("shape"), r.params.get("kernel"))][r.params.get("impl", "")] = t
        for r in rows:
            p = r.params
            if p.get("impl") != "fp4moe":
                continue
            ours = r.metrics.get("time_us")
            row = {"gpu": p.get("gpu", "?"), "commit": p.get("commit", "?"), "date": p.get("date", "?"),
                   "shape": p.get("shape"), "kernel": p.get("kernel"), "time_us": ours, "gbps": r.metrics.get("gbps"),
                   "pct_copy": r.metrics.get("pct_copy"), "copy_gbps": copy, "run_id": r.run_id,
                   "start_time": max(x.start_time for x in runs)}  # when the benchmark was logged (ms; not in CSV)
            for prefix, col in BASELINES:
                theirs = [t for impl, t in times[(p.get("shape"), p.get("kernel"))].items() if impl.startswith(prefix)]
                row[col] = min(theirs) / ours if theirs and ours else None
            out.append(row)
    out.sort(key=lambda x: (x["gpu"], x["date"], x["commit"], x["shape"], x["kernel"]))
    return out


# ---------------------------------------------------------------------------------------------- F4 layer

F4_COLUMNS = ("gpu", "world_size", "commit", "variant", "date", "tokens", "local_experts", "tokens_per_s_bf16", "tokens_per_s_fp8", "tokens_per_s_mxfp4",
              "tokens_per_s_fp8_over_bf16",
              "tokens_per_s_mxfp4_over_fp8", "saved_bytes_per_token_bf16", "saved_bytes_per_token_fp8",
              "saved_bytes_per_token_mxfp4", "saved_bytes_mxfp4_over_fp8", "expert_saved_bytes_mxfp4_over_fp8",
              "dispatch_fwd_bytes_mxfp4_over_bf16", "peak_over_base_mxfp4_over_fp8", "bf16_best", "fp8_best", "mxfp4_best",
              "tokens_per_s_bf16_best", "tokens_per_s_fp8_best", "tokens_per_s_mxfp4_best", "tokens_per_s_fp8_best_over_bf16",
              "tokens_per_s_mxfp4_best_over_fp8_best", "gpu_time_fp8_best_over_bf16", "gpu_time_mxfp4_best_over_fp8_best")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fastest(tokens_per_s: dict[str, float | None], recipe: str) -> tuple[str, float | None]:
    """(entry, tokens/s) of ``recipe``'s fastest entry: the recipe itself, ``<recipe>@<GEMM backend>`` or either
    with ``+`` modifiers (the layer benchmark's ``--recipes fp8@deepgemm``, ``fp8+fused``, ``bf16+gsum``); ('', None)
    when none was measured."""
    got = [(v, e) for e, v in tokens_per_s.items()
           if v is not None and (e == recipe or e.startswith((recipe + "@", recipe + "+")))]
    if not got:
        return "", None
    v, e = max(got)
    return e, v


def f4_rows(layer_runs: list[RunRecord]) -> list[dict]:
    """One row per layer benchmark (gpu, EP world size, commit): tokens/s and saved bytes per recipe, ratios; and
    each recipe's fastest entry (``fp8_best``: the recipe, ``fp8@<GEMM backend>`` or with kernel switches) with the
    ratios the targets read: fp8's fastest over bf16's fastest, mxfp4's fastest over fp8's; where the benchmark
    profiled those entries, the same pairs in GPU time (``gpu_time_*``: the slower entry's GPU ms per iteration over
    the faster's, a speed-up as the tokens/s ratios; a wall-time ratio far below it means the host set the pace)."""
    by_bench: dict[str, dict[str, RunRecord]] = defaultdict(dict)
    for r in sorted(layer_runs, key=lambda r: (r.start_time, r.run_id)):
        if r.status == "FINISHED" and r.tags.get("layer_bench_id"):
            by_bench[r.tags["layer_bench_id"]][r.params.get("recipe", "")] = r
    out = []
    for recs in by_bench.values():
        any_run = next(iter(recs.values()))
        p = any_run.params
        m = {rec: run.metrics for rec, run in recs.items()}
        g = lambda rec, key: m.get(rec, {}).get(key)  # noqa: E731
        tps = {rec: g(rec, "tokens_per_s") for rec in m}
        bf16_best, bf16_best_tps = _fastest(tps, "bf16")
        fp8_best, fp8_best_tps = _fastest(tps, "fp8")
        mxfp4_best, mxfp4_best_tps = _fastest(tps, "mxfp4")
        out.append({"gpu": p.get("gpu", "?"), "world_size": p.get("world_size", "?"), "commit": p.get("commit", "?"),
                    "variant": p.get("variant", ""),  # fp4moe.tracking.layer_bench_log.variant: '' = the default path
                    "start_time": max(run.start_time for run in recs.values()),  # logged (ms; not in the CSV)
                    "date": p.get("date", "?"), "tokens": p.get("shape.tokens", "?"),
                    "local_experts": p.get("shape.local_experts", "?"),
                    **{f"tokens_per_s_{rec}": g(rec, "tokens_per_s") for rec in ("bf16", "fp8", "mxfp4")},
                    "tokens_per_s_fp8_over_bf16": _ratio(g("fp8", "tokens_per_s"), g("bf16", "tokens_per_s")),
                    "tokens_per_s_mxfp4_over_fp8": _ratio(g("mxfp4", "tokens_per_s"), g("fp8", "tokens_per_s")),
                    **{f"saved_bytes_per_token_{rec}": g(rec, "saved_bytes_per_token") for rec in ("bf16", "fp8", "mxfp4")},
                    "saved_bytes_mxfp4_over_fp8": _ratio(g("mxfp4", "saved_bytes"), g("fp8", "saved_bytes")),
                    "expert_saved_bytes_mxfp4_over_fp8": _ratio(g("mxfp4", "expert_saved_bytes"),
                                                                g("fp8", "expert_saved_bytes")),
                    "dispatch_fwd_bytes_mxfp4_over_bf16": _ratio(g("mxfp4", "dispatch_fwd_bytes"),
                                                                 g("bf16", "dispatch_fwd_bytes")),
                    "peak_over_base_mxfp4_over_fp8": _ratio(g("mxfp4", "peak_over_base_gib"),
                                                            g("fp8", "peak_over_base_gib")),
                    "bf16_best": bf16_best, "fp8_best": fp8_best, "mxfp4_best": mxfp4_best,
                    "tokens_per_s_bf16_best": bf16_best_tps, "tokens_per_s_fp8_best": fp8_best_tps,
                    "tokens_per_s_mxfp4_best": mxfp4_best_tps,
                    "tokens_per_s_fp8_best_over_bf16": _ratio(fp8_best_tps, bf16_best_tps),
                    "tokens_per_s_mxfp4_best_over_fp8_best": _ratio(mxfp4_best_tps, fp8_best_tps),
                    "gpu_time_fp8_best_over_bf16": _ratio(g(bf16_best, "gpu_ms_per_iter"), g(fp8_best, "gpu_ms_per_iter")),
                    "gpu_time_mxfp4_best_over_fp8_best": _ratio(g(fp8_best, "gpu_ms_per_iter"),
                                                                g(mxfp4_best, "gpu_ms_per_iter"))})
    out.sort(key=lambda x: (str(x["gpu"]), str(x["world_size"]), str(x["date"]), str(x["commit"]),
                            _int_or(x["tokens"]), _int_or(x["local_experts"]), x["variant"]))
    return out


def _int_or(v: Any, default: int = -1) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


# ---------------------------------------------------------------------------------------------- F5 loss

F5_COLUMNS = ("config", "recipe", "steps", "seed", "archive", "train_loss_smoothed", "train_loss_dev_pct", "eval_loss", "eval_loss_dev_pct",
              "paper_dev_pct", "run_id")


def data_label(params: dict[str, str]) -> str:
    """The training data of a run: its name, and for a tokenized corpus the build (the dataset folder, named by the
    corpus + tokenizer hash) and its training tokens, so that two builds of one corpus name are not compared."""
    name = params.get("data.name", params.get("data.dataset_prefix", "?"))
    prefix = params.get("data.dataset_prefix", "")
    build = Path(prefix).parent.name if prefix and prefix != "None" else ""
    tokens = params.get("data.train_tokens", "")
    if build:
        name += f" ({build}" + (f", {int(tokens) / 1e6:.1f} M training tokens)" if tokens.isdigit() else ")")
    return name


def planned_steps(params: dict[str, str]) -> str:
    """The steps a run was set to run: ``derived.steps``, also when given as ``train.tokens`` (then ``train.steps``
    is 'None'), else ``train.steps``; '?' when neither was logged."""
    return params.get("derived.steps") or params.get("train.steps", "?")


def schedule_label(params: dict[str, str]) -> str:
    """A run's learning-rate schedule, e.g. "lr 0.0006 cosine to 6e-05 after 100 warm-up steps" or "lr 0.0006
    constant after 100 warm-up steps"; "" when the run logged no ``train.adamw.lr`` / ``train.schedule.name``."""
    lr, name = params.get("train.adamw.lr"), params.get("train.schedule.name")
    if not lr or not name:
        return ""
    floor = f" to {params['train.adamw.min_lr']}" if name != "constant" and params.get("train.adamw.min_lr") else ""
    warmup = params.get("derived.warmup_steps") or params.get("train.schedule.warmup_steps")
    return f"lr {lr} {name}{floor}" + (f" after {warmup} warm-up steps" if warmup not in (None, "None") else "")


def config_key(run: RunRecord) -> tuple:
    """(setup, recompute, planned steps, seed, data, schedule): runs compared in F5 agree on all of them but the
    recipe; the seed is the fourth (a family is the configs that differ only in it)."""
    p = run.params
    return (setup_of(run), run.tags["recompute"], planned_steps(p), p.get("train.seed", "?"), data_label(p),
            schedule_label(p))


def config_label(key: tuple) -> str:
    setup, scope, steps, seed, data, schedule = key
    steps = f"{steps} steps ({schedule})" if schedule else f"{steps} steps"
    return f"{setup.label}; recompute {scope}; {steps}, seed {seed}, data {data}"


def family_hardware(hardware: str) -> str:
    """The hardware of an F5 family: ``N x <GPU> (M GiB)`` becomes ``N x GPU`` (a seed run on an H100 and one on an
    H200 belong to one family: the model, data, layout, batch and recipe make the losses, and each seed's GPU is
    listed beside, ``f5_seed_spread``'s ``hardware``); anything else (CPU runs) stays as it is."""
    m = re.fullmatch(r"(\d+) x .+ \(\d+ GiB\)", hardware)
    return f"{m.group(1)} x GPU" if m else hardware


def steps_per_pass(params: dict[str, str]) -> float | None:
    """Optimizer steps per pass over a run's training split: ``data.train_tokens`` / (global batch x sequence
    length); None where any of them is unknown."""
    try:
        per_step = int(params["parallel.global_batch"]) * int(params["parallel.seq_length"])
        train_tokens = int(params["data.train_tokens"])
    except (KeyError, ValueError):
        return None
    return train_tokens / per_step if per_step > 0 and train_tokens > 0 else None


def passes_of(params: dict[str, str], per_pass: float | None = None) -> float | None:
    """How many passes over its training split a run's schedule makes (its steps / ``steps_per_pass``, or
    ``per_pass`` where the caller has it); None where unknown."""
    per_pass = steps_per_pass(params) if per_pass is None else per_pass
    try:
        steps = int(planned_steps(params))
    except ValueError:
        return None
    return steps / per_pass if per_pass else None


def _smoothed_to(hist: list[tuple[int, float]], last_step: float) -> float | None:
    """Mean of the last LOSS_SMOOTH_STEPS logged values at steps <= ``last_step``; None if none."""
    tail = [v for s, v in hist if s <= last_step][-LOSS_SMOOTH_STEPS:]
    return statistics.fmean(tail) if tail else None


def _f5_group(run: RunRecord) -> tuple:
    """An F5 config's key: ``config_key`` with the GPU model left out (``family_hardware``)."""
    key = config_key(run)
    return (replace(key[0], hardware=family_hardware(key[0].hardware)),) + key[1:]


def _f5_groups(runs: list[RunRecord], usable: Callable[[RunRecord], bool]) -> dict[tuple, dict[str, RunRecord]]:
    """{``_f5_group``: {recipe: run}} over the ``usable`` runs; of a recipe's runs in one config, the newest."""
    groups: dict[tuple, dict[str, RunRecord]] = defaultdict(dict)
    for r in sorted(runs, key=lambda r: (r.start_time, r.run_id)):
        if usable(r):
            groups[_f5_group(r)][r.tags["recipe"]] = r
    return groups


def _recipe_order(recipes) -> list[str]:
    """``recipes`` as the tables list them: bf16, fp8, mxfp4, then any other by name."""
    return [r for r in ("bf16", "fp8", "mxfp4") if r in recipes] + sorted(set(recipes) - {"bf16", "fp8", "mxfp4"})


def _f5_family(group: tuple) -> str:
    """A family's label: the configs that differ only in the seed (and the archive, i.e. the session and commit, and
    the GPU model: family_hardware, as in the group's key)."""
    return config_label((replace(group[0], archive=""),) + group[1:3] + ("*",) + group[4:])


def _dev_at_pass_ends(base: list[tuple[int, float]], own: list[tuple[int, float]], per_pass: float,
                      passes: int) -> list[float] | None:
    """(own - base) / base in % of the smoothed training loss at the end of passes 1..``passes``; None where a run
    logged no history."""
    ends = [k * per_pass for k in range(1, passes + 1)]
    b = [_smoothed_to(base, end) for end in ends]
    o = [_smoothed_to(own, end) for end in ends]
    return None if None in b or None in o else [100.0 * (x - y) / y for x, y in zip(o, b)]


def f5_rows(trainer_runs: list[RunRecord], history: Callable[[str, str], list[tuple[int, float]]],
            paper_dev: dict[str, float]) -> list[dict]:
    """Per config (same setup, recompute, steps, learning-rate schedule, seed, data: ``config_key``) that has a
    finished bf16 run and another recipe, all with a held-out eval loss (throughput-only runs are left out):
    smoothed final training loss (mean of the last LOSS_SMOOTH_STEPS logged values) and final eval loss per recipe,
    and (x - bf16) / bf16 in %. The paper's deviation (F5, 16B model, 160B tokens) is beside it. A config's recipes
    come from one archive, on one GPU count; their GPU models may differ (a seed's last recipe run on another card
    and merged into the seed's archive): the config names each, and each row its run's. A config whose schedule
    passes over its training split twice or more (``passes_of``) also gives, per recipe but bf16, the training-loss
    deviation at the end of each whole pass (``train_dev_by_pass_pct``, the same smoothing, over the logged steps up
    to the pass's last step; None where a run logged no history)."""
    # only runs that evaluated held-out loss: throughput-only runs (T1 cells, a few steps) are not comparisons
    groups = _f5_groups(trainer_runs, lambda r: r.status == "FINISHED" and "summary/final_loss" in r.metrics
                        and "summary/final_eval_loss" in r.metrics)
    out = []
    for group in sorted(groups):
        recs = groups[group]
        if "bf16" not in recs or len(recs) < 2:
            continue
        gpus = ", ".join(dict.fromkeys(run.tags["hardware"] for run in recs.values()))
        key = (replace(group[0], hardware=gpus),) + group[1:]
        family = _f5_family(group)
        hists = {rec: history(run.run_id, "loss") for rec, run in recs.items()}
        vals = {}
        for rec, run in recs.items():
            t = _smoothed_to(hists[rec], math.inf)
            vals[rec] = (run.metrics["summary/final_loss"] if t is None else t,
                         run.metrics.get("summary/final_eval_loss"))
        tb, eb = vals["bf16"]
        per_pass = steps_per_pass(recs["bf16"].params)
        passes = passes_of(recs["bf16"].params, per_pass)
        by_pass: dict[str, list[float] | None] = {}
        if passes is not None and passes >= 2:
            # the steps of pass k are those up to k x per_pass (step s trains on tokens (s-1) x B .. s x B)
            for rec in (r for r in recs if r != "bf16"):
                by_pass[rec] = _dev_at_pass_ends(hists["bf16"], hists[rec], per_pass, int(passes))
        for rec in _recipe_order(recs):
            t, e = vals[rec]
            out.append({"config": config_label(key), "recipe": rec, "steps": key[2], "seed": key[3],
                        "archive": key[0].archive, "family": family, "hardware": recs[rec].tags["hardware"],
                        "train_loss_smoothed": t,
                        "train_loss_dev_pct": 100.0 * (t - tb) / tb,
                        "eval_loss": e, "eval_loss_dev_pct": 100.0 * (e - eb) / eb if e is not None and eb else None,
                        "paper_dev_pct": 0.0 if rec == "bf16" else paper_dev.get(rec), "run_id": recs[rec].run_id,
                        "passes": passes,
                        "train_dev_by_pass_pct": None if rec == "bf16" else by_pass.get(rec),
                        "start_time": max(run.start_time for run in recs.values())})  # the config's newest run (ms)
    return out


def f5_seed_spread(rows: list[dict]) -> list[dict]:
    """F5 rows of configs that differ only in the seed (``family``; the runs of each seed may come from another
    archive, i.e. session and commit: ``archives``, and another GPU model: ``hardware``), per recipe run from two
    seeds or more: the range of the final eval loss (and of the smoothed training loss) over the seeds, as (max -
    min) / min in %, the recipe's eval deviation from bf16 in each seed, their mean and their range (max - min, in
    percentage points). bf16's own spread says how large a deviation noise makes at that length; a recipe's
    deviation is its own when it keeps its sign and size from seed to seed, i.e. when the range of its deviations is
    smaller than their mean. The same for the smoothed training loss (``train_dev_*``: what the paper reports);
    ``train_dev_by_pass_mean_pct``: the mean over the seeds of the training-loss deviation at the end of each whole
    pass over the training split (f5_rows; None unless every seed has it for the same passes), ``passes`` the
    family's (its data build and steps fix it); ``start_time``: the family's newest run (ms)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["family"], r["recipe"])].append(r)
    out = []
    for (family, recipe), rs in groups.items():
        if len({r["seed"] for r in rs}) < 2:
            continue
        rs = sorted(rs, key=lambda r: str(r["seed"]))
        ev = [r["eval_loss"] for r in rs if r["eval_loss"] is not None]
        tr = [r["train_loss_smoothed"] for r in rs]
        devs = None if recipe == "bf16" else [r["eval_loss_dev_pct"] for r in rs]
        known = [d for d in devs or [] if d is not None]
        train_devs = None if recipe == "bf16" else [r["train_loss_dev_pct"] for r in rs]
        out.append({"family": family, "recipe": recipe, "seeds": ", ".join(str(r["seed"]) for r in rs),
                    "archives": ", ".join(dict.fromkeys(r.get("archive") or "-" for r in rs)),
                    "hardware": ", ".join(dict.fromkeys(str(r.get("hardware") or "-") for r in rs)),
                    "eval_spread_pct": 100.0 * (max(ev) - min(ev)) / min(ev) if len(ev) > 1 else None,
                    "train_spread_pct": 100.0 * (max(tr) - min(tr)) / min(tr),
                    "eval_dev_pct_per_seed": devs,
                    "eval_dev_mean_pct": statistics.fmean(known) if devs is not None and len(known) == len(devs) else None,
                    "eval_dev_range_pts": max(known) - min(known) if devs is not None and len(known) > 1 else None,
                    "train_dev_pct_per_seed": train_devs,
                    "train_dev_mean_pct": statistics.fmean(train_devs) if train_devs is not None else None,
                    "passes": rs[0].get("passes"),
                    "train_dev_by_pass_mean_pct": _mean_by_pass([r.get("train_dev_by_pass_pct") for r in rs]),
                    "start_time": max(r["start_time"] for r in rs)})
    return out


def f5_pass_rows(rows: list[dict], spread: list[dict], stopped: list[dict] = ()) -> list[dict]:
    """Per family (``f5_rows``' ``family``) and recipe but bf16 whose runs pass over their training split twice or
    more: the training-loss deviation from bf16 at the end of each whole pass, in f5_seed_spread's fields
    (``family``, ``recipe``, ``seeds``, ``passes``, ``train_dev_by_pass_mean_pct``): ``spread``'s row, i.e. the mean
    over the seeds, for a family run from two seeds or more; for a family of one seed, that seed's values
    (``rows``). Families without per-pass values are left out. ``stopped`` (``f5_stopped_pass_rows``) go after
    their family's row of the same recipe (after the family's last row; at the end if the family has none)."""
    multi = {(s["family"], s["recipe"]) for s in spread}
    one_seed = [{"family": r["family"], "recipe": r["recipe"], "seeds": str(r["seed"]), "passes": r["passes"],
                 "train_dev_by_pass_mean_pct": r["train_dev_by_pass_pct"]}
                for r in rows if (r["family"], r["recipe"]) not in multi]
    out = [s for s in spread + one_seed if s.get("train_dev_by_pass_mean_pct")]
    for row in stopped:
        same = [i for i, o in enumerate(out) if o["family"] == row["family"] and o["recipe"] == row["recipe"]]
        same = same or [i for i, o in enumerate(out) if o["family"] == row["family"]]
        out.insert(same[-1] + 1 if same else len(out), row)
    return out


def f5_stopped_pass_rows(trainer_runs: list[RunRecord],
                         history: Callable[[str, str], list[tuple[int, float]]]) -> list[dict]:
    """The per-pass deviations of runs that stopped before their end (status KILLED or FAILED, not out of memory: a
    device call's budget ran out), which ``f5_rows`` leaves out: per F5 config (``config_key``) of runs that evaluate
    held-out loss and pass over their training split twice or more, for each recipe but bf16 whose pair with bf16
    did not both finish, the training-loss deviation from bf16 at the end of each whole pass that both runs completed
    (their last logged step at or past the pass's last step), in ``f5_pass_rows``' fields; ``seeds`` names where
    each run stopped. Pairs with no whole pass in common are left out."""
    groups = _f5_groups(trainer_runs, lambda r: r.status in ("FINISHED", "KILLED", "FAILED")
                        and r.tags.get("outcome") != OOM and "eval_loss" in r.metrics)
    out = []
    for group in sorted(groups):
        recs = groups[group]
        if "bf16" not in recs:
            continue
        per_pass = steps_per_pass(recs["bf16"].params)
        passes = passes_of(recs["bf16"].params, per_pass)
        if passes is None or passes < 2:
            continue
        base = history(recs["bf16"].run_id, "loss")
        for rec in _recipe_order(set(recs) - {"bf16"}):
            if recs["bf16"].status == recs[rec].status == "FINISHED":
                continue   # f5_rows has the pair
            own = history(recs[rec].run_id, "loss")
            done = 0 if not base or not own else int(min(base[-1][0], own[-1][0], passes * per_pass) // per_pass)
            devs = _dev_at_pass_ends(base, own, per_pass, done) if done else None
            if devs:
                where = ", ".join(f"{name} {run.status.lower()} at step {h[-1][0]}"
                                  for name, run, h in (("bf16", recs["bf16"], base), (rec, recs[rec], own)))
                out.append({"family": _f5_family(group), "recipe": rec, "seeds": f"{group[3]} ({where})",
                            "passes": passes, "train_dev_by_pass_mean_pct": devs})
    return out


def _mean_by_pass(per_seed: list[list[float] | None]) -> list[float] | None:
    """Element-wise mean of the seeds' per-pass deviations; None unless every seed has them, for the same passes."""
    if not per_seed or any(d is None for d in per_seed) or len({len(d) for d in per_seed}) != 1:
        return None
    return [statistics.fmean(col) for col in zip(*per_seed)]


def split_store(runs: list[RunRecord]) -> tuple[list[RunRecord], list[RunRecord], list[RunRecord]]:
    """(trainer runs, kernel runs, layer runs)."""
    return ([r for r in runs if r.is_trainer], [r for r in runs if r.experiment == KERNELS],
            [r for r in runs if r.experiment == MOE_LAYER])


__all__ = ["CODE_SETTINGS", "code_note", "family_hardware",
           "F3_PCT_COPY_TARGET", "F3_PCT_COPY_KERNELS", "F3_VS_TORCHAO_KERNELS", "F4_TARGETS", "f3_target", "F3_COLUMNS", "F4_COLUMNS", "F5_COLUMNS", "f5_pass_rows", "f5_seed_spread", "f5_stopped_pass_rows", "LOSS_SMOOTH_STEPS", "NOT_MEASURED", "OOM", "Setup", "T1_COLUMNS",
           "code_key", "config_label", "data_label", "f3_rows", "f4_rows", "f5_rows", "measured_cell", "passes_of", "planned_steps", "schedule_label", "setup_of", "setups", "split_store", "steps_per_pass",
           "t1_rows"]
