"""The memory model (fp4moe.scale.memory) against the measured H200 proxy runs (issue 6, P5): one row per
recipe x recompute scope x micro-batch that was run, with the measured and the predicted bytes one micro-batch saves
for backward and the measured and the predicted peak.

    python -m fp4moe.analysis.calibration [--out FILE]     # results/scale/calibration.md (results/manifest.yaml)
    python -m fp4moe.analysis.calibration --check RUNS.json|STORE.db ...   # new runs vs the model for today's code

Inputs: results/manifest.yaml's ``calibration`` roles: ``one_gpu`` and ``nccl`` (runs archives, format fp4moe-runs/1,
loaded with fp4moe.runs.archive.load), ``moe_layer`` (P2's layer benchmark), ``constants`` (what fits on an H200)
and ``notes`` (the document's hand-written text). Measured:

- ``saved_activation_bytes_per_micro_batch``: storage bytes autograd holds after ONE micro-batch's forward,
  parameters excluded (fp4moe.ops.accounting.SavedTensorBytes, the trainer's first micro-batch);
- ``summary/peak_mem_allocated_gb``: ``torch.cuda.max_memory_allocated`` over the measured steps, in GiB
  (fp4moe.train.metrics: GB = 2**30 B). OOM cells have no peak; their saved bytes were measured before the OOM.

Predicted: each run's configuration is rebuilt from its logged params (the resolved Hydra config) and evaluated by
``memory.Breakdown.allocated_bytes`` (static + saved + the largest phase transient, all from tensor shapes) under the
assumptions that describe the code the run measured: the trainer before megatron's DDP (``FIRST_PRINCIPLES``) with
the archive's ``code`` in the manifest (``memory.MemoryAssumptions`` fields: the two wastes the first archives'
code kept, ``expert_backward_keeps_dead`` and ``norm_cache_keeps_bf16``, and the dispatchers' recompute graph,
``dispatcher_keeps_recompute_graph``). Nothing is fitted to the peaks. The table also gives each run's prediction
for ``FIRST_PRINCIPLES``. No torch import.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from ..paths import source_root
from ..scale.memory import GB, NOT_IN_STANDALONE_LAYER, Breakdown, MemoryAssumptions, compose_cfg, per_stage_memory
from . import manifest
from .output import out_problem, write_markdown

TARGET_PCT = 5.0  # issue 6: predicted peak within 5 % of measured for every recipe x recompute cell run
GROUPS = ("model", "parallel", "precision", "recompute", "optimizer", "train")
OPTIONAL_GROUPS = ("optimizer", "train")   # absent from older runs' params (the optimizer group came with issue 27)
# The model's error on every one-GPU peak measured (predicted / measured - 1: -2.0 % to +1.3 %, 217 runs; a test
# keeps the range inside this): a predicted peak that could lie on either side of the usable capacity within it is
# an edge cell, neither a fit nor an OOM.
PEAK_ERR_RANGE = (-0.020, 0.013)


@dataclass(frozen=True)
class H200Memory:
    """What fits on one H200 (results/scale/h200_constants.yaml ``h200_memory``): torch's total capacity and the
    process's memory outside PyTorch's allocator (GiB), measured by OOM messages of the run ``commit``; nvidia-smi's
    memory (GiB). The model predicts max allocated; ``usable_gib`` is what that may reach."""

    torch_capacity_gib: float
    non_torch_gib: float
    nvidia_smi_gib: float
    commit: str

    @property
    def usable_gib(self) -> float:
        return self.torch_capacity_gib - self.non_torch_gib


@functools.cache
def h200_memory() -> H200Memory:
    m = manifest.load()
    c = manifest.constants("calibration", m)["h200_memory"]
    return H200Memory(float(c["torch_capacity_gib"]), float(c["non_torch_gib"]), int(c["nvidia_smi_mib"]) / 1024,
                      m.entry(c["source"]).commit)


def fit_outcome(pred_peak_gib: float, usable_gib: float | None = None) -> str:
    """'fits' when even the largest peak the model's error allows (pred / (1 - 2.0 %)) is within ``usable_gib``
    (default: the H200's, ``h200_memory``), 'OOM' when even the smallest (pred / (1 + 1.3 %)) is over it, else
    'edge'."""
    usable_gib = h200_memory().usable_gib if usable_gib is None else usable_gib
    lo, hi = (pred_peak_gib / (1 + e) for e in reversed(PEAK_ERR_RANGE))
    return "fits" if hi <= usable_gib else ("OOM" if lo > usable_gib else "edge")


def gpu_outcome(total_gib: float, allocated_gib: float, gpu_gib: float) -> str:
    """``fit_outcome`` of a predicted peak as nvidia-smi shows it (``total_gib``: ``allocated_gib`` plus the memory
    outside PyTorch) on a GPU of ``gpu_gib``: the allocated part moved across the model's error, against the GPU less
    the memory outside PyTorch."""
    return fit_outcome(allocated_gib, gpu_gib - (total_gib - allocated_gib))


# What fp4moe.train kept on one GPU before megatron's DDP (its own optimizer, every archive of the manifest): 2 B BF16
# weight + 4 B FP32 master + 8 B AdamW m, v per parameter, no distributed optimizer (one GPU); 4 B FP32 gradient
# accumulators only once a step's first micro-batch has finished its backward; FP8 column copies padded per expert
# as real (uneven) routing pads them.
FIRST_PRINCIPLES = MemoryAssumptions(main_grad_resident="after_first_micro_batch", expert_padding="expected")
# The trainer since issue 27 (megatron-core's DDP and optimizer, fp4moe.train.optim): the main-gradient buffer exists
# from the start (and each BF16 .grad is folded into it as it is made); the archives measured the trainer before it
# (its own optimizer: FIRST_PRINCIPLES). What --check compares new runs with by default.
DDP_CODE = replace(FIRST_PRINCIPLES, main_grad_resident="always")
# The code of the first archives: the routed experts' backward kept an unused [R, H] GEMM output, dZ and the decoded
# H until it returned; the norm checkpoints kept their BF16 input beside the MXFP4 cache.
MEASURED_CODE = replace(FIRST_PRINCIPLES, expert_backward_keeps_dead=True, norm_cache_keeps_bf16=True)


@dataclass(frozen=True)
class Archive:
    """A runs archive and what the table takes of it: the ``commit`` it measured, the model's assumptions for that
    code (``code``) and whether its peaks are part of the 5 % check (``checked``)."""

    path: Path
    commit: str = "?"
    code: MemoryAssumptions = FIRST_PRINCIPLES
    checked: bool = True

    @property
    def name(self) -> str:
        return self.path.name


def archives(role: str, m: manifest.Manifest | None = None) -> list[Archive]:
    """The manifest's runs archives of a calibration role ('one_gpu' | 'nccl'), in its order; each use's ``code``
    (MemoryAssumptions fields) changes ``FIRST_PRINCIPLES``."""
    return [Archive(e.file, e.commit, replace(FIRST_PRINCIPLES, **u.get("code", {})), bool(u.get("checked", True)))
            for e, u in (m or manifest.load()).inputs("calibration", role)]


def _archive(a: Archive | str | Path) -> Archive:
    return a if isinstance(a, Archive) else Archive(Path(a))


@dataclass(frozen=True)
class Cell:
    """One measured run: its configuration (``cfg``, rebuilt from the logged params) and what was measured."""

    archive: str                   # the archive's file name
    recipe: str
    scope: str
    micro_batch: int
    global_batch: int
    seq_length: int
    saved_bytes: int               # measured, one micro-batch
    peak_gib: float | None         # measured max allocated, GiB; None when the run went OOM
    outcome: str                   # 'ok' | 'OOM'
    cfg: dict
    step_start_gib: float | None = None  # measured allocated GiB when a step begins (where the run logged it)
    # routed rows GPU 0's experts received / the rows its tokens sent (a2a/dispatch_forward_*_rows, or the recipe
    # dispatcher's payload bytes in older runs; None where neither was logged: the older bf16 runs): at the first
    # step (when the saved bytes were measured) and the largest over the measured steps (where the peak was)
    rows_factor_first: float | None = None
    rows_factor_max: float | None = None
    commit: str = "?"              # the commit the archive measured (results/manifest.yaml)
    code: MemoryAssumptions = FIRST_PRINCIPLES   # the model's assumptions for that code
    checked: bool = True           # the archive is part of the 5 % check

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_length


def _value(text: str):
    """A logged param back to a value: JSON / YAML scalars and lists; 'None' -> None."""
    if text == "None":
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    if text in ("True", "False"):
        return text == "True"
    return text


def cfg_from_params(params: dict) -> dict:
    """The config groups the memory model reads, rebuilt from a run's flattened params (``optimizer`` and ``train``
    only where the run logged them: without them the model takes ``parallel.distributed_optimizer``'s setting)."""
    out: dict = {g: {} for g in GROUPS}
    for key, text in params.items():
        group, _, rest = key.partition(".")
        if group not in out or not rest:
            continue
        node = out[group]
        *parents, leaf = rest.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _value(text)
    return {g: v for g, v in out.items() if v or g not in OPTIONAL_GROUPS}


def load_cells(sources: Sequence[Archive | str | Path] | None = None) -> list[Cell]:
    """Every run of the archives (default: the manifest's ``one_gpu`` ones; a path is an archive of today's
    ``FIRST_PRINCIPLES``, commit unknown) that logged the saved-bytes metric, in archive order, then recipe, scope,
    micro-batch."""
    from fp4moe.runs.archive import load, withdrawn

    cells = []
    for a in map(_archive, archives("one_gpu") if sources is None else sources):
        doc = load(a.path)
        gone = withdrawn(doc)
        for r in doc["runs"]:
            m = {k: v for k, v in r["metrics"].items() if k not in gone}
            t = r["tags"]
            saved = m.get("saved_activation_bytes_per_micro_batch")
            if not saved:
                continue
            cfg = cfg_from_params(r["params"])
            # fp4moe.train shards the optimizer state since it logs summary/optimizer_state_bytes; runs before
            # that kept it replicated whatever the config said (the EP configs said distributed_optimizer=true:
            # their step started 0.92 GiB above a sharded model)
            if "summary/optimizer_state_bytes" not in m:
                cfg["parallel"]["distributed_optimizer"] = False
            peak = m.get("summary/peak_mem_allocated_gb")
            start = m.get("summary/mem_allocated_at_step_start_gb")
            oom = t.get("outcome") == "OOM"
            # routed rows (every recipe, in the newer runs) or, before, the recipe dispatcher's payload bytes
            recv, sent = m.get("a2a/dispatch_forward_received_rows"), m.get("a2a/dispatch_forward_sent_rows")
            if not (recv and sent):
                recv, sent = m.get("a2a/dispatch_forward_received_bytes"), m.get("a2a/dispatch_forward_sent_bytes")
            first = top = None
            if recv and sent:
                sent_at = {int(st): v for st, v, *_ in sent}
                ratio = {int(st): v / sent_at[int(st)] for st, v, *_ in recv}
                warm = int(_value(r["params"].get("train.measure.warmup_steps", "0")) or 0)
                first = ratio[min(ratio)]
                top = max((v for st, v in ratio.items() if st > warm), default=max(ratio.values()))
            cells.append(Cell(archive=a.name, recipe=t["recipe"], scope=t["recompute"],
                              micro_batch=int(cfg["parallel"]["micro_batch"]),
                              global_batch=int(cfg["parallel"]["global_batch"]),
                              seq_length=int(cfg["parallel"]["seq_length"]), saved_bytes=int(saved[0][1]),
                              peak_gib=None if (oom or not peak) else float(peak[-1][1]),
                              outcome="OOM" if oom else "ok", cfg=cfg,
                              step_start_gib=float(start[-1][1]) if start and not oom else None,
                              rows_factor_first=first, rows_factor_max=top, commit=a.commit, code=a.code,
                              checked=a.checked))
    order = {"bf16": 0, "fp8": 1, "mxfp4": 2}
    scopes = {"none": 0, "attn_ln_experts": 1, "attn_ln_mlp": 2, "mla_up_proj": 3, "full": 4}
    cells.sort(key=lambda c: (c.global_batch != c.micro_batch, order.get(c.recipe, 9), scopes.get(c.scope, 9),
                              c.micro_batch))
    return cells


# ---------------------------------------------------------------------------------------------- the table

@dataclass(frozen=True)
class Row:
    cell: Cell
    pred_saved_bytes: int
    pred_peak_gib: float           # the model for the code the run measured (Cell.code)
    pred_phase: str                # where that peak is: 'head', 'moe_forward' or 'backward'
    pred_static_gib: float = 0.0   # weights + gradients + optimizer state: what a step begins with
    pred_peak_now_gib: float = 0.0  # the same run with today's code (FIRST_PRINCIPLES)

    @property
    def saved_err_pct(self) -> float:
        return 100.0 * (self.pred_saved_bytes - self.cell.saved_bytes) / self.cell.saved_bytes

    def peak_err_pct(self) -> float | None:
        if self.cell.peak_gib is None:
            return None
        return 100.0 * (self.pred_peak_gib - self.cell.peak_gib) / self.cell.peak_gib

    @property
    def within_target(self) -> bool | None:
        e = self.peak_err_pct()
        return None if e is None else abs(e) <= TARGET_PCT

    @property
    def checked(self) -> bool:
        """Part of the 5 % check (a measured peak, from an archive the manifest does not mark ``checked: false``)."""
        return self.cell.peak_gib is not None and self.cell.checked


def allocated_peak(cfg, a: MemoryAssumptions) -> Breakdown:
    """The pipeline rank with the largest allocated peak (``Breakdown.allocated_bytes``, what
    ``torch.cuda.max_memory_allocated`` measures; the memory outside PyTorch is not part of it)."""
    return max(per_stage_memory(cfg, a), key=lambda x: x.allocated_bytes)


def table(cells: Sequence[Cell] | None = None, measured: MemoryAssumptions | None = None,
          now: MemoryAssumptions = FIRST_PRINCIPLES) -> list[Row]:
    """One row per cell, predicted for the code the run measured (``measured``, default: its archive's ``code``)
    and for today's (``now``). Under PP the measured saved bytes are summed over the stages (the trainer logs the
    whole model's) and the measured peak is the largest over the GPUs: so are the predictions (per_stage_memory)."""
    cells = load_cells() if cells is None else cells
    rows = []
    for c in cells:
        cfg = OmegaConf.create(c.cfg)
        code = c.code if measured is None else measured
        # the routing each run measured: its first step's for the saved bytes, the largest for the peak
        first = replace(code, expert_rows_factor=c.rows_factor_first or 1.0)
        top, top_now = (replace(x, expert_rows_factor=c.rows_factor_max or 1.0) for x in (code, now))
        b = allocated_peak(cfg, top)
        static = (b.params_bytes + b.grads_bytes + b.optimizer_bytes) / GB
        saved = sum(x.per_microbatch_activation_bytes for x in per_stage_memory(cfg, first))
        rows.append(Row(c, saved, b.allocated_gb, b.peak_phase, static, allocated_peak(cfg, top_now).allocated_gb))
    return rows


# P2's MoE layer benchmark (fp4moe.bench.moe_layer; results/moe_layer/README.md "Final run"): the DeepSeek-V3 MoE layer
# (hidden 7168, 32 local experts of ffn 2048, top-8, one shared expert, 4096 tokens) on one H200 and on two over
# NCCL, every recipe; the saved bytes of one forward counted by the trainer's own hooks (fp4moe.ops.accounting).
# The manifest's ``moe_layer`` files; those with ``peak: true`` (the layer's code that frees its [T*k, H]
# intermediates in the forward, with the allocator's trace of each recipe's peak, --memtrace) also have their peak
# over the base checked (memory.standalone_moe_layer_peak). Older files' peaks are not modelled (their forward held
# more).


@dataclass(frozen=True)
class LayerFile:
    """A layer-benchmark file: its ``path``, the ``commit`` it measured, whether its peak is modelled."""

    path: Path
    commit: str = "?"
    peak: bool = False


def layer_files(m: manifest.Manifest | None = None) -> list[LayerFile]:
    return [LayerFile(e.file, e.commit, bool(u.get("peak", False))) for e, u in
            (m or manifest.load()).inputs("calibration", "moe_layer")]


@dataclass(frozen=True)
class LayerRow:
    """One recipe of a layer-benchmark file: measured saved bytes (one forward) vs the model's MoE-layer tensors
    for that shape, routing (measured rows per local expert) and EP; for the files with ``peak`` also the
    peak over the base (bytes) measured vs ``memory.standalone_moe_layer_peak``, the predicted phase and the phase
    of the traced peak ('backward' when an allocation site live there is a backward's, else 'forward')."""

    file: str
    world_size: int
    recipe: str
    measured: int
    predicted: int
    tokens: int = 4096
    local_experts: int = 32
    peak_measured: int | None = None
    peak_predicted: int | None = None
    phase: str = ""
    traced_phase: str = ""
    commit: str = "?"              # the commit the file measured

    @property
    def err_pct(self) -> float:
        return 100.0 * (self.predicted - self.measured) / self.measured

    @property
    def peak_err_pct(self) -> float | None:
        if self.peak_measured is None or self.peak_predicted is None:
            return None
        return 100.0 * (self.peak_predicted - self.peak_measured) / self.peak_measured


def traced_phase(memory_peak: dict | None) -> str:
    """'backward' when a block live at the traced peak was allocated in a backward (its site names a backward,
    a gradient kernel or a weight gradient), 'forward' otherwise; '' without a trace."""
    if not memory_peak:
        return ""
    marks = ("backward", "bwd", "wgrad")
    return "backward" if any(any(m in x["where"] for m in marks) for x in memory_peak["by_site"]) else "forward"


def layer_rows(files: Sequence[LayerFile] | None = None) -> list[LayerRow]:
    """The model against P2's layer benchmark: ``layer_saved_tensors`` of a dsv3_671b MoE layer with the file's
    shape (experts = local x EP, EP = its world size, one sequence of its tokens) at recompute none, its measured
    per-expert rows (``expert_counts``: the routing and the FP8 padding), less ``memory.NOT_IN_STANDALONE_LAYER``; for
    files with ``peak`` also ``standalone_moe_layer_peak`` against the measured peak over the base. Default: the
    manifest's ``moe_layer`` files."""
    from ..scale.memory import layer_saved_tensors, recipe_of, standalone_moe_layer_peak

    out = []
    for f in layer_files() if files is None else files:
        path = f.path
        doc = json.loads(path.read_text())
        shape, ws = doc["shape"], int(doc["env"]["world_size"])
        for r in doc["recipes"]:
            cfg = compose_cfg("dsv3_671b", "single_gpu", "none", r["recipe"])
            cfg.model.moe.num_experts = int(shape["experts"])
            cfg.parallel.expert, cfg.parallel.micro_batch = ws, 1
            cfg.parallel.seq_length = int(shape["tokens"])
            m = cfg.model
            got = (int(m.hidden_size), int(m.moe.ffn_hidden_size), int(m.moe.router_topk),
                   int(m.moe.ffn_hidden_size) * int(m.moe.shared_experts))
            want = (shape["hidden"], shape["ffn"], shape["top_k"], shape["shared_ffn"])
            if got != want:
                raise ValueError(f"{path.name}: shape {want} (hidden, ffn, top-k, shared ffn) is not dsv3_671b's {got}")
            counts = tuple(int(c) for c in r["expert_counts"])
            a = replace(FIRST_PRINCIPLES, expert_counts=counts,
                        expert_rows_factor=sum(counts) / (int(shape["tokens"]) * int(shape["top_k"])))
            recipe = recipe_of(cfg)  # parsed once for both predictions
            pred = sum(t.bytes for t in layer_saved_tensors(cfg, "moe", "none", a, recipe)
                       if t.name.startswith("moe.") and t.name not in NOT_IN_STANDALONE_LAYER)
            peak = {}
            if f.peak:
                if r.get("peak_over_base_gib") is None:
                    raise ValueError(f"{path.name}: {r['recipe']} has no measured peak (a CPU run?)")
                p_bytes, phase = standalone_moe_layer_peak(cfg, a, recipe)
                peak = dict(peak_measured=round(r["peak_over_base_gib"] * 2**30), peak_predicted=p_bytes, phase=phase,
                            traced_phase=traced_phase(r.get("memory_peak")))
            out.append(LayerRow(path.name, ws, r["recipe"], int(r["saved_bytes"]), pred, int(shape["tokens"]),
                                int(shape["local_experts"]), commit=f.commit, **peak))
    return out


def render_layer(rows: Sequence[LayerRow]) -> list[str]:
    since = ", ".join(dict.fromkeys(r.commit for r in rows if r.peak_predicted is not None)) or "-"
    lines = ["", "## P2's MoE layer (fp4moe.bench.moe_layer)", "",
             "The DeepSeek-V3 MoE layer alone (hidden 7168, local experts of ffn 2048, top-8, one shared expert; "
             "4096 tokens per GPU and 32 local experts unless the row says otherwise), one forward's saved bytes as "
             "the trainer counts them, against the model's MoE-layer tensors at that shape with the run's measured "
             "rows per expert (routing and FP8 padding). The routed experts are the trainer's code (fp4moe's grouped "
             "experts); the router and the dispatch are the layer's own (P2), not megatron's, which the model "
             "describes: the small differences. The peak over the base (one forward + backward, every `.grad` None; "
             f"`memory.standalone_moe_layer_peak`) is modelled for the layer's code since {since}; the phase column "
             "gives the predicted phase and the one the allocator trace (`--memtrace`) shows.", "",
             "| file | EP | tokens | experts | recipe | saved meas. (B) | saved pred. (B) | err % "
             "| peak meas. (GiB) | peak pred. (GiB) | err % | phase pred. / traced |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.peak_predicted is None:
            peak = "| - | - | - | not modelled (older code) |"
        else:
            peak = (f"| {r.peak_measured / 2**30:.3f} | {r.peak_predicted / 2**30:.3f} | {r.peak_err_pct:+.2f} "
                    f"| {r.phase} / {r.traced_phase or '-'} |")
        lines.append(f"| `{r.file}` | {r.world_size} | {r.tokens} | {r.local_experts} | {r.recipe} | {r.measured} "
                     f"| {r.predicted} | {r.err_pct:+.2f} {peak}")
    return lines


@dataclass(frozen=True)
class FitRow:
    """One one-GPU run: what happened (``measured``: 'ok' | 'OOM') against what the model says of it
    (``predicted``: fit_outcome of its peak for the code the run measured, in GiB)."""

    archive: str                   # the archive's file name
    recipe: str
    scope: str
    micro_batch: int
    measured: str
    pred_peak_gib: float
    predicted: str
    commit: str = "?"              # the commit the archive measured

    @property
    def contradicts(self) -> bool:
        return contradicts(self.measured, self.predicted)


def contradicts(measured: str, predicted: str) -> bool:
    """A run that went OOM (``measured`` 'OOM') where the model says it fits, or fit ('ok') where the model says
    OOM (``predicted``: fit_outcome's 'fits' | 'edge' | 'OOM')."""
    return (measured, predicted) in (("OOM", "fits"), ("ok", "OOM"))


def fit_rows(sources: Sequence[Archive | str | Path] | None = None, usable_gib: float | None = None) -> list[FitRow]:
    """Every run of the archives (default: the manifest's ``one_gpu`` ones), OOM runs included (one that ran out of
    memory in its first forward logged no saved bytes and is not in ``load_cells``), its measured outcome beside
    ``fit_outcome`` of the model's peak (the code the run measured, the archive's ``code``; uniform routing) against
    ``usable_gib`` (default: the H200's)."""
    from fp4moe.runs.archive import load

    out = []
    for a in map(_archive, archives("one_gpu") if sources is None else sources):
        for r in load(a.path)["runs"]:
            t = r["tags"]
            cfg = OmegaConf.create(cfg_from_params(r["params"]))
            pred = allocated_peak(cfg, a.code).allocated_gb
            out.append(FitRow(a.name, t["recipe"], t["recompute"], int(cfg.parallel.micro_batch),
                              "OOM" if t.get("outcome") == "OOM" else "ok", pred, fit_outcome(pred, usable_gib),
                              a.commit))
    return out


def render_fits(rows: Sequence[FitRow]) -> list[str]:
    """The fit / OOM check: counts, and every run that went OOM or that the model puts at the edge."""
    n = lambda m, p: sum(r.measured == m and r.predicted == p for r in rows)  # noqa: E731
    lo, hi = (100 * e for e in PEAK_ERR_RANGE)
    h = h200_memory()
    lines = ["", "## Fits or OOM on one H200", "",
             f"Usable capacity {h.usable_gib:.2f} GiB: torch's total {h.torch_capacity_gib:.2f} GiB less "
             f"{h.non_torch_gib:.2f} GiB the process holds outside PyTorch's allocator (the largest of seven OOM "
             f"messages of {h.commit}, `h200_memory.non_torch_gib`). Predicted **fits** when the model's peak stays "
             "within it "
             f"across the model's measured error ({lo:+.1f} % to {hi:+.1f} %, `PEAK_ERR_RANGE`), **OOM** when it "
             "exceeds it across that error, else **edge**. Every run of the one-GPU archives (an OOM in the first "
             "forward logs no saved bytes, so some of these are not in the table above):", "",
             "| measured \\ predicted | fits | edge | OOM |", "|---|---:|---:|---:|"]
    for m in ("ok", "OOM"):
        lines.append(f"| {m} | {n(m, 'fits')} | {n(m, 'edge')} | {n(m, 'OOM')} |")
    lines += ["", "| code | recipe | recompute | micro-batch | measured | peak pred. (GiB) | predicted |",
              "|---|---|---|---|---|---:|---|"]
    for r in rows:
        if r.measured == "OOM" or r.predicted != "fits":
            lines.append(f"| {r.commit} | {r.recipe} | {r.scope} | {r.micro_batch} | {r.measured} | "
                         f"{r.pred_peak_gib:.2f} | {r.predicted} |")
    return lines


def _git_head(root: Path | None = None) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root or source_root(), capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _layout(c: Cell) -> str:
    p = c.cfg["parallel"]
    per_rank = c.global_batch // (c.micro_batch * int(p.get("data", 1) or 1))
    return f"EP{p.get('expert', 1)} DP{p.get('data', 1)} PP{p.get('pipeline', 1)}, {per_rank} x {c.micro_batch}"


def render_nccl(rows: Sequence[Row]) -> list[str]:
    """The table of the runs over NCCL (EP2 x DP2, PP2 on two H200s); rows of archives outside the check are marked."""
    if not rows:
        return []
    names = sorted({r.cell.archive for r in rows})
    outside = sorted({r.cell.archive for r in rows if not r.cell.checked})
    lines = ["", "## Runs over NCCL (two H200s)", "",
             "Saved bytes: the whole model's (PP: summed over the stages; EP: GPU 0's, whose routed rows follow the "
             "real routing); peak: the largest over the GPUs; the prediction likewise (its static part is that of "
             "the predicted peak's stage; the measured step start is GPU 0's). Under EP the model takes the rows GPU "
             "0's experts received, from the run's own all-to-all metrics (routed rows, or before "
             f"{manifest.load().commit_of('routed_rows')} the recipe "
             "dispatcher's bytes): the first step's for the saved bytes, the largest measured step's for the peak. "
             "The optimizer state is replicated over the data-parallel ranks for the runs that do not log "
             "`summary/optimizer_state_bytes` (the trainer of those runs kept it so) and sharded as configured "
             "(`parallel.distributed_optimizer`) for the runs that do. "
             f"In the {TARGET_PCT:g} % check: the runs of today's code; not: "
             + ", ".join(f"`{a}`" for a in outside)
             + " (older code: the MoE forward kept more rows alive; megatron's bf16 dispatcher logged no routing, "
             "so that bf16 run assumes balanced routing). Archives: " + ", ".join(f"`{a}`" for a in names) + ".",
             "",
             "| code | recipe | recompute | layout (micro-batches per GPU x size) | rows received / sent (first, max) | "
             "step start meas. (GiB) | static pred. (GiB) | "
             "saved meas. (GB) | saved pred. (GB) | saved err % | peak meas. (GiB) | peak pred. (GiB) | err % | phase | "
             f"within {TARGET_PCT:g} % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.cell
        routing = ("not logged" if c.rows_factor_first is None
                   else f"{c.rows_factor_first:.3f}, {c.rows_factor_max:.3f}")
        w = "outside" if not r.checked else ("yes" if r.within_target else "no")
        lines.append(f"| {c.commit} | {c.recipe} | {c.scope} | {_layout(c)} | {routing} | "
                     f"{_f(c.step_start_gib, '.2f')} | "
                     f"{r.pred_static_gib:.2f} | {c.saved_bytes / 1e9:.3f} | {r.pred_saved_bytes / 1e9:.3f} | "
                     f"{r.saved_err_pct:+.2f} | {_f(c.peak_gib, '.2f')} | {r.pred_peak_gib:.2f} | "
                     f"{_f(r.peak_err_pct(), '+.1f')} | {r.pred_phase} | {w} |")
    return lines


def render(rows: Sequence[Row], date: str | None = None, commit: str | None = None,
           nccl_rows: Sequence[Row] = (), fits: Sequence[FitRow] = (), layer: Sequence[LayerRow] = ()) -> str:
    """results/scale/calibration.md's text: the computed tables between the hand-written parts of the manifest's
    ``notes`` (the legend, and "What the table says")."""
    date = date or _dt.date.today().isoformat()
    commit = commit or _git_head()
    measured_at = {r.cell.archive: r.cell.commit for r in rows}
    text = manifest.notes("calibration")
    n_peak = [r for r in (*rows, *nccl_rows) if r.checked]
    ok = [r for r in n_peak if r.within_target]
    errs = [r.peak_err_pct() for r in n_peak]
    lo, hi = (min(errs), max(errs)) if errs else (0.0, 0.0)
    max_saved = max((abs(r.saved_err_pct) for r in rows), default=0.0)
    lines = [
        "# The memory model against the H200 proxy runs (issue 6, P5)",
        "",
        f"Written by `python -m fp4moe.analysis.calibration` on {date} at commit {commit}. Measured: NVIDIA H200s, "
        "torch 2.11.0+cu130, megatron-core 0.16.1, model `proxy_h200` (4 layers, 1 dense + 3 MoE with 32 experts "
        "top-8, hidden 2048, MLA, vocabulary 16384), one GPU (first table) or two over NCCL (second table), "
        "sequence 4096, FP8 on every linear "
        "(`precision.scope=all_linears`).",
        "",
        "Archives (results/train_proxy/, the commit each was measured at is in its name): "
        + ", ".join(f"`{a}` ({measured_at[a]})" for a in sorted(measured_at)) + ".",
        "",
        text["legend"],
        "",
        f"Peak within {TARGET_PCT:g} %: {len(ok)} of {len(n_peak)} runs with a measured peak, one GPU and NCCL "
        f"together (errors {lo:+.1f} % to {hi:+.1f} %). The saved activations agree within {max_saved:.4f} % in "
        f"all {len(rows)} one-GPU runs.",
        "",
        "| code | recipe | recompute | micro-batch | global batch | outcome | step start meas. (GiB) | "
        "static pred. (GiB) | "
        "saved meas. (GB) | saved pred. (GB) | saved err % | peak meas. (GiB) | peak pred. (GiB) | err % | "
        f"phase | within {TARGET_PCT:g} % | peak now pred. (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r.cell
        w = r.within_target
        lines.append(
            f"| {c.commit} | {c.recipe} | {c.scope} | {c.micro_batch} | {c.global_batch} | "
            f"{c.outcome} | "
            f"{_f(c.step_start_gib, '.2f')} | {r.pred_static_gib:.2f} | {c.saved_bytes / 1e9:.3f} | "
            f"{r.pred_saved_bytes / 1e9:.3f} | {r.saved_err_pct:+.3f} | {_f(c.peak_gib, '.2f')} | "
            f"{r.pred_peak_gib:.2f} | {_f(r.peak_err_pct(), '+.1f')} | {r.pred_phase} | "
            f"{'—' if w is None else ('yes' if w else 'no')} | {r.pred_peak_now_gib:.2f} |")
    return ("\n".join(lines + render_nccl(nccl_rows) + render_fits(fits) + render_layer(layer)) + "\n\n"
            + text["notes"])


def check(sources: Sequence[str | Path], code: MemoryAssumptions = DDP_CODE) -> tuple[str, list[Row]]:
    """Runs measured elsewhere (runs archives, or MLflow stores: a .db file, a folder holding mlflow.db or a URI)
    against the model for ``code`` (default: today's trainer, megatron-core's DDP: ``DDP_CODE``; the archived runs'
    trainer is ``FIRST_PRINCIPLES``): a Markdown table and its rows. For the check of new
    H200 runs before they are archived, e.g. ``python -m fp4moe.analysis.calibration --check
    logs/device/mlflow_probe16_gpu0.db``."""
    import tempfile

    from fp4moe.runs.archive import SUFFIXES, export

    archives: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, src in enumerate(sources):
            path = Path(src)
            if path.name.endswith(SUFFIXES):
                archives.append(path.resolve())
            else:
                out = Path(tmp) / f"store{i}.json"
                export(src, out, note=f"checked: {src}")
                archives.append(out)
        rows = table(load_cells(archives), measured=code, now=code)
    peak = [r for r in rows if r.cell.peak_gib is not None]
    ok = sum(bool(r.within_target) for r in peak)
    which = {DDP_CODE: "today's trainer (megatron-core's DDP)", FIRST_PRINCIPLES: "the trainer before megatron's DDP"
             }.get(code, "the code described by the given assumptions")
    lines = [f"{ok} of {len(peak)} measured peaks within {TARGET_PCT:g} % of the model for {which}.", "",
             "| recipe | recompute | layout | micro-batch | saved meas. (GB) | saved pred. (GB) | peak meas. (GiB) | "
             "peak pred. (GiB) | err % | phase |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r.cell
        lines.append(f"| {c.recipe} | {c.scope} | {_layout(c)} | {c.micro_batch} | {c.saved_bytes / 1e9:.3f} | "
                     f"{r.pred_saved_bytes / 1e9:.3f} | {_f(c.peak_gib, '.2f')} | {r.pred_peak_gib:.2f} | "
                     f"{_f(r.peak_err_pct(), '+.1f')} | {r.pred_phase} |")
    return "\n".join(lines) + "\n", rows


def document(date: str | None = None, commit: str | None = None) -> str:
    """results/scale/calibration.md's text from the manifest's inputs (``date`` / ``commit`` of the header: default
    today and git HEAD)."""
    return render(table(load_cells()), date=date, commit=commit, nccl_rows=table(load_cells(archives("nccl"))),
                  fits=fit_rows(), layer=layer_rows())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fp4moe.analysis.calibration", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="Markdown file to write (default: the manifest's output for "
                                                "calibration; relative to the repository root)")
    ap.add_argument("--date", default=None, help="date written in the header (default: today)")
    ap.add_argument("--commit", default=None, help="commit written in the header (default: git HEAD)")
    ap.add_argument("--check", nargs="+", metavar="ARCHIVE_OR_STORE", default=None,
                    help="instead: compare these runs (archives .json, or MLflow stores) with the model for today's "
                         "trainer (DDP_CODE) and print the table (nothing written)")
    args = ap.parse_args(argv)
    if args.check:
        text, _ = check(args.check)
        print(text)
        return 0
    why = out_problem(args.out, "calibration")
    if why:  # before the runs are read and the model is run
        ap.error(why)
    write_markdown(args.out, "calibration", document(args.date, args.commit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
