"""The throughput model (fp4moe.scale.throughput) against the H200 proxy runs, and its prediction of the paper's T1
tokens/s ratios (issue 6, P5). No torch import.

    python -m fp4moe.analysis.throughput_calibration [--out FILE]   # results/scale/throughput.md (results/manifest.yaml)

Inputs: results/manifest.yaml's ``throughput`` roles. ``constants`` (results/scale/h200_constants.yaml): one set of
measured rates per code version (``rate_set``: today's, ``NOW``, and those of 2026-11-30, ``OLD``) and the profiles'
GPU time by kernel group; the runs archives of the checks: ``probe`` (the ratios of 2026-11-30), ``profile_cells``
and ``bf16_cells`` (the cells beside today's profiles), ``attn_block_cells`` and ``core_attention_cells`` (the whole
MLA block re-run), ``proxy_t1_row`` (the proxy's T1 at one micro-batch). Each check uses the rates of the code it
measured.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig

from ..paper import load as load_paper
from ..scale.memory import ATTN_RECOMPUTE, _dims, compose_cfg
from ..scale.throughput import (BLOCK_OF, SCOPES, Rates, TimeBreakdown, attention_rate_from_profile,
                                time_per_token)
from . import manifest
from .output import markdown_cli

RECIPES = ("bf16", "fp8", "mxfp4")
PAPER_SCOPES = ("attn_ln_experts", "attn_ln_mlp", "mla_up_proj")
NOW, OLD = "now", "2026-11-30"   # the rate sets: today's code, the code of 2026-11-30


# ---------------------------------------------------------------------------------------------- measured rates

@dataclass(frozen=True)
class RateSet:
    """One code version's measured ``rates``, the rows of the document's table of constants (``sources``: constant,
    value, source) and where the attention rate is derived from (``attention_source``)."""

    name: str
    rates: Rates
    sources: tuple[tuple[str, str, str], ...]
    attention_source: str


_NOT_FIELDS = ("base", "sources", "attention_source", "weight_quant", "swiglu_kernel_ms", "swiglu_elements")


def _fields(name: str, sets: dict[str, Any]) -> dict[str, Any]:
    """The ``Rates`` fields of set ``name``: its ``base``'s, changed by its own (lists become tuples); the weight
    quantization per parameter (seconds / parameters) and the SwiGLU seconds per element (the kernels' [routed, shared]
    ms summed, / elements) computed from what was read."""
    raw = sets[name]
    out = _fields(raw["base"], sets) if "base" in raw else {}
    out.update({k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k not in _NOT_FIELDS})
    if "weight_quant" in raw:
        w = raw["weight_quant"]
        out["weight_quant_s_per_param"] = w["seconds"] / math.prod(w["parameters"])
    if "swiglu_kernel_ms" in raw:
        e = raw["swiglu_elements"]
        out["swiglu_s_per_elem"] = tuple((rec, (sum(d["forward"]) * 1e-3 / e, sum(d["backward"]) * 1e-3 / e))
                                         for rec, d in raw["swiglu_kernel_ms"].items())
    return out


def _constants() -> dict[str, Any]:
    return manifest.constants("throughput")["throughput"]


@functools.cache
def rate_set(name: str = NOW) -> RateSet:
    """The measured rate set ``name`` (``NOW`` | ``OLD``) of the constants file."""
    sets = _constants()["rates"]
    raw = sets[name]
    return RateSet(name, Rates(**_fields(name, sets)), tuple(tuple(r) for r in raw["sources"]), raw["attention_source"])


def measured_rates(name: str = NOW) -> Rates:
    """``rate_set(name).rates``."""
    return rate_set(name).rates


@functools.cache
def profile_groups(name: str) -> dict[str, tuple]:
    """{label: (TimeBreakdown terms 'a+b' | 'total', measured ms of fp8, of mxfp4 (bf16: its own))} of a profile set
    (``NOW``, ``OLD`` or 'bf16')."""
    return {g[0]: tuple(g[1:]) for g in _constants()["profiles"][name]["groups"]}


# ---------------------------------------------------------------------------------------------- proxy vs measured

def proxy_cfg(recipe: str, scope: str, micro_batch: int) -> DictConfig:
    """The probe's config: proxy_h200 on one GPU, FP8 on every linear (experiment proxy_t1_1gpu)."""
    cfg = compose_cfg("proxy_h200", "single_gpu", scope, recipe)
    cfg.parallel.micro_batch = micro_batch
    cfg.parallel.global_batch = micro_batch
    cfg.precision.scope = "all_linears"
    return cfg


def measured_runs(archive: str | Path, params: dict | None = None,
                  tags: dict[str, dict] | None = None) -> dict[tuple[str, str, int], list[float]]:
    """{(recipe, scope, micro_batch): [summary/tgs_median of each run]} of a runs archive, in archive order; with
    ``tags`` ({recipe: {tag: value}}), only the runs of that recipe that carry those tags, a value None meaning the
    tag must be absent (e.g. ``{"mxfp4": {"env.FP4MOE_CUDA_COL": "1"}}``: the mxfp4 runs with the CUDA C++ column
    kernel, where the untagged ones ran the Triton kernel); with ``params``, only the
    runs whose logged params have those values (e.g. ``{"train.steps": 30}``: the 30-step cells of an archive that
    also holds 16-step ones)."""
    from fp4moe.runs.archive import load

    out: dict[tuple[str, str, int], list[float]] = {}
    for r in load(Path(archive))["runs"]:
        m, t = r["metrics"], r["tags"]
        tgs = m.get("summary/tgs_median")
        if not tgs or t.get("outcome") == "OOM":
            continue
        if any(t.get(k) != v for k, v in (tags or {}).get(t["recipe"], {}).items()):
            continue
        if any(r["params"].get(k) != str(v) for k, v in (params or {}).items()):
            continue
        out.setdefault((t["recipe"], t["recompute"], int(r["params"]["parallel.micro_batch"])), []).append(
            float(tgs[-1][1]))
    return out


def uses_runs(role: str) -> dict[tuple[str, str, int], list[float]]:
    """``measured_runs`` of the manifest's archive of a ``throughput`` role, with the ``params`` / ``tags`` it names."""
    entry, use = manifest.load().one("throughput", role)
    return measured_runs(entry.file, params=use.get("params"), tags=use.get("tags"))


