"""Build the report (tables from the store, numbers.yaml and the model) and write it: Markdown, CSV, PNG.

Every file is written atomically (a temporary file in the same folder, then ``os.replace``). The output depends
only on the store, numbers.yaml and the code: no clock time, store paths under the repository shown relative to
it (others without the machine's home or output folder: fp4moe.tracking.mlflow_store.portable), so a rerun on the
same store rewrites the same bytes. Report files of earlier runs that this run does not
produce (a plot without data) are removed; other files in the folder are left alone.
"""
from __future__ import annotations

import csv
import io
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import urlsplit, urlunsplit

from .. import paper as paper_mod
from ..atomic_write import write_bytes_atomic
from . import store as store_mod
from . import tables
from .predictions import MODEL_LABEL, PAPER_T1_ATTENTION

OUTPUTS = ("report.md", "t1.csv", "t1_model_components.csv", "f3_kernels.csv", "f4_layer.csv", "f5_loss.csv",
           "t1_paper_vs_model.png", "t1_measured.png", "f3_kernels.png", "f4_layer.png", "f5_loss.png")
RECIPE_COLORS = {"bf16": "#4C72B0", "fp8": "#DD8452", "mxfp4": "#55A868"}


@dataclass
class Report:
    """Everything the report shows, before it is written."""

    store_label: str
    numbers: dict
    gpu_memory_gb: float
    t1: list[dict]
    setups: list[tables.Setup]
    model_rows: list[dict] | None
    model_error: str | None
    f3: list[dict]
    f4: list[dict]
    f5: list[dict]
    loss_curves: dict[str, dict[str, list[tuple[int, float]]]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    # fp4moe.analysis.throughput_calibration.paper_prediction(): (ratio label, paper ratio, [prediction per case]); its case labels
    throughput: list[tuple[str, float | None, list[float]]] | None = None
    throughput_cases: list[str] = field(default_factory=list)
    throughput_error: str | None = None
    model_assumptions: str = ""    # the model column's assumption set in words (fp4moe.report.predictions.assumption_set)
    f5_stopped: list[dict] = field(default_factory=list)   # tables.f5_stopped_pass_rows: runs stopped before their end


def _store_label(uri: str) -> str:
    """The store as the report names it: a path in the repository relative to it; elsewhere, the URI without
    credentials and with the machine's folders named portably (``~/...``: fp4moe.tracking.mlflow_store.portable)."""
    from fp4moe.paths import repo_root
    from fp4moe.tracking.mlflow_store import portable

    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
        try:
            return f"sqlite `{path.resolve().relative_to(repo_root())}` (in this repository)"
        except ValueError:
            return f"`{portable(uri)}`"
    parts = urlsplit(uri)
    if parts.username or parts.password:  # never print credentials
        uri = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    return f"`{portable(uri)}`"


def build_report(where: str | os.PathLike | None = None, *, with_model: bool = True,
                 numbers_path: str | os.PathLike | None = None) -> Report:
    """Read the store (URI, ``.db`` file or folder; None: fp4moe.tracking.mlflow_store's) and build every table."""
    st = store_mod.load(where)
    numbers = paper_mod.load(numbers_path)
    gpu_gb = float(numbers["t1"]["setup"]["gpu_memory_gb"])
    model_rows, model_error, model_assumptions = None, None, ""
    if with_model:
        from .predictions import assumption_set, t1_prediction

        try:
            model_rows, model_assumptions = t1_prediction(), assumption_set()   # % of the 80 GB GPU's 81559 MiB
        except Exception as exc:  # noqa: BLE001 - the report still shows paper and measured numbers; it says why
            model_error = f"{type(exc).__name__}: {exc}"
    trainer, kernels, layer = tables.split_store(st.runs)
    t1, found = tables.t1_rows(paper_mod.t1_cells(numbers), trainer, model_rows,
                               paper_mod.source_of(numbers, "t1"), gpu_gb)
    f5 = tables.f5_rows(trainer, st.history, dict(numbers["f5"]["loss_deviation_vs_bf16_pct"]))
    curves: dict[str, dict[str, list]] = {}
    for row in f5:
        curves.setdefault(row["config"], {})[row["recipe"]] = st.history(row["run_id"], "loss")
    rep = Report(_store_label(st.uri), numbers, gpu_gb, t1, found, model_rows, model_error,
                 tables.f3_rows(kernels), tables.f4_rows(layer), f5, curves,
                 {"trainer": len(trainer), "kernels": len(kernels), "moe_layer": len(layer), "all": len(st.runs)},
                 model_assumptions=model_assumptions, f5_stopped=tables.f5_stopped_pass_rows(trainer, st.history))
    if with_model:
        from fp4moe.analysis import throughput_calibration as throughput

        try:
            rep.throughput = throughput.paper_prediction(cells=numbers["t1"]["cells"], attention=PAPER_T1_ATTENTION)
            rep.throughput_cases = [c[0] for c in throughput.PAPER_CASES]
        except Exception as exc:  # noqa: BLE001 - the rest of the report stands; it says why this part is missing
            rep.throughput_error = f"{type(exc).__name__}: {exc}"
    return rep


# ---------------------------------------------------------------------------------------------- formatting

def _commit_variant(row: dict) -> str:
    """An F4 row's commit, with its benchmark variant (fp4moe.tracking.layer_bench_log.variant) when it has one."""
    return f"{row['commit']} ({row['variant'].replace('_', ' ')})" if row.get("variant") else str(row["commit"])


def _num(v: Any, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{float(v):.{digits}f}"


def _md_table(header: Iterable[str], rows: Iterable[Iterable[Any]], align: str | None = None) -> str:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align or ["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _cell(rows: list[dict], scope: str, recipe: str, source: str, setup: str = "") -> dict | None:
    return next((r for r in rows if r["scope"] == scope and r["recipe"] == recipe and r["source"].startswith(source)
                 and (not setup or r["setup"] == setup)), None)


def _paper_cells(c: dict) -> tuple[str, str]:
    if c["status"] == tables.OOM:
        return "OOM", "OOM"
    return _num(c["tgs"]), f"{_num(c['peak_memory_pct'], 2)} %"


def _code(c: dict) -> str:
    """" [<the cell's non-default kernels, and "GPU shared by N runs">]" (tables.code_note) to follow its tokens/s, or ""."""
    return f" [{c['code']}]" if c.get("code") else ""


def _measured_cells(c: dict | None) -> tuple[str, str]:
    if c is None or c["status"] == tables.NOT_MEASURED:
        return tables.NOT_MEASURED, tables.NOT_MEASURED
    if c["status"] == tables.OOM:
        return "OOM", "OOM"
    tgs = f"{_num(c['tgs'])} ({_num(c['tgs_min'])}-{_num(c['tgs_max'])})" + _code(c)
    if c.get("peak_memory_gb") is None:
        mem = c.get("note") or tables.NOT_MEASURED
    else:
        mem = f"{_num(c['peak_memory_gb'], 1)} GiB ({_num(c['peak_memory_pct'], 1)} % of the GPU)"
    return tgs, mem


def _headline_setup(rep: Report, labels: list[str]) -> str | None:
    """The measured setup beside the paper in T1's first table: most of the paper's cells measured (OOM included),
    then the most tokens per micro-batch (the nearest to the paper's memory pressure: a short probe at a small
    micro-batch fits every cell), then most cells measured overall, then the first."""
    in_paper = {(r["scope"], r["recipe"]) for r in rep.t1 if r["source"].startswith("paper")
                and r["status"] != "not in paper"}

    def score(lab: str) -> tuple[int, int, int]:
        got = [r for r in rep.t1 if r["source"].startswith("measured") and r["setup"] == lab
               and r["status"] != tables.NOT_MEASURED]
        m = re.search(r"micro (\d+) x seq (\d+)", rep.setups[labels.index(lab)].batch)
        tokens = int(m.group(1)) * int(m.group(2)) if m else 0
        return sum((r["scope"], r["recipe"]) in in_paper for r in got), tokens, len(got)

    return max(labels, key=lambda lab: (score(lab), -labels.index(lab))) if labels else None


def _grid_cell(c: dict | None) -> str:
    """One measured cell of a setup's scope x recipe grid: "tokens/GPU/s (min-max); peak", OOM or not measured; then
    the cell's runs of other code (``others``: another commit or kernel switch in the same archive), newest first."""
    tgs, mem = _measured_cells(c)
    text = tgs if tgs in (tables.NOT_MEASURED, "OOM") else f"{tgs}; {mem}"
    for o in (c or {}).get("others") or []:
        text += f"; also{' at ' + o['commit'] if o['commit'] else ''}: {_grid_cell(o)}"
    return text


def _model_cells(c: dict | None) -> tuple[str, str]:
    if c is None or c["status"] == "not modelled":
        return "not modelled", "not modelled"
    pct = f"{_num(c['peak_memory_pct'], 1)} %"
    return _num(c["peak_memory_gb"], 1), (f"OOM ({pct})" if c["status"] == tables.OOM else pct)


def _latest(rows: list[dict], group: Callable[[dict], tuple], bench: Callable[[dict], tuple]) -> tuple[list, list]:
    """(rows of the newest benchmark of each ``group``, the other rows): a benchmark is the rows sharing ``bench``;
    the newest is the one measured last (its ``date``, an ISO date or time), then logged last (``start_time``).
    Logging order alone is not measuring order: ``make reproduce-table`` on a fresh store logs result files by name."""
    def measured(r: dict) -> tuple:
        date = str(r.get("date") or "")
        return ("" if date == "?" else date), r.get("start_time") or 0  # "?": no date recorded, the oldest

    newest: dict[tuple, tuple] = {}
    for r in sorted(rows, key=measured):
        newest[group(r)] = bench(r)
    keep = set(newest.values())
    return [r for r in rows if bench(r) in keep], [r for r in rows if bench(r) not in keep]


def _f3_bench(r: dict) -> tuple:
    return (r["gpu"], r["commit"], r["date"])


def _f4_bench(r: dict) -> tuple:
    return (r["gpu"], r["world_size"], r["commit"], r["date"], r.get("variant", ""))


def _f4_latest(rows: list[dict]) -> tuple[list, list]:
    """(the newest layer benchmark of each GPU, EP size and variant, the rest): a benchmark of a variant (e.g. the
    FP8 weight cache, ``layer_bench_log.variant``) logged after the default path's does not hide the default's."""
    return _latest(rows, lambda r: (r["gpu"], r["world_size"], r.get("variant", "")), _f4_bench)


def _f5_latest(rows: list[dict]) -> tuple[list, list]:
    """(the F5 rows of the newest family: the configs that differ only in the seed, the newest run's; the rest). A
    family measured on GPUs comes before any CPU one (``make reproduce-table``'s tiny CPU runs are always newest)."""
    gpu = [r for r in rows if "CPU" not in str(r.get("hardware", ""))]
    newest, _ = _latest(gpu or rows, lambda r: (), lambda r: (r["family"],))
    keep = {r["family"] for r in newest}
    return [r for r in rows if r["family"] in keep], [r for r in rows if r["family"] not in keep]


def _range_x(vals: list[float]) -> str:
    vals = sorted(v for v in vals if v is not None)
    if not vals:
        return "not measured"
    return f"{vals[0]:.2f}x" if vals[0] == vals[-1] else f"{vals[0]:.2f}-{vals[-1]:.2f}x"


def headline_rows(rep: Report, head: str | None) -> list[list[str]]:
    """The first table: one row per paper number (T1's cells, the abstract's headline, F3, F4, F5): the paper's,
    ours (T1: setup ``head``; F3/F4: the newest benchmark of each GPU; F5: the newest family of configs), ours /
    paper where both are numbers, and the paper-scale model's where it predicts that number."""
    n = rep.numbers
    scope_labels = {k: v["label"] for k, v in n["t1"]["scopes"].items()}
    rows: list[list[str]] = []
    cells = list(dict.fromkeys((r["scope"], r["recipe"]) for r in rep.t1))

    for scope, recipe in cells:
        paper = _cell(rep.t1, scope, recipe, "paper")
        if paper is None or paper["status"] == "not in paper":
            continue
        ours = _cell(rep.t1, scope, recipe, "measured", head) if head else None
        model = _cell(rep.t1, scope, recipe, MODEL_LABEL) if rep.model_rows is not None else None
        name = f"T1 {scope_labels.get(scope, scope)}, {recipe}"
        ours_status = tables.NOT_MEASURED if ours is None else ours["status"]
        if paper["status"] == tables.OOM:
            got = ours_status if ours_status in (tables.NOT_MEASURED, tables.OOM) else (
                f"fits ({_num(ours['peak_memory_pct'], 1)} % of its GPU)" if ours.get("peak_memory_pct") is not None
                else "fits")
            rows.append([f"{name}: fits in memory", "OOM", got, "-", _model_fit(model)])
            continue
        measured = ours is not None and ours_status not in (tables.NOT_MEASURED, tables.OOM)
        # no ratio: a proxy's absolute rate and the paper's 671B model on 256 GPUs are not the same quantity
        rows.append([f"{name}: tokens/GPU/s", _num(paper["tgs"]),
                     _num(ours["tgs"]) + _code(ours) if measured else ours_status, "-", "-"])
        pct = ours.get("peak_memory_pct") if measured else None
        rows.append([f"{name}: peak memory", f"{_num(paper['peak_memory_pct'], 2)} % of {rep.gpu_memory_gb:g} GB",
                     f"{_num(pct, 1)} % of its GPU" if pct is not None else
                     (ours_status if not measured else (ours.get("note") or tables.NOT_MEASURED)),
                     "-", _model_fit(model)])  # no ratio: a share of another GPU's memory, another model's
    h = n["headline"]
    a, b, instead = _measured_headline_pair(rep, head)
    tgs = _change(a, b, "tgs", pct=True)
    pred = next((p for lab, _, p in rep.throughput or [] if lab.startswith("headline")), None)
    vs = f" (vs fp8 at {scope_labels.get(instead, instead)}: {_FP8_FALLBACK})" if instead and tgs is not None else ""
    rows.append(["headline: tokens/GPU/s, mxfp4 at MLA up-projection vs fp8 at attention + layernorm + MoE experts",
                 f"{h['tgs_change_pct']:+g} %", f"{tgs:+.1f} %{vs}" if tgs is not None else tables.NOT_MEASURED,
                 # the two speed-ups as factors, ours over the paper's: the one ratio of like with like here
                 f"{(1 + tgs / 100) / (1 + h['tgs_change_pct'] / 100):.2f}x" if tgs is not None else "-",
                 f"{100 * (min(pred) - 1):+.1f} to {100 * (max(pred) - 1):+.1f} % ({len(pred)} cases)" if pred else "-"])
    pp = _change(a, b, "peak_memory_pct")
    model_pp = _change(*_headline_pair(rep, MODEL_LABEL), "peak_memory_pct")
    rows.append(["headline: peak memory, the same two cells", f"{h['peak_memory_change_pp']:+g} points of 80 GB",
                 f"{pp:+.1f} points of its GPU{vs}" if pp is not None else tables.NOT_MEASURED,
                 "-", f"{model_pp:+.1f} points" if model_pp is not None else "-"])
    f3, f4 = n["f3"], n["f4"]
    latest3, _ = _latest(rep.f3, lambda r: (r["gpu"],), _f3_bench)
    rows.append(["F3: fused conversion kernels vs separate quantize / dequantize",
                 f"{f3['fused_speedup_min']}-{f3['fused_speedup_max']}x",
                 _range_x([r["vs_compiled_unfused"] for r in latest3]) + " (vs torch.compile unfused)" if latest3
                 else tables.NOT_MEASURED, "-", "-"])
    latest4, _ = _f4_latest(rep.f4)
    default4 = [r for r in latest4 if not r.get("variant")]
    rows.append(["F4: expert grouped linears vs Transformer Engine FP8",
                 f"{f4['expert_grouped_linear_speedup_min']}-{f4['expert_grouped_linear_speedup_max']}x",
                 _range_x([r["tokens_per_s_mxfp4_over_fp8"] for r in default4]) + " (the whole layer, mxfp4 vs our "
                 "fp8; not TE)" if default4 else tables.NOT_MEASURED, "-", "-"])
    family, spread, single = _f5_headline(rep.f5)
    for rec, paper_dev in n["f5"]["loss_deviation_vs_bf16_pct"].items():
        s, r = spread.get(rec), single.get(rec)
        if s is not None:
            got = (f"{s['train_dev_mean_pct']:+.2f} % (training loss; held-out {_num_pct(s['eval_dev_mean_pct'])}), "
                   f"mean of {len(s['train_dev_pct_per_seed'])} seeds")
            if s.get("train_dev_by_pass_mean_pct"):
                got += (f"; training loss {s['train_dev_by_pass_mean_pct'][0]:+.2f} % at the end of the first of "
                        f"{s['passes']:.1f} passes over the training split")
        elif r is not None:
            got = (f"{r['train_loss_dev_pct']:+.2f} % (training loss; held-out {_num_pct(r['eval_loss_dev_pct'])}), "
                   f"one seed ({r['seed']})")
        else:
            got = tables.NOT_MEASURED
        # no ratio: small signed gaps of another model at another length
        rows.append([f"F5: final loss deviation from bf16, {rec}", f"{paper_dev:+g} % (training loss)", got, "-", "-"])
    return rows


_FP8_FALLBACK = "its fastest scope that fits; fp8 runs out of memory at the paper's scope here"


def _num_pct(v: float | None) -> str:
    return f"{v:+.2f} %" if v is not None else "not measured"


def _measured_headline_pair(rep: Report, head: str | None) -> tuple[dict | None, dict | None, str | None]:
    """(fp8's cell, mxfp4 at mla_up_proj, None) of setup ``head``: the abstract's pair. Where fp8 runs out of memory
    (or was not run) at attn_ln_experts but mxfp4 at mla_up_proj ran, fp8's fastest measured scope in the same setup
    stands in, and its scope is the third item (the README's reading: mxfp4 against fp8's best)."""
    if not head:
        return None, None, None
    a, b = _headline_pair(rep, "measured", head)
    if _change(a, b, "tgs", pct=True) is not None or (b or {}).get("tgs") is None:
        return a, b, None
    fits = [r for r in rep.t1 if r["source"].startswith("measured") and r["setup"] == head and r["recipe"] == "fp8"
            and r.get("tgs")]
    if not fits:
        return a, b, None
    best = max(fits, key=lambda r: r["tgs"])
    return best, b, best["scope"]


def _f5_headline_field(spread: dict[str, dict], single: dict[str, dict], spread_key: str, row_key: str) -> str:
    """A field of ``_f5_headline``'s family: ``spread_key`` of its seed spread (the same in every recipe's), or,
    from one seed, the distinct ``row_key`` values of its rows; "" for none."""
    if spread:
        return next(iter(spread.values()))[spread_key]
    return ", ".join(dict.fromkeys(str(r[row_key]) for r in single.values()))


def _f5_headline(rows: list[dict]) -> tuple[str | None, dict[str, dict], dict[str, dict]]:
    """The F5 numbers set beside the paper's: (family, {recipe: seed spread}, {recipe: row}). The newest family run
    from two seeds or more (each recipe's mean over the seeds, tables.f5_seed_spread), GPU runs before CPU ones;
    without one, the newest family's newest run of each recipe (one seed)."""
    gpu = [r for r in rows if "CPU" not in str(r.get("hardware", ""))] or rows
    spreads = [s for s in tables.f5_seed_spread(gpu) if s["recipe"] != "bf16" and s["train_dev_mean_pct"] is not None]
    if spreads:
        family = max(spreads, key=lambda s: s["start_time"])["family"]
        return family, {s["recipe"]: s for s in spreads if s["family"] == family}, {}
    newest, _ = _f5_latest(rows)
    if not newest:
        return None, {}, {}
    single = {}
    for r in sorted(newest, key=lambda r: r["start_time"]):
        single[r["recipe"]] = r
    return newest[-1]["family"], {}, single


def _model_fit(c: dict | None) -> str:
    """The model's % of the GPU for one cell (``_model_cells``' second column), '-' where it has none."""
    return "-" if c is None or c["status"] == "not modelled" else _model_cells(c)[1]


def _headline_pair(rep: Report, source: str, setup: str = "") -> tuple[dict | None, dict | None]:
    """(fp8 at attn_ln_experts, mxfp4 at mla_up_proj) of ``source`` (and ``setup``): the abstract's headline pair."""
    return (_cell(rep.t1, "attn_ln_experts", "fp8", source, setup),
            _cell(rep.t1, "mla_up_proj", "mxfp4", source, setup))


def _change(a: dict | None, b: dict | None, key: str, pct: bool = False) -> float | None:
    """``b[key]`` against ``a[key]``: in % (``pct``; both must be non-zero) or as a difference; None unless both
    have it."""
    va, vb = (a or {}).get(key), (b or {}).get(key)
    if va is None or vb is None or (pct and not (va and vb)):
        return None
    return 100 * (vb / va - 1) if pct else vb - va


def _sources(rep: Report) -> list[str]:
    n = rep.numbers
    return [f"- **paper**: `conf/paper/numbers.yaml` (arXiv {n['paper']['arxiv']}); its `source` field says whether "
            "a number is from the abstract or from secondary summaries of the full text (not verified against it).",
            f"- **measured**: runs in the MLflow store {rep.store_label}: {rep.counts['trainer']} trainer runs, "
            f"{rep.counts['kernels']} `kernels` runs, {rep.counts['moe_layer']} `moe_layer` runs. Each measured "
            "number names its hardware and scale; the MLflow run ids are in the CSV files.",
            f"- **{MODEL_LABEL}**: `fp4moe.scale`, the paper-scale memory model from first principles, for each "
            "cell as `python -m fp4moe.train experiment=paper_t1` runs it (the lab's setup from its sister artifact: "
            "DeepSeek-V3 without MTP, TP1 PP32 EP8 DP8, micro-batch 1, BF16 main grads with the optimizer state "
            "offloaded, the paper's \"attention\" read as the whole self-attention block). **Assumption set**: "
            f"{rep.model_assumptions}. The peak is the most loaded GPU's, as nvidia-smi would show it (PyTorch's "
            "allocated peak + the memory outside it). What is checked: the allocated peak against H200 proxy runs "
            "on one GPU and on two over NCCL (EP2 x DP2, PP2), within 5 % in every run (results/scale/"
            "calibration.md). NOT checked: anything at this scale (32 pipeline stages, EP8, the offloaded "
            "optimizer), so these cells are predictions of its arithmetic, not results; results/scale/paper_t1.md "
            "has how each assumption moves them. GB = 2^30 B.", ""]


def _f3_tables(rows: list[dict]) -> list[str]:
    out: list[str] = []
    for bench in dict.fromkeys(_f3_bench(r) for r in rows):
        rs = [r for r in rows if _f3_bench(r) == bench]
        out += [f"**{bench[0]}**, commit {bench[1]}, {bench[2]} (copy {_num(rs[0]['copy_gbps'])} GB/s):", ""]
        out += [_md_table(["shape", "kernel", "time (us)", "GB/s", "% of copy", "vs compiled unfused",
                           "vs compiled one graph", "vs eager", "vs torchao", "our target"],
                          [[r["shape"], r["kernel"], _num(r["time_us"], 1), _num(r["gbps"]),
                            _num(r["pct_copy"], 1)] + [_x(r[c]) for _, c in tables.BASELINES] + [tables.f3_target(r)]
                           for r in rs]), ""]
    return out


def _best_entries(r: dict) -> str:
    """' (fp8@deepgemm, mxfp4@deepgemm)': the fastest entries a row's targets read, where one is not the plain recipe
    (bf16's named only where it is not plain bf16)."""
    best = [r.get("fp8_best") or "fp8", r.get("mxfp4_best") or "mxfp4"]
    if (r.get("bf16_best") or "bf16") != "bf16":
        best.insert(0, r["bf16_best"])
    return f" ({', '.join(best)})" if best != ["fp8", "mxfp4"] else ""


def _f4_targets(rows: list[dict]) -> list[str]:
    """Our layer targets (tables.F4_TARGETS) against each row of ``rows``: 'met' / 'missed' with the ratio."""
    lines = []
    for key, label, target in tables.F4_TARGETS:
        got = [(r, r[key]) for r in rows if r.get(key) is not None]
        if got:
            lines.append(f"{label} >= {target:g}: " + ", ".join(
                f"{_commit_variant(r)} {r['gpu']} EP{r['world_size']} {r['tokens']}x{r['local_experts']} {v:.3f}"
                + _best_entries(r) + " " + ("met" if v >= target else "missed") for r, v in got))
    return (["Our targets (issue P8; not the paper's numbers), each recipe at its fastest entry in the benchmark "
             "(a GEMM backend or kernel switches; named where not the plain recipe): " + "; ".join(lines) + ".", ""]) if lines else []


def _f4_table(rows: list[dict]) -> list[str]:
    return [_md_table(["GPU", "EP", "commit", "tokens", "experts", "tokens/s bf16", "fp8", "mxfp4", "mxfp4/fp8 tokens/s",
                       "fastest fp8: tokens/s (x fastest bf16)", "fastest mxfp4: tokens/s (x fastest fp8)",
                       "saved B/token bf16", "fp8", "mxfp4", "mxfp4/fp8 saved", "mxfp4/fp8 expert saved",
                       "mxfp4/bf16 dispatch fwd bytes"],
                      [[r["gpu"], r["world_size"], _commit_variant(r), r["tokens"], r["local_experts"],
                        _num(r["tokens_per_s_bf16"]),
                        _num(r["tokens_per_s_fp8"]), _num(r["tokens_per_s_mxfp4"]),
                        _num(r["tokens_per_s_mxfp4_over_fp8"], 3),
                        _entry(r.get("fp8_best"), r.get("tokens_per_s_fp8_best"), r.get("tokens_per_s_fp8_best_over_bf16"),
                               r.get("gpu_time_fp8_best_over_bf16")),
                        _entry(r.get("mxfp4_best"), r.get("tokens_per_s_mxfp4_best"),
                               r.get("tokens_per_s_mxfp4_best_over_fp8_best"), r.get("gpu_time_mxfp4_best_over_fp8_best")),
                        _num(r["saved_bytes_per_token_bf16"]),
                        _num(r["saved_bytes_per_token_fp8"]), _num(r["saved_bytes_per_token_mxfp4"]),
                        _num(r["saved_bytes_mxfp4_over_fp8"], 3), _num(r["expert_saved_bytes_mxfp4_over_fp8"], 3),
                        _num(r["dispatch_fwd_bytes_mxfp4_over_bf16"], 4)] for r in rows]), ""]


def _entry(name: str | None, tps: float | None, ratio: float | None, gpu_ratio: float | None = None) -> str:
    """'fp8@deepgemm 246771 (1.091x)', with the same pair's GPU-time ratio where profiled: '(0.903x; GPU time
    1.031x)'; '-' when not measured."""
    if tps is None:
        return "-"
    inner = [f"{ratio:.3f}x"] if ratio is not None else []
    inner += [f"GPU time {gpu_ratio:.3f}x"] if gpu_ratio is not None else []
    return f"{name} {_num(tps)}" + (f" ({'; '.join(inner)})" if inner else "")


def _f5_configs(rows: list[dict]) -> list[str]:
    out: list[str] = []
    for config in dict.fromkeys(r["config"] for r in rows):
        out += [f"Config: {config}", ""]
        out += [_md_table(["recipe", "train loss (smoothed)", "deviation", "eval loss", "deviation",
                           "paper deviation (16B, 160B tokens)"],
                          [[r["recipe"], _num(r["train_loss_smoothed"], 4), _dev(r, r["train_loss_dev_pct"]),
                            _num(r["eval_loss"], 4), _dev(r, r["eval_loss_dev_pct"]),
                            _dev(r, r["paper_dev_pct"], "+g")]
                           for r in rows if r["config"] == config]), ""]
    return out


def _setup_grids(rep: Report, labels: list[str]) -> list[str]:
    """Every measured setup's scope x recipe grid (scopes with nothing measured left out)."""
    scope_labels = {k: v["label"] for k, v in rep.numbers["t1"]["scopes"].items()}
    cells = list(dict.fromkeys((r["scope"], r["recipe"]) for r in rep.t1))
    recipes = list(dict.fromkeys(recipe for _, recipe in cells))
    scopes = list(dict.fromkeys(scope for scope, _ in cells))
    out: list[str] = []
    for lab in labels:
        grid = []
        for scope in scopes:
            got = [_cell(rep.t1, scope, recipe, "measured", lab) for recipe in recipes]
            if all(c is None or c["status"] == tables.NOT_MEASURED for c in got):
                continue
            grid.append([scope_labels.get(scope, scope), *(_grid_cell(c) for c in got)])
        if grid:
            out += [f"**{lab}** (tokens/GPU/s (min-max); peak memory):", "",
                    _md_table(["recompute scope", *recipes], grid), ""]
    return out


def _same_comparison(rep: Report, lab: str) -> list[str]:
    a, b, instead = _measured_headline_pair(rep, lab)
    tgs = _change(a, b, "tgs", pct=True)
    if tgs is None:
        return []
    vs = f" (fp8 at `{instead}`: {_FP8_FALLBACK})" if instead else ""
    return [f"Same comparison, measured on {lab}: tokens/GPU/s {_num(a['tgs'])} -> {_num(b['tgs'])} "
            f"({tgs:+.1f} %){vs}.", ""]


# ---------------------------------------------------------------------------------------------- markdown

def markdown(rep: Report) -> str:
    """The report: the headline table first (each paper number beside ours and the model's), then one section per
    figure with the newest measurement per GPU, then an appendix with the sources, every measured setup and the
    older measurements (all of them are also in the CSV files)."""
    n = rep.numbers
    t1_src = paper_mod.source_of(n, "t1")
    labels = [f"M{i}" for i in range(1, len(rep.setups) + 1)]
    head = _headline_setup(rep, labels)
    out = ["# fp4moe report: the paper's numbers beside ours", "",
           "Written by `python -m fp4moe.report` (also the last step of `make reproduce-table`) from the paper's "
           "numbers (`conf/paper/numbers.yaml`), the runs in the MLflow store and the paper-scale model "
           "(`fp4moe.scale`). Where each number comes from, in full: Appendix A.", ""]

    # ---- headline
    out += ["## The paper's numbers beside ours", ""]
    ours = [f"T1 from **{head}**: {rep.setups[labels.index(head)].label}" if head else
            "T1: no trainer runs in the store yet"]
    family5, spread5, single5 = _f5_headline(rep.f5)
    # the F5 section shows the headline's family seed by seed, every other configuration in Appendix E
    shown5 = [r for r in rep.f5 if r["family"] == family5]
    other5 = [r for r in rep.f5 if r["family"] != family5]
    seeds5 = _f5_headline_field(spread5, single5, "seeds", "seed")
    # a family names the GPU count only (tables.family_hardware): the GPUs its seeds ran on, named
    gpus5 = _f5_headline_field(spread5, single5, "hardware", "hardware")
    ours += ["F3 and F4: the newest benchmark of each GPU (sections F3, F4)",
             f"F5: {family5.replace('seed *', 'seeds ' + seeds5 if spread5 else 'seed ' + seeds5)}, run on {gpus5}"
             if family5 else "F5: no convergence comparison in the store yet"]
    out += ["Ours: " + "; ".join(ours) + ".", "",
            "A one-GPU proxy's tokens/GPU/s are not the paper's 671B model's on 256 GPUs, its peak memory is a share "
            "of its own GPU, and its loss gaps are a small model's after a short run: none of these has a ratio. "
            "`ours / paper` is given where the two are the same quantity, the headline's speed-up (as factors). "
            "The model column predicts the paper's own setup (experiment=paper_t1).", ""]
    out += [_md_table(["paper number", "paper", "ours", "ours / paper", MODEL_LABEL],
                      headline_rows(rep, head)), ""]

    # ---- T1
    out += ["## T1: throughput and peak memory per recompute scope x recipe", ""]
    if not rep.setups:
        out += ["Measured: **no trainer runs in the store yet**, so every measured cell says `not measured` "
                "(`python -m fp4moe.train experiment=proxy_t1_1gpu` on an H200 fills them).", ""]
    if rep.model_error:
        out += [f"Model: could not be evaluated ({rep.model_error}).", ""]
    header = ["recompute scope", "recipe", f"paper ({t1_src}): tokens/GPU/s",
              f"paper ({t1_src}): peak memory, % of {rep.gpu_memory_gb:g} GB"]
    if head:
        header += [f"measured ({head}): tokens/GPU/s", f"measured ({head}): peak memory"]
    if rep.model_rows is not None:
        header += [f"{MODEL_LABEL}: peak GiB", f"{MODEL_LABEL}: % of {rep.gpu_memory_gb:g} GB"]
    scope_labels = {k: v["label"] for k, v in n["t1"]["scopes"].items()}
    rows = []
    for scope, recipe in dict.fromkeys((r["scope"], r["recipe"]) for r in rep.t1):
        paper = _cell(rep.t1, scope, recipe, "paper")
        if paper is None or paper["status"] == "not in paper":
            continue
        row = [scope_labels.get(scope, scope), recipe, *_paper_cells(paper)]
        if head:
            row += _measured_cells(_cell(rep.t1, scope, recipe, "measured", head))
        if rep.model_rows is not None:
            row += _model_cells(_cell(rep.t1, scope, recipe, MODEL_LABEL))
        rows.append(row)
    out += [_md_table(header, rows), ""]
    if head:
        out += [f"Measured: tokens/GPU/s median over the measured steps (min-max); peak memory "
                f"`torch.cuda.max_memory_allocated`, % of that GPU's own memory, not of 80 GB. The measured columns "
                f"are {head}'s ({rep.setups[labels.index(head)].label}): of the setups that measured most of the "
                f"paper's cells (OOM counts as measured), the one with the most tokens per micro-batch. All "
                f"{len(labels)} measured setups, each with its grid: Appendix B.", ""]
    h = n["headline"]
    out += [f"Paper headline ({h['source']}): peak memory {h['peak_memory_change_pp']:+g} points of 80 GB "
            f"({h['peak_memory_change_gb']:+g} GB) and tokens/GPU/s {h['tgs_fp8']} -> {h['tgs_mxfp4']} "
            f"({h['tgs_change_pct']:+g} %), FP8 at `attn_ln_experts` against MXFP4 at `mla_up_proj` (a lighter "
            "scope only MXFP4 fits); at equal scope the gain is memory.", ""]
    if head:
        out += _same_comparison(rep, head)
    out += ["Plots: `t1_paper_vs_model.png` (paper and model)" + (", `t1_measured.png` (measured)" if rep.setups
            else "") + ". Long-form table: `t1.csv`; the model's memory by component: `t1_model_components.csv`.", ""]
    if rep.throughput:
        out += ["### T1 throughput ratios: the paper's against the model's prediction", "",
                "`fp4moe.scale.throughput` predicts ratios of tokens/GPU/s (not absolute rates) for the paper's T1 "
                "config from FLOPs over measured H200 rates, conversion bytes, all-to-all bytes over a link "
                "bandwidth that is OUR assumption (each column one), and optionally the profiled glue; its checks "
                "against our runs are in results/scale/throughput.md. A PREDICTION, not a measurement.", "",
                _md_table(["ratio of tokens/GPU/s", "paper", *rep.throughput_cases],
                          [[lab, _num(paper, 3), *(_num(v, 3) for v in preds)] for lab, paper, preds in rep.throughput]),
                ""]
    elif rep.throughput_error:
        out += [f"The model's throughput ratios could not be computed: {rep.throughput_error}.", ""]

    # ---- F3
    f3 = n["f3"]
    latest3, older3 = _latest(rep.f3, lambda r: (r["gpu"],), _f3_bench)
    out += ["## F3: conversion kernels", "",
            f"Paper ({f3['source']}): fused conversion kernels {f3['fused_speedup_min']}-{f3['fused_speedup_max']}x "
            "faster than separate quantize/dequantize.", ""]
    if not rep.f3:
        out += ["Measured: **no `kernels` runs in the store yet** (`make bench-kernels` on a GPU, or "
                "`make log-bench` for the results in `results/kernels/`).", ""]
    else:
        out += ["Measured (experiment `kernels`, the newest benchmark of each GPU): our kernels, % of the "
                "device-to-device copy bandwidth measured in the same run, and speedup = baseline time / our time "
                "for the same shape (`vs compiled unfused` is the closest to the paper's comparison).", ""]
        out += _f3_tables(latest3)
        out += [(f"Older benchmarks ({len({_f3_bench(r) for r in older3})}): Appendix C. " if older3 else "")
                + "Plot: `f3_kernels.png`. CSV: `f3_kernels.csv` (every benchmark).", ""]

    # ---- F4
    f4 = n["f4"]
    latest4, older4 = _f4_latest(rep.f4)
    out += ["## F4: the MoE layer", "",
            f"Paper ({f4['source']}): against Transformer Engine FP8, dense linears "
            f"{f4['dense_linear_overhead_min']}-{f4['dense_linear_overhead_max']}x overhead, expert GroupedLinear "
            f"{f4['expert_grouped_linear_speedup_min']}-{f4['expert_grouped_linear_speedup_max']}x faster. Ours "
            "compare the whole MoE layer (forward + backward) per recipe against our own FP8 recipe, not against "
            "Transformer Engine: not the same quantity.", ""]
    if not rep.f4:
        out += ["Measured: **no `moe_layer` runs in the store yet** (`make bench-layer` on a GPU; "
                "`make reproduce-table` logs `results/moe_layer/`).", ""]
    else:
        out += ["Measured (experiment `moe_layer`, the newest benchmark of each GPU and EP size; DeepSeek-V3's layer "
                "shape per GPU: hidden 7168, expert ffn 2048, top-8, one shared expert; tokens and local experts per "
                "GPU as given):", ""]
        out += _f4_table(latest4) + _f4_targets(latest4)
        out += [(f"Older benchmarks ({len({_f4_bench(r) for r in older4})}): Appendix D. " if older4 else "")
                + "Plot: `f4_layer.png`. CSV: `f4_layer.csv` (every benchmark).", ""]

    # ---- F5
    f5 = n["f5"]
    dev = f5["loss_deviation_vs_bf16_pct"]
    out += ["## F5: loss deviation from BF16", "",
            f"Paper ({f5['source']}; {f5['setup']['model_params_b']}B MoE, {f5['setup']['tokens_b']}B tokens): "
            + ", ".join(f"{k} {v:+g} %" for k, v in dev.items()) + " final training loss relative to BF16.", ""]
    if not rep.f5:
        out += ["Measured: **no finished bf16 run with another recipe of the same config in the store yet** "
                "(`python -m fp4moe.train experiment=tiny_cpu` runs one on CPU).", ""]
    else:
        out += [f"Measured: deviation = (loss - loss_bf16) / loss_bf16 at the end of the run, on the training loss "
                f"smoothed over the last {tables.LOSS_SMOOTH_STEPS} logged steps (`summary/final_loss` where no "
                "history was logged) and on the final held-out eval loss. "
                "Short runs of small models: not the paper's scale. The configurations set beside the paper's above "
                "(the newest family run from two seeds or more; without one, the newest), each seed:", ""]
        out += _f5_configs(shown5)
        spread = tables.f5_seed_spread(rep.f5)
        if spread:
            out += ["Across seeds (configs that differ only in the seed: other initial weights, the same data "
                    "order; each seed's recipes compared within one archive, i.e. one session and commit or a "
                    "seed's runs merged into one, on one GPU count, the GPU models listed): bf16's own "
                    "spread is the size of a deviation that noise makes at this length; a recipe's deviation is its "
                    "own when it keeps its sign and size from seed to seed.", ""]
            out += [_md_table(["config", "archives", "hardware", "recipe", "seeds", "eval loss spread",
                               "train loss spread", "eval deviation from bf16, per seed", "mean",
                               "range of the deviations"],
                              [[s["family"], s["archives"], s["hardware"], s["recipe"], s["seeds"],
                                _pct(s["eval_spread_pct"]),
                                _pct(s["train_spread_pct"]),
                                "reference" if s["eval_dev_pct_per_seed"] is None else
                                " / ".join("-" if v is None else f"{v:+.2f} %" for v in s["eval_dev_pct_per_seed"]),
                                "reference" if s["eval_dev_pct_per_seed"] is None else
                                ("-" if s["eval_dev_mean_pct"] is None else f"{s['eval_dev_mean_pct']:+.2f} %"),
                                "reference" if s["eval_dev_pct_per_seed"] is None else
                                ("-" if s["eval_dev_range_pts"] is None else f"{s['eval_dev_range_pts']:.2f} pts")]
                               for s in spread]), ""]
        out += _f5_by_pass(tables.f5_pass_rows(rep.f5, spread, rep.f5_stopped))
        out += [(f"Other configurations ({len({r['config'] for r in other5})}): Appendix E. " if other5 else "")
                + "Plot: `f5_loss.png`. CSV: `f5_loss.csv` (every configuration).", ""]

    # ---- appendix
    out += ["## Appendix A: where each number comes from", ""] + _sources(rep)
    out += ["## Appendix B: every measured setup (T1)", ""]
    if rep.setups:
        out += ["Throughput: tokens/GPU/s median over the measured steps, (min-max); peak memory: "
                "`torch.cuda.max_memory_allocated`, % of that GPU's own memory, not of 80 GB.", ""]
        out += [f"- **{lab}**: {s.label}" for lab, s in zip(labels, rep.setups)] + [""]
        out += _setup_grids(rep, labels)
        for lab in labels:
            if lab != head:
                out += _same_comparison(rep, lab)
    else:
        out += ["No trainer runs in the store yet.", ""]
    if older3:
        out += ["## Appendix C: older F3 benchmarks", ""] + _f3_tables(older3)
    if older4:
        out += ["## Appendix D: older F4 benchmarks", ""] + _f4_table(older4)
    if other5:
        out += ["## Appendix E: other F5 configurations", ""] + _f5_configs(other5)
    return "\n".join(out)


def _f5_by_pass(rows: list[dict]) -> list[str]:
    """Lines of the F5 section: ``tables.f5_pass_rows``, each recipe's training-loss deviation from bf16 at the end
    of each whole pass over the training split, mean over the seeds (one seed: its own; stopped runs: the passes
    they completed); [] if none."""
    if not rows:
        return []
    n = max(len(s["train_dev_by_pass_mean_pct"]) for s in rows)
    return [f"Runs that pass over their training split more than once (`data.train_tokens` / (global batch x "
            f"sequence length) steps a pass): the training-loss deviation from bf16 at the end of each whole pass "
            f"(smoothed the same way, over the steps of the passes so far), mean over the seeds (a family of one "
            f"seed: that seed's; a seed whose runs stopped before their end, e.g. when a device call's budget ran "
            f"out, gives the passes both its runs completed and says where they stopped). The training loss "
            f"of a second pass is the loss on text the run has trained on before; compare the end of the first "
            f"pass, and the held-out deviation above, with the final training-loss deviation.", "",
            _md_table(["config", "recipe", "seeds", "passes"] + [f"end of pass {k}" for k in range(1, n + 1)],
                      [[s["family"], s["recipe"], s["seeds"], f"{s['passes']:.2f}"]
                       + [f"{v:+.2f} %" for v in s["train_dev_by_pass_mean_pct"]]
                       + ["-"] * (n - len(s["train_dev_by_pass_mean_pct"])) for s in rows]), ""]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} %"


def _dev(row: dict, v: float | None, spec: str = "+.2f") -> str:
    if row["recipe"] == "bf16":
        return "reference"
    return "-" if v is None else f"{v:{spec}} %"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


# ---------------------------------------------------------------------------------------------- CSV, plots

def _csv(rows: list[dict], columns: Iterable[str]) -> bytes:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)) for k, v in r.items()})
    return buf.getvalue().encode()