def measured_tgs(archive: str | Path | None = None) -> dict[tuple[str, str, int], float]:
    """{(recipe, scope, micro_batch): summary/tgs_median} of the runs archive (default: the manifest's ``probe``; runs
    without it are left out; of several runs of one cell, the last in the archive)."""
    runs = uses_runs("probe") if archive is None else measured_runs(archive)
    return {cell: tgs[-1] for cell, tgs in runs.items()}


@dataclass(frozen=True)
class RatioRow:
    """tokens/GPU/s of cell a over cell b: predicted (inverse time per token) and measured."""

    kind: str            # 'recipe' (same scope) or 'scope' (same recipe)
    a: tuple             # (recipe, scope)
    b: tuple
    micro_batch: int
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted / self.measured - 1


def proxy_ratios(rates: Rates | None = None, archive: str | Path | None = None,
                 micro_batches=(8, 16)) -> list[RatioRow]:
    """Predicted vs measured tokens/s ratios on the H200 proxy: recipe vs recipe at equal scope (mxfp4/fp8,
    fp8/bf16, mxfp4/bf16) and scope vs attn_ln_experts within a recipe, at each probed micro-batch. The probe
    (default: the manifest's) measured the code of 2026-11-30: its rates (``OLD``) are the default."""
    rates = measured_rates(OLD) if rates is None else rates
    meas = measured_tgs(archive)
    pred = {(r, s, mb): time_per_token(proxy_cfg(r, s, mb), rates).total
            for r in RECIPES for s in SCOPES for mb in micro_batches}
    rows = []
    for mb in micro_batches:
        for s in SCOPES:
            for a, b in (("mxfp4", "fp8"), ("fp8", "bf16"), ("mxfp4", "bf16")):
                if (a, s, mb) in meas and (b, s, mb) in meas:
                    rows.append(RatioRow("recipe", (a, s), (b, s), mb, pred[(b, s, mb)] / pred[(a, s, mb)],
                                         meas[(a, s, mb)] / meas[(b, s, mb)]))
        for r in RECIPES:
            for s in SCOPES:
                if s == "attn_ln_experts" or (r, s, mb) not in meas or (r, "attn_ln_experts", mb) not in meas:
                    continue
                rows.append(RatioRow("scope", (r, s), (r, "attn_ln_experts"), mb,
                                     pred[(r, "attn_ln_experts", mb)] / pred[(r, s, mb)],
                                     meas[(r, s, mb)] / meas[(r, "attn_ln_experts", mb)]))
    return rows


def profile_tgs_now() -> dict[str, float]:
    """{recipe: mean tokens/GPU/s} of the cells Check 1 sets beside today's profiles (the manifest's
    ``profile_cells``: the same cells alone in their processes, on the same machine)."""
    runs = uses_runs("profile_cells")
    return {rec: sum(runs[(rec, "attn_ln_mlp", 32)]) / len(runs[(rec, "attn_ln_mlp", 32)]) for rec in ("fp8", "mxfp4")}


def profile_idle_ms() -> dict[str, float]:
    """The idle GPU time of today's three profiles, ms per two steps (megatron's SequentialMLP launches one cuBLAS GEMM
    per expert: bf16's host gaps)."""
    return dict(_constants()["profiles"]["bf16"]["idle_ms"])


def _group_ms(tb: TimeBreakdown, key: str, rates: Rates) -> float:
    """Milliseconds over the profile's tokens (``rates.glue_tokens``) of the terms ``key`` names ('a+b'; 'total':
    every term)."""
    t = tb.total if key == "total" else sum(tb.terms.get(k, 0.0) for k in key.split("+"))
    return t * rates.glue_tokens * 1e3


def profile_check_bf16(rates: Rates | None = None) -> list[tuple[str, float, float]]:
    """(group, predicted ms, measured ms) of bf16's profiled run (``profile_groups('bf16')``) over its tokens, for
    ``rates`` (default: today's)."""
    rates = measured_rates(NOW) if rates is None else rates
    tb = time_per_token(proxy_cfg("bf16", rates.prof_scope, rates.prof_micro_batch), rates)
    return [(label, _group_ms(tb, key, rates), ms) for label, (key, ms) in profile_groups("bf16").items()]


def bf16_tgs_now() -> dict[str, float]:
    """{recipe: mean tokens/GPU/s} of the attn_ln_mlp cells of the manifest's ``bf16_cells`` (bf16 beside fp8 at the
    profiles' setting, each cell alone in its process, alternated; the runs its ``params`` name)."""
    runs = uses_runs("bf16_cells")
    return {rec: sum(v) / len(v) for (rec, sc, _), v in runs.items() if sc == "attn_ln_mlp"}


def profile_check(name: str = OLD, rates: Rates | None = None) -> list[tuple[str, str, float, float]]:
    """(group, recipe, predicted ms, measured ms) for the profiled runs of rate set ``name`` (``OLD``: micro-batch
    16; ``NOW``: 32), over the profile's tokens, predicted with ``rates`` (default: the set's own)."""
    rates = measured_rates(name) if rates is None else rates
    groups = profile_groups(name)
    out = []
    for i, rec in enumerate(("fp8", "mxfp4")):
        tb = time_per_token(proxy_cfg(rec, rates.prof_scope, rates.prof_micro_batch), rates)
        for label, (key, *ms) in groups.items():
            out.append((label, rec, _group_ms(tb, key, rates), ms[i]))
    return out


# ---------------------------------------------------------------------------------------------- paper T1

@functools.lru_cache(maxsize=1)
def glue_scale_paper() -> float:
    """Glue per layer at paper scale / the proxy's: ratio of the bf16 bytes one MoE layer saves per token with no
    recompute (``memory.layer_saved_tensors``), a stand-in for the elementwise traffic per layer and token.
    An ASSUMPTION (the paper's stack, Transformer Engine, fuses most of this glue)."""
    from ..scale.memory import layer_saved_tensors

    def per_token(cfg):
        d = _dims(cfg)
        return sum(t.bytes for t in layer_saved_tensors(cfg, "moe", "none")) / d.t_tok

    return per_token(compose_cfg("dsv3_671b", "paper_671b", "none", "bf16")) / per_token(
        proxy_cfg("bf16", "none", 16))


PAPER_RATIOS = (  # (label, (recipe, scope) a, (recipe, scope) b)
    ("fp8 / bf16, attn_ln_experts", ("fp8", "attn_ln_experts"), ("bf16", "attn_ln_experts")),
    ("mxfp4 / fp8, attn_ln_experts", ("mxfp4", "attn_ln_experts"), ("fp8", "attn_ln_experts")),
    ("mxfp4 / bf16, attn_ln_experts", ("mxfp4", "attn_ln_experts"), ("bf16", "attn_ln_experts")),
    ("mxfp4: attn_ln_mlp / attn_ln_experts", ("mxfp4", "attn_ln_mlp"), ("mxfp4", "attn_ln_experts")),
    ("mxfp4: mla_up_proj / attn_ln_experts", ("mxfp4", "mla_up_proj"), ("mxfp4", "attn_ln_experts")),
    ("headline: mxfp4 mla_up_proj / fp8 attn_ln_experts", ("mxfp4", "mla_up_proj"), ("fp8", "attn_ln_experts")),
)
PAPER_CASES = (  # (column label, link GB/s, glue on, grouped FP8 fraction of dense or None = the rates')
    # the bandwidths are OUR statements, not the paper's network
    ("EP over NVLink 150 GB/s, no glue", 150.0, False, None),
    ("EP over network 40 GB/s, no glue", 40.0, False, None),
    ("NVLink 150 GB/s, our glue scaled", 150.0, True, None),
    ("NVLink 150 GB/s, no glue, grouped FP8 at the dense rate", 150.0, False, 1.0),
)


# The paper's runs: the lab's scripts dispatch with DeepEP (megatron-core's 'flex'; sister artifact
# 021ai/FP8-FLOW-MOE-AE, run_dlc_e2e.sh DISPATCHER_TYPE=flex_deepep), an assumption of this model. fp4moe itself
# runs conf/parallel/paper_671b.yaml's 'alltoall'.
PAPER_DISPATCHER = "flex"


def paper_numbers() -> dict:
    """The paper's T1 cells (conf/paper/numbers.yaml ``t1.cells``, fp4moe.paper)."""
    return load_paper()["t1"]["cells"]


def paper_t1_time(recipe: str, scope: str, link_bandwidth_gb_s: float, glue: bool,
                  rates: Rates | None = None) -> TimeBreakdown:
    """Seconds per token of the slowest stage of T1 (dsv3_671b, paper_671b, precision.scope all_linears as
    conf/experiment/paper_t1.yaml), FP8 weights cached per step (Transformer Engine); ``rates``: default today's."""
    rates = measured_rates(NOW) if rates is None else rates
    cfg = compose_cfg("dsv3_671b", "paper_671b", scope, recipe)
    cfg.precision.scope = "all_linears"
    cfg.parallel.dispatcher = PAPER_DISPATCHER
    return time_per_token(cfg, replace(rates, glue=glue), link_bandwidth_gb_s=link_bandwidth_gb_s,
                          glue_scale=glue_scale_paper() if glue else 1.0, weight_quant_per="step")


ATTENTION_READINGS = ATTN_RECOMPUTE   # the memory model's readings: ("core_attn", "self_attention")


def paper_prediction(rates: Rates | None = None, cells: dict | None = None,
                     attention: str = "core_attn") -> list[tuple[str, float | None, list[float]]]:
    """(label, paper ratio or None, [predicted ratio per PAPER_CASES]) with ``rates`` (default: today's); ``cells``:
    the paper's T1 cells (``numbers.yaml``'s ``t1.cells``; default conf/paper/numbers.yaml). ``attention``: what the
    paper's "attention" in its scopes re-runs, 'core_attn' (the core attention: attn_ln_*) or 'self_attention' (the
    whole MLA block: attn_block_ln_*; the reading results/scale/paper_t1.md supports)."""
    rates = measured_rates(NOW) if rates is None else rates
    if attention not in ATTENTION_READINGS:
        raise ValueError(f"attention={attention!r}: one of {ATTENTION_READINGS}")
    ours = (lambda scope: BLOCK_OF.get(scope, scope)) if attention == "self_attention" else (lambda scope: scope)
    cells = cells if cells is not None else paper_numbers()
    out = []
    for label, a, b in PAPER_RATIOS:
        ta, tb_ = cells[a[1]][a[0]]["tgs"], cells[b[1]][b[0]]["tgs"]
        paper = ta / tb_ if ta and tb_ else None
        preds = []
        for _, bw, glue, frac in PAPER_CASES:
            r = rates if frac is None else replace(rates, grouped_fp8_fraction=frac)
            preds.append(paper_t1_time(b[0], ours(b[1]), bw, glue, r).total
                         / paper_t1_time(a[0], ours(a[1]), bw, glue, r).total)
        out.append((label, paper, preds))
    return out


# ------------------------------------------------------------------------------------- proxy T1, one micro-batch

# The paper's T1 holds the micro-batch fixed (1) and lets the recompute scope decide what fits in 80 GB. On one
# H200 the proxy's best cells need no recompute at micro-batch 32 (results/train_proxy/README.md section 18), so
# its T1 in the paper's terms is a micro-batch large enough that fp8 must recompute: 64.
PROXY_T1_MICRO_BATCH = 64
# The row measured after the prediction (the manifest's ``proxy_t1_row``, whose ``predicted_at`` is the commit that
# holds the prediction): every cell at 64, each in its own process; the tokens/s compared are the 30-step runs' (the
# last 20 measured). bf16 full and fp8 none / attn_ln_mlp ran 8 steps in a later call (what fits; bf16's tokens/s is
# not compared). results/train_proxy/README.md section 19.
PROXY_T1_STEPS = 30