# total_gb = allocated_gb (params + grads + optimizer + activations + transient) + cuda_context + nccl + deepep +
# allocator_gap (fp4moe.scale.memory, parts (a)-(f)); optimizer_host_gb is in host memory, in neither
MODEL_COLUMNS = ("scope", "recipe", "recompute", "total_gb", "allocated_gb", "mean_gb", "pct_of_gpu", "fits",
                 "pipeline_rank", "in_flight", "params_gb", "grads_gb", "optimizer_gb", "optimizer_host_gb",
                 "activations_gb", "transient_gb", "cuda_context_gb", "nccl_gb", "deepep_gb", "allocator_gap_gb")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _bars(ax, groups: list[str], series: dict[str, list[float | None]], labels_oom: dict[str, list[bool]] | None = None):
    width = 0.8 / max(1, len(series))
    for i, (name, vals) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [0 if v is None else v for v in vals], width, label=name,
               color=RECIPE_COLORS.get(name.split()[0]))
        for x, v, oom in zip(xs, vals, (labels_oom or {}).get(name, [False] * len(vals))):
            if oom:
                ax.text(x, 0, "OOM", rotation=90, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)


def plots(rep: Report) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, bytes] = {}
    scopes = list(dict.fromkeys(r["scope"] for r in rep.t1 if r["source"].startswith("paper")
                                and r["status"] != "not in paper"))
    recipes = list(dict.fromkeys(r["recipe"] for r in rep.t1 if r["source"].startswith("paper")
                                 and r["status"] != "not in paper"))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    pc = {(s, r): _cell(rep.t1, s, r, "paper") for s in scopes for r in recipes}
    _bars(a1, scopes, {r: [pc[s, r].get("tgs") for s in scopes] for r in recipes},
          {r: [pc[s, r]["status"] == tables.OOM for s in scopes] for r in recipes})
    a1.set_title("paper: tokens/GPU/s (671B, 256 GPUs)")
    _bars(a2, scopes, {r: [pc[s, r].get("peak_memory_pct") for s in scopes] for r in recipes},
          {r: [pc[s, r]["status"] == tables.OOM for s in scopes] for r in recipes})
    if rep.model_rows is not None:
        width = 0.8 / len(recipes)
        for i, r in enumerate(recipes):
            xs = [g + (i - (len(recipes) - 1) / 2) * width for g in range(len(scopes))]
            ys = [(_cell(rep.t1, s, r, MODEL_LABEL) or {}).get("peak_memory_pct") for s in scopes]
            a2.scatter(xs, [math.nan if y is None else y for y in ys], marker="D", color="black", zorder=3,
                       label=MODEL_LABEL if i == 0 else None)
    a2.axhline(100, color="red", lw=1, ls="--", label=f"{rep.gpu_memory_gb:g} GB")
    a2.set_title(f"peak memory, % of {rep.gpu_memory_gb:g} GB: paper bars, model diamonds")
    a2.legend(fontsize=8)
    a1.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out["t1_paper_vs_model.png"] = _png(fig)

    if rep.setups:
        labels = [f"M{i}" for i in range(1, len(rep.setups) + 1)]
        fig, axes = plt.subplots(len(labels), 2, figsize=(12, 4 * len(labels)), squeeze=False)
        mscopes = list(dict.fromkeys(r["scope"] for r in rep.t1))
        mrecipes = list(dict.fromkeys(r["recipe"] for r in rep.t1))
        for (a1, a2), lab in zip(axes, labels):
            cells = {(s, r): _cell(rep.t1, s, r, "measured", lab) for s in mscopes for r in mrecipes}
            oom = {r: [cells[s, r]["status"] == tables.OOM for s in mscopes] for r in mrecipes}
            _bars(a1, mscopes, {r: [cells[s, r].get("tgs") for s in mscopes] for r in mrecipes}, oom)
            _bars(a2, mscopes, {r: [cells[s, r].get("peak_memory_gb") for s in mscopes] for r in mrecipes}, oom)
            a1.set_title(f"{lab}: tokens/GPU/s (median)", fontsize=9)
            a2.set_title(f"{lab}: peak allocated GiB (blank: not measured)", fontsize=9)
            a1.legend(fontsize=8)
        fig.tight_layout()
        out["t1_measured.png"] = _png(fig)

    if rep.f3:
        benches = list(dict.fromkeys((r["gpu"], r["commit"], r["date"]) for r in rep.f3))
        fig, axes = plt.subplots(len(benches), 1, figsize=(10, 0.28 * len(rep.f3) + 1.5 * len(benches)), squeeze=False)
        for ax, b in zip(axes[:, 0], benches):
            rs = [r for r in rep.f3 if (r["gpu"], r["commit"], r["date"]) == b]
            ax.barh(range(len(rs)), [r["pct_copy"] or 0 for r in rs], color="#4C72B0")
            ax.set_yticks(range(len(rs)), [f"{r['kernel']} {r['shape']}" for r in rs], fontsize=7)
            ax.axvline(100, color="red", ls="--", lw=1, label="copy bandwidth")
            ax.set_xlim(0, 110)
            ax.invert_yaxis()
            ax.set_title(f"% of copy bandwidth: {b[0]}, commit {b[1]}, {b[2]}", fontsize=9)
            ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        out["f3_kernels.png"] = _png(fig)

    if rep.f4:
        groups = [f"{r['gpu']} EP{r['world_size']} {r['tokens']}x{r['local_experts']}\n{_commit_variant(r)}"
                  for r in rep.f4]
        fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(groups)), 4.5))
        _bars(ax, groups, {rec: [r[f"tokens_per_s_{rec}"] for r in rep.f4] for rec in ("bf16", "fp8", "mxfp4")})
        ax.set_ylabel("tokens/s per GPU (layer fwd + bwd)")
        ax.set_title("MoE layer benchmark (measured)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        out["f4_layer.png"] = _png(fig)

    if rep.loss_curves:
        configs = list(rep.loss_curves)
        fig, axes = plt.subplots(len(configs), 1, figsize=(9, 3.5 * len(configs)), squeeze=False)
        for i, (ax, config) in enumerate(zip(axes[:, 0], configs), 1):
            for rec, pts in rep.loss_curves[config].items():
                ax.plot([s for s, _ in pts], [v for _, v in pts], label=rec, color=RECIPE_COLORS.get(rec))
            ax.set_title(f"config {i} (see report.md): training loss", fontsize=9)
            ax.set_xlabel("step")
            ax.legend(fontsize=8)
        fig.tight_layout()
        out["f5_loss.png"] = _png(fig)
    return out


# ---------------------------------------------------------------------------------------------- writing

def render(rep: Report) -> dict[str, bytes]:
    """File name -> bytes of every output this report has."""
    files = {"report.md": markdown(rep).encode(), "t1.csv": _csv(rep.t1, tables.T1_COLUMNS),
             "f3_kernels.csv": _csv(rep.f3, tables.F3_COLUMNS), "f4_layer.csv": _csv(rep.f4, tables.F4_COLUMNS),
             "f5_loss.csv": _csv(rep.f5, tables.F5_COLUMNS)}
    if rep.model_rows is not None:
        files["t1_model_components.csv"] = _csv(rep.model_rows, MODEL_COLUMNS)
    files.update(plots(rep))
    return files


def write_report(rep: Report, out_dir: str | os.PathLike) -> list[Path]:
    """Write every file atomically into ``out_dir`` (created); remove report files this run does not produce."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = render(rep)
    written = []
    for name, data in files.items():
        path = out / name
        if not (path.is_file() and path.read_bytes() == data):
            write_bytes_atomic(path, data)
        written.append(path)
    for name in set(OUTPUTS) - set(files):
        (out / name).unlink(missing_ok=True)
    return written


__all__ = ["OUTPUTS", "Report", "build_report", "markdown", "render", "write_report"]