@dataclass(frozen=True)
class FixedCell:
    """One cell of the proxy's T1 at a fixed micro-batch: the memory model's peak (today's code, GiB), what that
    means on the GPU (``outcome``: calibration.fit_outcome, 'fits' | 'edge' | 'OOM'), and the throughput model's
    tokens/s over fp8's fastest cell that fits (fp8 and mxfp4 only: the model leaves out bf16's idle GPU between
    megatron's per-expert GEMMs, Check 1; None where no fp8 cell fits)."""

    recipe: str
    scope: str
    peak_gib: float
    outcome: str
    vs_fp8_best: float | None

    @property
    def fits(self) -> bool:
        return self.outcome == "fits"


def proxy_t1_fixed(micro_batch: int = PROXY_T1_MICRO_BATCH, usable_gib: float | None = None,
                   rates: Rates | None = None) -> list[FixedCell]:
    """Every recipe x scope of the proxy at one micro-batch: predicted peak (``memory.per_gpu_memory`` with the
    assumptions of today's code, ``calibration.FIRST_PRINCIPLES``), its outcome against ``usable_gib`` (default: the
    H200's measured usable capacity, ``calibration.h200_memory``) within the model's error range, and for fp8 /
    mxfp4 the predicted tokens/s over fp8's fastest scope that fits (``rates``: default today's)."""
    from ..scale.memory import GB, per_gpu_memory, recipe_of
    from .calibration import FIRST_PRINCIPLES, fit_outcome, h200_memory

    rates = measured_rates(NOW) if rates is None else rates
    usable = h200_memory().usable_gib if usable_gib is None else usable_gib
    peak, time, out = {}, {}, {}
    for rec in RECIPES:
        for sc in SCOPES:
            cfg = proxy_cfg(rec, sc, micro_batch)
            recipe = recipe_of(cfg)  # parsed once for both models
            peak[rec, sc] = per_gpu_memory(cfg, FIRST_PRINCIPLES, recipe=recipe).allocated_bytes / GB
            time[rec, sc] = time_per_token(cfg, rates, recipe=recipe).total
            out[rec, sc] = fit_outcome(peak[rec, sc], usable)
    fp8_fit = [time["fp8", sc] for sc in SCOPES if out["fp8", sc] == "fits"]
    best = min(fp8_fit) if fp8_fit else None
    return [FixedCell(rec, sc, peak[rec, sc], out[rec, sc],
                      best / time[rec, sc] if best is not None and rec != "bf16" else None)
            for rec in RECIPES for sc in SCOPES]


@dataclass(frozen=True)
class MeasuredCell:
    """A run of the fixed micro-batch row: 'ok' or 'OOM', its peak allocated (GiB) and tokens/GPU/s (median of
    the measured steps) where it fit, and how many steps it ran."""

    outcome: str
    peak_gib: float | None
    tgs: float | None
    steps: int


def proxy_t1_measured(archive: str | Path | None = None,
                      micro_batch: int = PROXY_T1_MICRO_BATCH) -> dict[tuple[str, str], MeasuredCell]:
    """{(recipe, scope): MeasuredCell} of the archive's runs at ``micro_batch`` (default: the manifest's
    ``proxy_t1_row``; the last run of a cell wins)."""
    from fp4moe.runs.archive import load

    path = manifest.load().one("throughput", "proxy_t1_row")[0].file if archive is None else Path(archive)
    out = {}
    for r in load(path)["runs"]:
        if int(r["params"]["parallel.micro_batch"]) != micro_batch:
            continue
        t, m = r["tags"], r["metrics"]
        ok = t.get("outcome") != "OOM"
        peak, tgs = m.get("summary/peak_mem_allocated_gb"), m.get("summary/tgs_median")
        out[t["recipe"], t["recompute"]] = MeasuredCell("ok" if ok else "OOM",
                                                        float(peak[-1][1]) if ok and peak else None,
                                                        float(tgs[-1][1]) if ok and tgs else None,
                                                        int(r["params"]["train.steps"]))
    return out


# ---------------------------------------------------------------------------------------------- whole block

# T1 cells at micro-batch 32, one process each, 16 steps (the last 6 measured): the whole-block scopes (the
# manifest's ``attn_block_cells``) and the core-attention pair they compare with (``core_attention_cells``: the runs
# with the CUDA C++ column kernel, which the whole-block code runs by default; two runs each, alternating). The two
# archives were measured in two sessions on two machines.


def block_rates() -> Rates:
    """Today's rates for the code the whole-block cells ran: it quantized the dispatch per row."""
    return replace(measured_rates(NOW), dispatch_quantize_per_token=False)


def block_check(rates: Rates | None = None, micro_batch: int = 32) -> list[RatioRow]:
    """Predicted (``rates``: default ``block_rates()``) vs measured tokens/s: the whole-block scope over its
    core-attention scope (same recipe), and mxfp4 / fp8 at each whole-block scope, where the two archives hold both
    cells (means over their runs)."""
    rates = block_rates() if rates is None else rates
    meas = {**uses_runs("core_attention_cells"), **uses_runs("attn_block_cells")}
    mean = {k: sum(v) / len(v) for k, v in meas.items()}
    t = lambda r, s: time_per_token(proxy_cfg(r, s, micro_batch), rates).total  # noqa: E731
    rows = []
    for core, blk in BLOCK_OF.items():
        for r in RECIPES:
            a, b = (r, blk, micro_batch), (r, core, micro_batch)
            if a in mean and b in mean:
                rows.append(RatioRow("scope", (r, blk), (r, core), micro_batch, t(r, core) / t(r, blk),
                                     mean[a] / mean[b]))
        a, b = ("mxfp4", blk, micro_batch), ("fp8", blk, micro_batch)
        if a in mean and b in mean:
            rows.append(RatioRow("recipe", ("mxfp4", blk), ("fp8", blk), micro_batch, t("fp8", blk) / t("mxfp4", blk),
                                 mean[a] / mean[b]))
    return rows


def proxy_t1_section(rates: Rates | None = None) -> list[str]:
    """Check 4: the fixed micro-batch row, predicted (memory and throughput models; ``rates``: default today's)
    beside measured."""
    from .calibration import contradicts, h200_memory

    h = h200_memory()
    row, use = manifest.load().one("throughput", "proxy_t1_row")
    fixed = {(c.recipe, c.scope): c for c in proxy_t1_fixed(rates=rates)}
    meas = proxy_t1_measured(row.file)
    base = meas.get(("fp8", "full"))
    L = ["", f"## Check 4: the proxy's T1 at one micro-batch (predicted in {use.get('predicted_at')}, then measured)",
         "",
         f"proxy_h200 on one H200 at micro-batch {PROXY_T1_MICRO_BATCH} for every scope, as the paper holds its "
         "micro-batch and lets the scope decide what fits. Predicted: the peak from the memory model for today's code "
         "and what it means against the usable capacity "
         f"({h.usable_gib:.2f} GiB = torch's {h.torch_capacity_gib:.2f} less {h.non_torch_gib:.2f} GiB "
         "outside PyTorch's allocator, measured; **edge**: within the model's error of it; results/scale/"
         "calibration.md, \"Fits or OOM\"), and tokens/s over fp8's fastest fitting scope from today's constants. "
         f"The ratios were committed ({use.get('predicted_at')}) before the row ran; the fit rule was refined after "
         f"it, from the OOM messages (against nvidia-smi's {h.nvidia_smi_gib:.1f} GiB the two bf16 edge cells had been "
         f"called fits). Measured: `{row.repo_path}`, each cell in its own process, {PROXY_T1_STEPS} steps with the "
         "last 20 measured (* : 8 steps, the last 4 measured). On one H200 at micro-batch 32 both recipes fit without "
         "recompute (results/train_proxy/README.md section 18), which is why the micro-batch is 64 here.", "",
         "| recipe | scope | peak pred. (GiB) | predicted | measured | peak meas. (GiB) | tokens/GPU/s | "
         "/ fp8 full meas. | / fp8 full pred. | pred. / meas. - 1 |",
         "|---|---|---:|---|---|---:|---:|---:|---:|---:|"]
    rows = []
    for rec in RECIPES:
        for sc in SCOPES:
            c, m = fixed[rec, sc], meas.get((rec, sc))
            ratio = (m.tgs / base.tgs if m and m.tgs and base and base.tgs and m.steps == PROXY_T1_STEPS
                     and rec != "bf16" else None)
            pred = c.vs_fp8_best if c.fits else None
            if ratio is not None and pred is not None:
                rows.append((rec, sc, ratio, pred))
            tgs = "-" if not (m and m.tgs) else f"{m.tgs:.0f}" + ("" if m.steps == PROXY_T1_STEPS else " *")
            L.append(f"| {rec} | {sc} | {c.peak_gib:.1f} | {c.outcome} | {m.outcome if m else 'not run'} | "
                     f"{_f2(m.peak_gib if m else None)} | {tgs} | {_f3(ratio)} | {_f3(pred)} | "
                     + ("- |" if ratio is None or pred is None else f"{100 * (pred / ratio - 1):+.1f} % |"))
    wrong = [k for k, c in fixed.items() if k in meas and contradicts(meas[k].outcome, c.outcome)]
    fit = {rec: [sc for sc in SCOPES if (rec, sc) in meas and meas[rec, sc].outcome == "ok"] for rec in RECIPES}
    edge_oom = [f"{r} {sc}" for (r, sc), c in fixed.items() if c.outcome == "edge" and (r, sc) in meas
                and meas[r, sc].outcome == "OOM"]
    L += ["", f"- **What fits: {len(meas)} of {len(fixed)} cells run, {len(wrong) or 'none'} against the "
          "prediction.** " + "; ".join(f"{rec} fits {', '.join(fit[rec]) or 'nothing'}" for rec in RECIPES)
          + (f" (edge cells that went OOM: {', '.join(edge_oom)})" if edge_oom else "") + "."]
    mx = [r for r in rows if r[0] == "mxfp4"]
    if mx:
        top = max(mx, key=lambda r: r[2])
        paper = [r for r in mx if r[1] in ("attn_ln_experts", "attn_ln_mlp", "mla_up_proj")]
        only = [r for r in mx if r[1] not in fit["fp8"]]
        errs = [100 * (r[3] / r[2] - 1) for r in mx]
        met = all(r[2] >= 1.10 for r in only)
        L += [f"- **The T1 row in the paper's terms: mxfp4's fastest scope ({top[1]}) at {top[2]:.3f}x fp8's best "
              f"(fp8 fits {', '.join(fit['fp8'])}; predicted {top[3]:.3f}); at the paper's three "
              f"scopes {_range([r[2] for r in paper], 3)} (predicted {_range([r[3] for r in paper], 3)}).** Issue "
              f"4's target, 1.10x fp8's best at a scope only mxfp4 fits, is {'met' if met else 'NOT met'} at "
              f"{'every one' if met else 'some'} of those scopes ({_range([r[2] for r in only], 3)}); the paper's "
              "headline is 1.125x.",
              f"- The prediction is {min(errs):+.1f} % to {max(errs):+.1f} % off the measured mxfp4 / fp8 ratios "
              f"({sum(r[3] < r[2] for r in mx)} of {len(mx)} under-predicted; Check 1 under-predicts mxfp4 at "
              "equal scope too)."]
    return L


# ---------------------------------------------------------------------------------------------- report

def _f2(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _f3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _cell(rs) -> str:
    return f"{rs[0]} @ {rs[1]}"


def _range(vals, digits: int = 2) -> str:
    lo, hi = f"{min(vals):.{digits}f}", f"{max(vals):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def _paper_table(rates: Rates, attention: str) -> tuple[list[str], dict[str, tuple]]:
    rows = paper_prediction(rates, attention=attention)
    L = ["| ratio of tokens/s | paper | " + " | ".join(c[0] for c in PAPER_CASES) + " |",
         "|---|---:|" + "---:|" * len(PAPER_CASES)]
    for label, paper, preds in rows:
        ps = f"{paper:.3f}" if paper else "-"
        L.append(f"| {label} | {ps} | " + " | ".join(f"{p:.3f}" for p in preds) + " |")
    return L, {label: (paper, preds) for label, paper, preds in rows}


def markdown() -> str:
    """results/scale/throughput.md's text from the manifest's inputs."""
    m = manifest.load()
    now, before = rate_set(NOW), rate_set(OLD)
    rates, old = now.rates, before.rates
    rows = proxy_ratios(old)
    att, att_old = attention_rate_from_profile(rates), attention_rate_from_profile(old)
    probe = m.one("throughput", "probe")[0]
    idle = profile_idle_ms()
    L = ["# Throughput model: predicted vs measured tokens/GPU/s ratios (issue 6, P5)", "",
         "Written by `python -m fp4moe.analysis.throughput_calibration` (src/fp4moe/scale/throughput.py; its "
         "docstring has every formula). **The model predicts ratios of tokens/GPU/s, not absolute tokens/s.** Time per token = GEMM "
         "FLOPs / measured rates + conversion bytes / measured kernel bandwidth + FP8 weight quantization + "
         "all-to-all bytes / a stated link bandwidth + measured torch glue (+ the fused SwiGLU kernels, measured). "
         "Nothing is fitted to the ratios below. Each check uses the constants of the code it measured: today's "
         f"(`{NOW}` in results/scale/h200_constants.yaml) for the micro-batch 32 profiles, the whole-block cells and "
         f"the paper's T1; those of 2026-11-30 (`{OLD}`) for the runs of that code.",
         "", "## Measured constants", "", f"Today's (`{NOW}`):", "", "| constant | value | source |", "|---|---|---|"]
    L += [f"| {n} | {v} | {s} |" for n, v, s in now.sources]
    L += [f"| attention (derived) | {att:.0f} TFLOP/s | {now.attention_source} |", "",
          f"Of 2026-11-30 (`{OLD}`; before the kernel work of 2026-12-01 made the FP4 conversions 1.3-2.4x "
          "faster and the SwiGLU a fused kernel):", "", "| constant | value | source |", "|---|---|---|"]
    L += [f"| {n} | {v} | {s} |" for n, v, s in before.sources]
    L += [f"| attention (derived) | {att_old:.0f} TFLOP/s | {before.attention_source} |", ""]

    def check1(name: str, title: str, src: str, tgs: dict) -> None:
        r = measured_rates(name)
        L.extend([title, "", "Absolute times here only check the terms against the profile; the attention rate, the "
              "glue and (today) the SwiGLU kernels are taken from this same profile, so those rows agree by "
              "construction.", "", "| group | recipe | predicted ms | measured ms | predicted / measured |",
              "|---|---|---:|---:|---:|"])
        L.extend(f"| {g} | {rec} | {p:.1f} | {ms:.1f} | {p / ms:.3f} |" for g, rec, p, ms in profile_check(name))
        pf = time_per_token(proxy_cfg("fp8", r.prof_scope, r.prof_micro_batch), r).total
        pm = time_per_token(proxy_cfg("mxfp4", r.prof_scope, r.prof_micro_batch), r).total
        L.extend(["", f"mxfp4 / fp8 tokens/s of these two cells (each alone in its process, {src}): predicted "
                  f"{pf / pm:.3f}, measured {tgs['mxfp4'] / tgs['fp8']:.3f} ({tgs['mxfp4']:.0f} / {tgs['fp8']:.0f}).",
                  ""])

    cells = m.one("throughput", "profile_cells")[0]
    check1(NOW, "## Check 1: today's profiles, GPU time by kernel group (mb 32, attn_ln_mlp, 262144 tokens)",
           f"T1 cells of {cells.name}, steps 11-30, two runs each alternated on the "
           "profiles' machine", profile_tgs_now())
    g = {(lab, rec): ms for lab, rec, _, ms in profile_check(NOW)}
    faster = [100 * (1 - g[(lab, "mxfp4")] / g[(lab, "fp8")]) for lab in profile_groups(NOW)
              if lab.startswith(("grouped", "cuBLAS", "attention"))]
    L += ["- The conversion kernels, predicted from the kernel benchmarks alone (bytes / measured GB/s), land within "
          "3 % of the profile for both recipes (mxfp4's with the dispatch quantized per token). The grouped FP8 "
          "GEMMs run 10-11 % faster in the trainer than the layer benchmark's rate fraction (0.48 of dense) says, "
          "the cuBLAS ones 6-8 % slower.",
          "- The two profiles ran on one machine, one after the other, both GPU-bound (42 / 54 ms of idle GPU in "
          "1490 / 1503 ms). The kernels both recipes share (grouped GEMMs, cuBLAS GEMMs, attention: the same shapes "
          f"and FLOPs) still ran {_range(faster, 1)} % faster in mxfp4's profile, as in the two earlier pairs (one "
          "of them from two machines). The model gives them equal time, and that is most of the gap between its "
          "mxfp4 / fp8 and the measured one. Part of it is measured: the SM clock. In the nvidia-smi logs of the "
          f"{cells.commit} cells (results/train_proxy/README.md section 18) every fp8 cell at 672-681 W ran its steps "
          "at 1801-1810 MHz and every mxfp4 cell at the same power at 1839-1854 MHz (+2.3 %): fp8's work draws more "
          "power per clock, and the board clocks down at that draw (the power limit itself was not logged).", ""]
    b = bf16_tgs_now()
    bf16_cells = m.one("throughput", "bf16_cells")[0]
    pb = time_per_token(proxy_cfg("bf16", rates.prof_scope, rates.prof_micro_batch), rates).total
    p8 = time_per_token(proxy_cfg("fp8", rates.prof_scope, rates.prof_micro_batch), rates).total
    L += ["bf16, profiled in the same set (its glue is this profile's; before it, the model took fp8's):", "",
          "| group | predicted ms | measured ms | predicted / measured |", "|---|---:|---:|---:|"]
    L += [f"| {g} | {p:.1f} | {m:.1f} | {p / m:.3f} |" for g, p, m in profile_check_bf16(rates)]
    L += ["", f"fp8 / bf16 tokens/s (each alone in its process, {bf16_cells.name}, steps 11-30, bf16 "
          f"twice around fp8): predicted {pb / p8:.3f}, measured {b['fp8'] / b['bf16']:.3f} ({b['fp8']:.0f} / "
          f"{b['bf16']:.0f}). The GEMMs and attention of bf16 are predicted within 2 % and its glue is measured, so "
          "the gap is what the model does not hold: idle GPU, "
          f"{idle['bf16']:.1f} ms per two steps in bf16's profile against {idle['fp8']:.1f} "
          f"(fp8) and {idle['mxfp4']:.1f} (mxfp4): megatron's SequentialMLP issues one cuBLAS GEMM per "
          "expert from the host, and the GPU waits between them. The model predicts GPU time; ratios over bf16 "
          "carry that gap (a fused grouped BF16 GEMM, as the paper's stack has, would not).", ""]
    old_profile = m.one("throughput", "profile_2026_11_30")[0]
    check1(OLD, f"## Check 1 of 2026-11-30: the {old_profile.commit} profiles (mb 16, attn_ln_experts, 131072 tokens)",
           before.attention_source, _constants()["profiles"][OLD]["tokens_per_s"])
    L += [f"## Check 2: ratios on the H200 proxy (probe of {probe.date}, micro-batches 8 and 16; constants of that "
          "code)",
          "",
          f"Measured: `{probe.repo_path}` (summary/tgs_median: the median of only 2 steps, each recipe's cells in one "
          "in-process multirun). Predicted: the same config (proxy_h200, single_gpu, precision.scope all_linears).",
          "", "| ratio of tokens/s | micro-batch | predicted | measured | predicted / measured - 1 |",
          "|---|---:|---:|---:|---:|"]
    for r in rows:
        L.append(f"| {_cell(r.a)} / {_cell(r.b)} | {r.micro_batch} | {r.predicted:.3f} | {r.measured:.3f} | "
                 f"{100 * r.error:+.1f} % |")
    for kind in ("recipe", "scope"):
        for mb in sorted({r.micro_batch for r in rows}):
            e = [abs(r.error) for r in rows if r.kind == kind and r.micro_batch == mb]
            if e:
                L.append(f"\n{kind} ratios at micro-batch {mb}: median |error| {100 * sorted(e)[len(e) // 2]:.1f} %, "
                         f"max {100 * max(e):.1f} % over {len(e)} ratios.")
    L += ["", "### Where the model is off, and why we think so", "",
          "- **mxfp4 / fp8 at equal scope, micro-batch 8: within 3 %** in 4 of 5 scopes (0.93 predicted). The "
          "exception, scope none (measured 1.49), is the fp8 'none' cell with one slow step out of two "
          "(results/train_proxy/README.md). The profiled pair, each run alone, gives 0.916 against 0.934.",
          "- **mxfp4 / fp8 at micro-batch 16: measured 0.74-0.78 in four scopes, predicted 0.93** (full: 0.947 "
          "measured, 0.933 predicted). The probe ran each recipe's "
          "cells in one in-process multirun, mxfp4's last; the same cell alone in its process gave 0.916 (the "
          "profile). We read the probe's micro-batch 16 mxfp4 numbers as that artefact, not as a model error. "
          "The micro-batch 30 / 34 slowdown of the T1 twin is not modelled at all.",
          "- **Ratios over bf16 are off by up to 39 %, in both directions** (fp8 / bf16 predicted 0.88-0.90, "
          "measured 1.07-1.24 at micro-batch 8 apart from the slow fp8 'none' cell, 0.76-1.0 at 16). bf16 runs "
          "megatron's own MoE path (SequentialMLP, its own permutation "
          "and SwiGLU); we have no profile of it, so its glue is assumed equal to fp8's and its per-expert GEMMs "
          "run at the dense BF16 rate. Both are assumptions, and the bf16 probe cells are the noisiest (2 steps; "
          "bf16 at micro-batch 8, recompute none, ran 96 888 tokens/s here against 111 859 and 118 833 in two "
          "other runs of that setting, results/train_proxy/README.md). "
          "The bf16 column needs its own profile before these ratios mean anything.",
          "- **Scope ratios within a recipe: median error 4-5 %.** mla_up_proj / attn_ln_experts is over-predicted "
          "by 3-12 % in every recipe: the model counts mla_up_proj's saving as the experts' re-run GEMMs plus "
          "their SwiGLU glue, and the grouped GEMMs are 12 % slower in the model than in the profile "
          "(Check 1: the rate fraction 0.48 is the layer benchmark's at H 7168; the proxy's shapes run at ~0.54), "
          "which inflates what skipping the expert re-run saves. bf16 at micro-batch 16 (none, attn_ln_mlp off by "
          "15-27 %) and mxfp4 full at 16 (-22 %) are cells where the measured ordering itself is odd (bf16 "
          "none slower than with recompute): noise or the multirun artefact.",
          "- Not modelled: the host (the runs are GPU-bound: the profile shows a full launch queue), memory-"
          "allocator effects, load imbalance between experts, overlap of all-to-all with compute, the 1F1B "
          "pipeline bubble ((PP - 1) / micro-batches = 31 / 1920 = 1.6 % at T1, the same in every cell)."]
    blk_rates = block_rates()   # the code of the whole-block cells
    blk = block_check(blk_rates)
    scope_rows = [r for r in blk if r.kind == "scope"]
    block_profile = m.one("throughput", "attn_block_profile")[0]
    recipe_rows = [r for r in blk if r.kind == "recipe"]
    L += ["", "## Check 3: the whole MLA block re-run (T1 cells at micro-batch 32; today's constants)", "",
          f"Measured: `{m.one('throughput', 'attn_block_cells')[0].repo_path}` (the attn_block_* cells) and "
          f"`{m.one('throughput', 'core_attention_cells')[0].repo_path}` (the "
          "core-attention cells, mean of two runs; two sessions, two machines: ratios across them carry the 1-4 % "
          "host spread of results/train_proxy/README.md). Predicted: proxy_h200 as above.", "",
          "| ratio of tokens/s | micro-batch | predicted | measured | predicted / measured - 1 |",
          "|---|---:|---:|---:|---:|"]
    for r in blk:
        L.append(f"| {_cell(r.a)} / {_cell(r.b)} | {r.micro_batch} | {r.predicted:.3f} | {r.measured:.3f} | "
                 f"{100 * r.error:+.1f} % |")
    gemm_only = block_check(replace(blk_rates, attn_block_glue_ms=(0.0, 0.0)))
    gemm_scope = [r for r in gemm_only if r.kind == "scope"]
    L += ["", f"- **Re-running the whole block costs {_range([100 * (1 - r.measured) for r in scope_rows], 1)} % "
          f"of the tokens/s measured, {_range([100 * (1 - r.predicted) for r in scope_rows], 1)} % predicted.** "
          "Its GEMMs (q_down, kv_down, o_proj and the up-projections beside the core attention) account for "
          f"{_range([100 * (1 - r.predicted) for r in gemm_scope], 1)} %; the rest is the block's elementwise work, "
          f"which on MLA is large: `attn_block_glue_ms`, the forward ops of the block in the {block_profile.commit} "
          "profiles (the q/k concatenations with the RoPE part alone 27.5 ms of fp8's 1413 ms per two steps, "
          f"{block_profile.repo_path}), added once more for attn_block_*.",
          f"- **mxfp4 / fp8 at the whole-block scopes: predicted {_range([r.predicted for r in recipe_rows])}, "
          f"measured {_range([r.measured for r in recipe_rows])}**, the 1-2 % under-prediction of Check 1. These "
          f"cells ran the per-row dispatch quantization (before {m.commit_of('dispatch_per_token')}), and the model "
          "takes it for them.",
          ""]
    L += proxy_t1_section(rates)
    core_tab, core = _paper_table(rates, "core_attn")
    block_tab, block = _paper_table(rates, "self_attention")
    L += ["", "## Prediction for the paper's T1 (PREDICTION, not a measurement)", "",
          "dsv3_671b with parallel=paper_671b (TP1 PP32 EP8 DP8, DeepEP 'flex' dispatch, micro-batch 1, sequence "
          "4096), FP8 on all linears, the slowest pipeline stage, FP8 weights cached over a step's micro-batches, "
          "today's constants. "
          "The link bandwidths are our statements (GB/s per GPU, one direction, achieved, no overlap of the "
          "all-to-all with compute): which link the EP group crossed and what it achieved are not known. "
          f"'Our glue scaled' multiplies our measured torch glue per layer by {glue_scale_paper():.2f} "
          "(bytes a MoE layer saves per token, paper / proxy): an upper bound, since the paper's Transformer "
          "Engine stack fuses most of it; the 'no glue' cases also leave out the SwiGLU kernels. Our rates are "
          "H200's; the paper ran H100-class 80 GB GPUs.", "", "With the paper's \"attention\" read as megatron's "
          "core attention (attn_ln_experts, attn_ln_mlp):", ""] + core_tab

    def preds(tab, key):
        """The predictions of the paper ratio whose label starts with ``key``."""
        return next(v for k, v in tab.items() if k.startswith(key))[1]

    def rng(tab, key):
        return _range(preds(tab, key))

    L += ["", "With \"attention\" read as the whole MLA block (attn_block_ln_experts, attn_block_ln_mlp: the reading "
          "conf/experiment/paper_t1.yaml runs; results/scale/paper_t1.md has the memory of both):", ""] + block_tab

    def paper(key):
        return next(v for k, v in core.items() if k.startswith(key))[0]

    head = preds(core, "headline") + preds(block, "headline")
    versus = ("above" if min(head) > paper("headline") else "below" if max(head) < paper("headline")
              else "around")
    L += ["", f"Reading: the scope ratios (the cost of recompute): mxfp4 at attn_ln_mlp "
          f"{rng(core, 'mxfp4: attn_ln_mlp')} (paper {paper('mxfp4: attn_ln_mlp'):.3f}), at mla_up_proj "
          f"{rng(core, 'mxfp4: mla_up_proj')} with the core attention and {rng(block, 'mxfp4: mla_up_proj')} with the "
          f"whole block (paper {paper('mxfp4: mla_up_proj'):.3f}), and the headline, mxfp4 at mla_up_proj over fp8 at "
          f"attn_ln_experts, {rng(core, 'headline')} and {rng(block, 'headline')}, {versus} the paper's "
          f"{paper('headline'):.3f}: most of the predicted gain is recompute the lighter scope no longer pays, and "
          "the whole-block reading makes the attention scopes dearer still. On the lab's layout (no MTP layer, "
          "issue 27) the slowest stage is one of two MoE layers, not the last one with an MTP layer and the head "
          "(which made the headline 1.09-1.13 before issue 27). Check 3 "
          "leaves a 1-2 % under-count of the block's re-run on the proxy, and the 'no glue' cases leave out the "
          "block's elementwise re-run with the rest of the glue: there the whole-block gains are lower bounds. "
          f"At equal scope mxfp4 / fp8 is predicted {rng(core, 'mxfp4 / fp8')} (paper {paper('mxfp4 / fp8'):.3f}): "
          "with today's FP4 "
          "kernels the smaller dispatch pays for the conversions, more so on a slower link; on the proxy (one GPU, "
          "no all-to-all) the model is 1-2 % pessimistic for mxfp4 (Check 1). "
          f"fp8 / bf16 (paper {paper('fp8 / bf16'):.3f}) depends on the grouped FP8 GEMM: at our Triton kernel's 0.48 x "
          "dense the "
          f"model predicts fp8 slower than bf16 ({_range(preds(core, 'fp8 / bf16')[:3])}); "
          f"at the dense FP8 rate (DeepGEMM-class kernels, as the paper's stack likely had) "
          f"{preds(core, 'fp8 / bf16')[3]:.2f}. On the proxy the model predicts bf16's GPU time within 1 % but "
          "under-predicts fp8 / bf16 by 8 %: megatron's per-expert BF16 GEMM loop leaves the GPU idle (Check 1), "
          "which the model does not hold and the paper's grouped BF16 GEMM may not have; so the ratios over bf16 "
          "are the weakest rows here."]
    return "\n".join(L) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return markdown_cli(argv, __doc__, "throughput", markdown)


__all__ = ["ATTENTION_READINGS", "NOW", "OLD", "PAPER_CASES", "RateSet", "RatioRow", "block_check", "block_rates",
           "markdown", "measured_rates", "measured_runs", "measured_tgs", "paper_prediction", "profile_check",
           "proxy_cfg", "proxy_ratios", "proxy_t1_fixed", "proxy_t1_measured", "rate_set"]

if __name__ == "__main__":
    raise SystemExit(main())
