"""The memory model (fp4moe.scale.memory) against the measured H200 proxy runs (issue 6, P5): one row per
recipe x recompute scope x micro-batch that was run, with the measured and the predicted bytes one micro-batch saves
for backward and the measured and the predicted peak.

    python -m fp4moe.scale.calibration [--out results/scale/calibration.md]
    python -m fp4moe.scale.calibration --check RUNS.json|STORE.db ...   # new runs vs the model for today's code

Measured (runs archives in results/train_proxy/, format fp4moe-runs/1, loaded with fp4moe.runs_archive.load):

- ``saved_activation_bytes_per_micro_batch``: storage bytes autograd holds after ONE micro-batch's forward,
  parameters excluded (fp4moe.ops.accounting.SavedTensorBytes, the trainer's first micro-batch);
- ``summary/peak_mem_allocated_gb``: ``torch.cuda.max_memory_allocated`` over the measured steps, in GiB
  (fp4moe.train.metrics: GB = 2**30 B). OOM cells have no peak; their saved bytes were measured before the OOM.

Predicted: each run's configuration is rebuilt from its logged params (the resolved Hydra config) and evaluated by
``memory.Breakdown.allocated_bytes`` (static + saved + the largest phase transient, all from tensor shapes) under the
assumptions that describe the code the run measured (``code_of``): today's code is ``FIRST_PRINCIPLES`` (what
fp4moe.train keeps); the archives of commit 38f25cd (and the older NCCL one) measured ``MEASURED_CODE``, today's plus
two wastes found in their memory traces and removed since (``memory.MemoryAssumptions``:
``expert_backward_keeps_dead``, ``norm_cache_keeps_bf16``). Nothing is fitted to the peaks. The table also gives
each run's prediction for today's code. No torch import.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from ..paths import source_root
from .memory import GB, NOT_IN_STANDALONE_LAYER, Breakdown, MemoryAssumptions, compose_cfg, per_stage_memory

ROOT = source_root()   # the checkout (fp4moe.paths): the committed archives are relative to it
ARCHIVES = (   # one GPU
    "results/train_proxy/proxy_t1_probe_h200_2026-11-30_38f25cd.json.xz",   # 3 recipes x 5 scopes, micro-batch 16, 32
    "results/train_proxy/proxy_t1_h200_2026-11-30_38f25cd.json.xz",         # T1 cells at 32, 40, 64
    "results/train_proxy/proxy_t1_probe_h200_2026-11-30_61f1fcb.json.xz",   # the probe again, on today's code
    "results/train_proxy/proxy_t1_h200_2026-11-30_61f1fcb.json.xz",         # equal-scope pairs at 32, mla_up_proj 40 / 64
    "results/train_proxy/proxy_t1_probe_h200_2026-11-30_49a089e.json.xz",   # the probe on 49a089e (RoPE cache fix)
    "results/train_proxy/proxy_t1_h200_2026-11-30_49a089e.json.xz",         # equal-scope pair at 32, mla_up_proj 40 / 64
    "results/train_proxy/proxy_t1_h200_2026-12-01_52fe029.json.xz",         # faster FP4 kernels: equal-scope pair twice, mla_up_proj
    "results/train_proxy/proxy_t1_h200_2026-12-01_7a8040d.json.xz",         # and with the swept tiles: the pair twice
    "results/train_proxy/proxy_t1_h200_2026-12-01_841bf8a.json.xz",         # the pair, FP4 SwiGLU store on and off
    "results/train_proxy/proxy_t1_h200_2026-12-01_44185b9.json.xz",         # the fused FP4-storing SwiGLU: pairs, mla_up_proj
    "results/train_proxy/proxy_t1_h200_2026-12-01_390a277-cudacol.json.xz", # CUDA C++ column kernel: pairs, mla_up_proj
    "results/train_proxy/proxy_t1_h200_2026-12-01_1fb1546.json.xz",         # the whole MLA block recomputed (attn_block_*)
    "results/train_proxy/proxy_t1_h200_2026-12-01_902d750.json.xz",         # dispatch quantized per token vs per row, mla_up_proj
    "results/train_proxy/proxy_t1_h200_2026-12-01_831ae2f.json.xz",         # the host-time fixes: the equal-scope pair twice
    "results/train_proxy/proxy_t1_h200_2026-12-01_e431a41.json.xz",         # fp8 host stalls; full recompute's memory trace
    "results/train_proxy/proxy_t1_h200_2026-12-02_2ebd465.json.xz",         # host threads A/B; dispatcher fix under full recompute
    "results/train_proxy/proxy_t1_h200_2026-12-02_8ae3f9a.json",         # the T1 row at micro-batch 64: fp8 full, mxfp4 none
    "results/train_proxy/proxy_t1_h200_2026-12-02_67e6650.json.xz",         # the whole row at 64 (7 OOM); bf16 at 32
)
# Runs before 38f25cd measured other code (results/train_proxy/README.md: the MoE layer's forward kept more rows
# alive; before 924b9ef a leaked micro-batch), so they are not part of the 5 % check.
# Two H200s over NCCL (EP2 x DP2, PP2): a table of their own. 61f1fcb's are in the 5 % check; 924b9ef's (older code:
# the MoE forward kept more rows alive, bf16 logged no routing) are shown outside it (OUTSIDE_CHECK).
NCCL_ARCHIVES = ("results/train_proxy/proxy_nccl_h200x2_2026-11-30_61f1fcb.json.xz",
                 "results/train_proxy/proxy_nccl_h200x2_2026-12-01_fe9934e.json",   # the distributed optimizer
                 "results/train_proxy/proxy_nccl_h200x2_2026-11-30_924b9ef.json.xz")
OUTSIDE_CHECK = ("proxy_nccl_h200x2_2026-11-30_924b9ef.json.xz",)
DEFAULT_OUT = "results/scale/calibration.md"
TARGET_PCT = 5.0  # issue 6: predicted peak within 5 % of measured for every recipe x recompute cell run
GROUPS = ("model", "parallel", "precision", "recompute", "optimizer", "train")
OPTIONAL_GROUPS = ("optimizer", "train")   # absent from older runs' params (the optimizer group came with issue 27)

# What fits on one H200, measured (results/train_proxy/README.md section 19, seven OOM runs of 67e6650): torch's
# total capacity (cudaMemGetInfo; nvidia-smi's 140.40 GiB less what the driver keeps) less the process's memory
# outside PyTorch's caching allocator (CUDA context, cuBLAS workspaces, loaded kernels: 4.25-4.72 GiB in those runs,
# the largest taken). The model predicts max allocated; the usable capacity is what that may reach.
H200_TORCH_CAPACITY_GIB = 139.80
H200_NON_TORCH_GIB = 4.72
H200_USABLE_GIB = H200_TORCH_CAPACITY_GIB - H200_NON_TORCH_GIB
# The model's error on every one-GPU peak measured (predicted / measured - 1: -2.0 % to +1.3 %, 217 runs; a test
# keeps the range inside this): a predicted peak that could lie on either side of the usable capacity within it is
# an edge cell, neither a fit nor an OOM.
PEAK_ERR_RANGE = (-0.020, 0.013)


def fit_outcome(pred_peak_gib: float, usable_gib: float = H200_USABLE_GIB) -> str:
    """'fits' when even the largest peak the model's error allows (pred / (1 - 2.0 %)) is within ``usable_gib``,
    'OOM' when even the smallest (pred / (1 + 1.3 %)) is over it, else 'edge'."""
    lo, hi = (pred_peak_gib / (1 + e) for e in reversed(PEAK_ERR_RANGE))
    return "fits" if hi <= usable_gib else ("OOM" if lo > usable_gib else "edge")

# What fp4moe.train kept on one GPU before megatron's DDP (its own optimizer, every archive below): 2 B BF16 weight + 4 B FP32 master + 8 B AdamW m, v per
# parameter, no distributed optimizer (one GPU); 4 B FP32 gradient accumulators only once a step's first
# micro-batch has finished its backward; FP8 column copies padded per expert as real (uneven) routing pads them.
FIRST_PRINCIPLES = MemoryAssumptions(main_grad_resident="after_first_micro_batch", expert_padding="expected")
# The trainer since issue 27 (megatron-core's DDP and optimizer, fp4moe.train.optim): the main-gradient buffer exists
# from the start (and each BF16 .grad is folded into it as it is made); the archives above measured the trainer
# before it (its own optimizer: FIRST_PRINCIPLES). What --check compares new runs with by default.
DDP_CODE = replace(FIRST_PRINCIPLES, main_grad_resident="always")
# The code the archives measured (commit 38f25cd): the routed experts' backward kept an unused [R, H] GEMM output,
# dZ and the decoded H until it returned; the norm checkpoints kept their BF16 input beside the MXFP4 cache.
MEASURED_CODE = replace(FIRST_PRINCIPLES, expert_backward_keeps_dead=True, norm_cache_keeps_bf16=True)
# The code each archive measured, where it is not today's (by file name)
CODE_OF = {"proxy_t1_probe_h200_2026-11-30_38f25cd.json.xz": MEASURED_CODE,
           "proxy_t1_h200_2026-11-30_38f25cd.json.xz": MEASURED_CODE,
           "proxy_nccl_h200x2_2026-11-30_924b9ef.json.xz": MEASURED_CODE}


# The archives up to e431a41's measured megatron's token dispatchers keeping their last forward's routing probabilities
# through the backward (MemoryAssumptions.dispatcher_keeps_recompute_graph; the trainer drops them since 495f655):
# an archive of later code goes into DROPS_DISPATCHER_GRAPH (2ebd465: full recompute 0.78 GiB lower at 16, 1.40 at 32).
DROPS_DISPATCHER_GRAPH: frozenset[str] = frozenset({"proxy_t1_h200_2026-12-02_2ebd465.json.xz",
                                                    "proxy_t1_h200_2026-12-02_8ae3f9a.json",
                                                    "proxy_t1_h200_2026-12-02_67e6650.json.xz"})


def code_of(archive: str) -> MemoryAssumptions:
    """The model's assumptions for the code an archive (file name) measured: ``CODE_OF``, else today's; with
    ``dispatcher_keeps_recompute_graph`` unless the archive is in ``DROPS_DISPATCHER_GRAPH``."""
    name = Path(archive).name
    code = CODE_OF.get(name, FIRST_PRINCIPLES)
    return code if name in DROPS_DISPATCHER_GRAPH else replace(code, dispatcher_keeps_recompute_graph=True)


@dataclass(frozen=True)
class Cell:
    """One measured run: its configuration (``cfg``, rebuilt from the logged params) and what was measured."""

    archive: str
    recipe: str
    scope: str
    micro_batch: int
    global_batch: int
    seq_length: int
    saved_bytes: int               # measured, one micro-batch
    peak_gib: float | None         # measured max allocated, GiB; None when the run went OOM
    outcome: str                   # 'ok' | 'OOM'
    cfg: dict
    step_start_gib: float | None = None  # measured allocated GiB when a step begins (runs from 924b9ef on)
    # routed rows GPU 0's experts received / the rows its tokens sent (a2a/dispatch_forward_*_rows, or the recipe
    # dispatcher's payload bytes in older runs; None where neither was logged: bf16 before 1833554): at the first
    # step (when the saved bytes were measured) and the largest over the measured steps (where the peak was)
    rows_factor_first: float | None = None
    rows_factor_max: float | None = None

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


def load_cells(archives: Sequence[str | Path] = ARCHIVES, root: Path = ROOT) -> list[Cell]:
    """Every run of the archives that logged the saved-bytes metric, in archive order, then recipe, scope, micro-batch."""
    from fp4moe.runs_archive import load, withdrawn

    cells = []
    for a in archives:
        path = root / a  # an absolute path stays as it is
        doc = load(path)
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
            # routed rows (every recipe, from 1833554 on) or, before, the recipe dispatcher's payload bytes
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
            cells.append(Cell(archive=path.name, recipe=t["recipe"], scope=t["recompute"],
                              micro_batch=int(cfg["parallel"]["micro_batch"]),
                              global_batch=int(cfg["parallel"]["global_batch"]),
                              seq_length=int(cfg["parallel"]["seq_length"]), saved_bytes=int(saved[0][1]),
                              peak_gib=None if (oom or not peak) else float(peak[-1][1]),
                              outcome="OOM" if oom else "ok", cfg=cfg,
                              step_start_gib=float(start[-1][1]) if start and not oom else None,
                              rows_factor_first=first, rows_factor_max=top))
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
    pred_peak_gib: float           # the model for the code the run measured (code_of)
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
        """Part of the 5 % check (a measured peak, from an archive not in OUTSIDE_CHECK)."""
        return self.cell.peak_gib is not None and Path(self.cell.archive).name not in OUTSIDE_CHECK


def allocated_peak(cfg, a: MemoryAssumptions) -> Breakdown:
    """The pipeline rank with the largest allocated peak (``Breakdown.allocated_bytes``, what
    ``torch.cuda.max_memory_allocated`` measures; the memory outside PyTorch is not part of it)."""
    return max(per_stage_memory(cfg, a), key=lambda x: x.allocated_bytes)


def table(cells: Sequence[Cell] | None = None, measured: MemoryAssumptions | None = None,
          now: MemoryAssumptions = FIRST_PRINCIPLES) -> list[Row]:
    """One row per cell, predicted for the code the run measured (``measured``, default: ``code_of`` its archive)
    and for today's (``now``). Under PP the measured saved bytes are summed over the stages (the trainer logs the
    whole model's) and the measured peak is the largest over the GPUs: so are the predictions (per_stage_memory)."""
    cells = load_cells() if cells is None else cells
    rows = []
    for c in cells:
        cfg = OmegaConf.create(c.cfg)
        code = code_of(c.archive) if measured is None else measured
        # the routing each run measured: its first step's for the saved bytes, the largest for the peak
        first = replace(code, expert_rows_factor=c.rows_factor_first or 1.0)
        top, top_now = (replace(x, expert_rows_factor=c.rows_factor_max or 1.0) for x in (code, now))
        b = allocated_peak(cfg, top)
        static = (b.params_bytes + b.grads_bytes + b.optimizer_bytes) / GB
        saved = sum(x.per_microbatch_activation_bytes for x in per_stage_memory(cfg, first))
        rows.append(Row(c, saved, b.allocated_gb, b.peak_phase, static, allocated_peak(cfg, top_now).allocated_gb))
    return rows


# P2's MoE layer benchmark (fp4moe.moe.bench; results/moe_layer/README.md "Final run"): the DeepSeek-V3 MoE layer
# (hidden 7168, 32 local experts of ffn 2048, top-8, one shared expert, 4096 tokens) on one H200 and on two over
# NCCL, every recipe; the saved bytes of one forward counted by the trainer's own hooks (fp4moe.ops.accounting).
# Earlier files of that folder counted the layer's input twice (fixed in be29b77).
LAYER_BE29B77 = ("results/moe_layer/moe_layer_h200_ep1_2026-11-30_be29b77.json",
                 "results/moe_layer/moe_layer_h200_ep2_2026-11-30_be29b77.json")
# The layer's code since 083ec29 (MoELayer.forward frees its [T*k, H] intermediates) at four shapes on one H200,
# with the allocator's trace of each recipe's peak (--memtrace): saved bytes and the peak over the base are checked
# (memory.standalone_moe_layer_peak). Older files' peaks are not modelled (their forward held more).
LAYER_PEAK_FILES = tuple(f"results/moe_layer/moe_layer_h200_ep1{tag}_2026-12-02_083ec29.json"
                         for tag in ("", "_t2048", "_t8192", "_e16"))
LAYER_FILES = LAYER_BE29B77 + LAYER_PEAK_FILES


@dataclass(frozen=True)
class LayerRow:
    """One recipe of a layer-benchmark file: measured saved bytes (one forward) vs the model's MoE-layer tensors
    for that shape, routing (measured rows per local expert) and EP; for the files of LAYER_PEAK_FILES also the
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


def layer_rows(files: Sequence[str | Path] = LAYER_FILES, root: Path = ROOT,
               peak_files: Sequence[str | Path] = LAYER_PEAK_FILES) -> list[LayerRow]:
    """The model against P2's layer benchmark: ``layer_saved_tensors`` of a dsv3_671b MoE layer with the file's
    shape (experts = local x EP, EP = its world size, one sequence of its tokens) at recompute none, its measured
    per-expert rows (``expert_counts``: the routing and the FP8 padding), less ``memory.NOT_IN_STANDALONE_LAYER``; for
    ``peak_files`` also ``standalone_moe_layer_peak`` against the measured peak over the base."""
    from .memory import layer_saved_tensors, standalone_moe_layer_peak

    peaks = {Path(f).name for f in peak_files}
    out = []
    for f in files:
        path = root / f  # an absolute path stays as it is
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
            pred = sum(t.bytes for t in layer_saved_tensors(cfg, "moe", "none", a)
                       if t.name.startswith("moe.") and t.name not in NOT_IN_STANDALONE_LAYER)
            peak = {}
            if path.name in peaks:
                if r.get("peak_over_base_gib") is None:
                    raise ValueError(f"{path.name}: {r['recipe']} has no measured peak (a CPU run?)")
                p_bytes, phase = standalone_moe_layer_peak(cfg, a)
                peak = dict(peak_measured=round(r["peak_over_base_gib"] * 2**30), peak_predicted=p_bytes, phase=phase,
                            traced_phase=traced_phase(r.get("memory_peak")))
            out.append(LayerRow(path.name, ws, r["recipe"], int(r["saved_bytes"]), pred, int(shape["tokens"]),
                                int(shape["local_experts"]), **peak))
    return out


def render_layer(rows: Sequence[LayerRow]) -> list[str]:
    lines = ["", "## P2's MoE layer (fp4moe.moe.bench)", "",
             "The DeepSeek-V3 MoE layer alone (hidden 7168, local experts of ffn 2048, top-8, one shared expert; "
             "4096 tokens per GPU and 32 local experts unless the row says otherwise), one forward's saved bytes as "
             "the trainer counts them, against the model's MoE-layer tensors at that shape with the run's measured "
             "rows per expert (routing and FP8 padding). The routed experts are the trainer's code (fp4moe's grouped "
             "experts); the router and the dispatch are the layer's own (P2), not megatron's, which the model "
             "describes: the small differences. The peak over the base (one forward + backward, every `.grad` None; "
             "`memory.standalone_moe_layer_peak`) is modelled for the layer's code since 083ec29; the phase column "
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

    archive: str
    recipe: str
    scope: str
    micro_batch: int
    measured: str
    pred_peak_gib: float
    predicted: str

    @property
    def contradicts(self) -> bool:
        return contradicts(self.measured, self.predicted)


def contradicts(measured: str, predicted: str) -> bool:
    """A run that went OOM (``measured`` 'OOM') where the model says it fits, or fit ('ok') where the model says
    OOM (``predicted``: fit_outcome's 'fits' | 'edge' | 'OOM')."""
    return (measured, predicted) in (("OOM", "fits"), ("ok", "OOM"))


def fit_rows(archives: Sequence[str | Path] = ARCHIVES, root: Path = ROOT,
             usable_gib: float = H200_USABLE_GIB) -> list[FitRow]:
    """Every run of the archives, OOM runs included (one that ran out of memory in its first forward logged no saved
    bytes and is not in ``load_cells``), its measured outcome beside ``fit_outcome`` of the model's peak (the code the
    run measured, ``code_of``; uniform routing)."""
    from fp4moe.runs_archive import load

    out = []
    for a in archives:
        path = root / a  # an absolute path stays as it is
        for r in load(path)["runs"]:
            t = r["tags"]
            cfg = OmegaConf.create(cfg_from_params(r["params"]))
            pred = allocated_peak(cfg, code_of(path.name)).allocated_gb
            out.append(FitRow(path.name, t["recipe"], t["recompute"], int(cfg.parallel.micro_batch),
                              "OOM" if t.get("outcome") == "OOM" else "ok", pred, fit_outcome(pred, usable_gib)))
    return out


def render_fits(rows: Sequence[FitRow]) -> list[str]:
    """The fit / OOM check: counts, and every run that went OOM or that the model puts at the edge."""
    n = lambda m, p: sum(r.measured == m and r.predicted == p for r in rows)  # noqa: E731
    lo, hi = (100 * e for e in PEAK_ERR_RANGE)
    lines = ["", "## Fits or OOM on one H200", "",
             f"Usable capacity {H200_USABLE_GIB:.2f} GiB: torch's total {H200_TORCH_CAPACITY_GIB:.2f} GiB less "
             f"{H200_NON_TORCH_GIB:.2f} GiB the process holds outside PyTorch's allocator (the largest of seven OOM "
             "messages of 67e6650, `H200_NON_TORCH_GIB`). Predicted **fits** when the model's peak stays within it "
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
            lines.append(f"| {_archive_commit(r.archive)} | {r.recipe} | {r.scope} | {r.micro_batch} | {r.measured} | "
                         f"{r.pred_peak_gib:.2f} | {r.predicted} |")
    return lines


NOTES = """
## What the table says

- **Saved activations: solved** (to 76 B per micro-batch for bf16 and mxfp4; within 0.07 % for fp8, whose FP8
  column copies are padded to 128 rows per expert by the real, uneven routing; the model uses the expected padding).
- **Peak: every run within 5 % (one GPU: within 2.0 %), from tensor shapes**, on one GPU and over NCCL (EP2 x
  DP2, PP2), for sixteen code versions (38f25cd, 61f1fcb, 49a089e, fe9934e, 52fe029, 7a8040d, 841bf8a, 44185b9,
  390a277, 1fb1546, 902d750, 831ae2f, e431a41, 2ebd465, 8ae3f9a, 67e6650; 841bf8a to 390a277 changed kernels, not
  what is kept; 1fb1546 added
  the whole-block attention recompute, whose five runs `attn_block_ln_*` are within 0.7 %; 902d750 quantizes the
  dispatch per token, 831ae2f and e431a41 move host work off the GPU's path: the same peaks to the MiB). The model takes the largest of three phases instead of adding every transient it
  knows (fp4moe.scale.memory, part (e)):
  - *head*: the BF16 logits [T, V] beside the saved fp32 softmax. bf16 none / mla_up_proj peak here (-0.1 to -0.2 %).
  - *the last MoE layer's forward*: its dispatch buffers, while the head's saved tensors do not exist yet. No run
    peaks here since the recipe MoE layer frees each stage's rows early.
  - *the routed experts' backward*: every other run. In fp4moe's grouped experts (fp8, mxfp4) the larger of fc1's
    dgrad (dY [R, H], dH [R, 2F] and its FP8 rows, dX [R, H], fc2's weight gradient) and fc1's wgrad after it (dY,
    dH, dX, dH's FP8 column copy, under mxfp4 x's FP8 column copy rebuilt from its MXFP4 copy, both weight
    gradients); in megatron's SequentialMLP (bf16) dY, the per-expert dX pieces and their concatenation, every
    expert's weight gradients made by then. Plus the layer's output and input gradients
    (2 x [T, H]), minus the head's saved tensors (freed by then), plus what the scope recomputed there:
    attn_ln_experts the experts' tensors and the checkpoint's recomputed output [R, H]; attn_ln_* the pre-MLP norm's
    recomputed output twice (megatron's `CheckpointWithoutOutput._recompute` keeps its recomputation's output and
    refills the discarded storage with a copy) and, under mxfp4's caches, its decoded input; full the whole layer,
    at the MoE layer where the BF16 gradients made so far outweigh the activations freed (the first one).
- **The 2026-11-30 prediction for today's code, checked (61f1fcb rows).** The two wastes removed after 38f25cd
  (the grouped experts' backward kept dead buffers; mxfp4's norm caches kept the BF16 input too) came off as the
  saved bytes and the first-principles terms said for fp8 (attn_ln_mlp at 32: 85.5 -> 79.6 GiB, predicted 78.5) but
  not fully for mxfp4 (55.9 -> 44.1 GiB, predicted 40.4: -8.4 %). The mxfp4 runs then peaked in two places the model
  had not listed, both hidden before under the larger dead buffers: fc1's wgrad, where x's FP8 column copy is
  rebuilt from MXFP4 (+2 GiB at 32), and the pre-MLP norm's recompute under attn_ln_* (3 x [T, H], which fp8 has
  too, 2 x [T, H]). With them, every cell of both code versions is within 5 %.
- **49a089e: the probe and the equal-scope pair again, after the RoPE-cache fix and the trainer's HashStore.**
  The saved bytes of mxfp4 mla_up_proj now match the model to the same 76 B as every other cell (61f1fcb's runs
  saved 4 x 0.91 MB less: MLA's RoPE frequencies were packed to MXFP4). Every probe peak is within 0.02 GiB of
  61f1fcb's.
- **EP2 x DP2: the missing GiB at step start was the optimizer.** The EP runs began each step 0.9-1.1 GiB above the
  static prediction. The memory trace of an EP2 run (mem2) shows why: fp4moe.train keeps the fp32 master weights
  and Adam moments of every parameter on every data-parallel rank (5.22 GiB on GPU 0), while the config said
  `distributed_optimizer: true` and the model sharded the dense ones over DP2 (4.30 GiB). The trainer did not
  shard then; the model predicts what ran (runs that do not log `summary/optimizer_state_bytes` are read as
  unsharded; since 2026-11-30 the trainer shards when asked, fp4moe.train.optim): all six 61f1fcb NCCL runs within
  5 % (-3.9 to +1.3 %).
- **e431a41: the full-recompute residual, explained and removed from the code.** Until this table the full-recompute
  runs were under-predicted by 2.5-4.4 % (1.0-1.5 GiB). A memory trace of fp8 and mxfp4 under full recompute at 16
  (results/train_proxy/memtrace_h200_mb16_e431a41/) showed two things live at the peak (the first MoE layer's
  experts' backward) that the model did not hold: (1) the layer's own expert weight gradients (BF16 .grad: fc2's
  from its backward on, fc1's from its wgrad; 0.375 GiB on the proxy), in every scope of fp4moe's grouped experts,
  now in the expert-backward phase (it moves the other scopes' fp8 and mxfp4 errors from -1.3..+0.4 % to
  -0.3..+0.7 %, one older mxfp4 mla_up_proj probe cell at -2.0 %; not for bf16, whose traced peaks come before the
  layer's own gradients exist: at the head, or in the recomputed forward under full); (2) the inputs of the MoE
  layers after it (and the last one's input gradient), which megatron's
  dispatchers kept alive by holding the routing probabilities of their recomputation (its graph's leaves are the
  layer's detached input and that input's gradient) until the step's backward had passed. The model holds (2) for
  the code the archives measured (`MemoryAssumptions.dispatcher_keeps_recompute_graph`; `code_of`); the trainer
  now drops them when each MoE layer's forward returns (`fp4moe.model.build.release_dispatcher_after_forward`),
  which the today's-code column shows (1.32 GiB less at 32, 0.75 at 16). With both, the full-recompute runs are
  within -0.4..+0.5 % (fp8, mxfp4) and +0.3..+0.7 % (bf16).
- **2ebd465: the dispatcher fix measured.** fp8 and mxfp4 under full recompute on the code that drops the
  dispatchers' probabilities (`DROPS_DISPATCHER_GRAPH`): 0.78 GiB lower at 16 than e431a41's runs (the model: 0.75)
  and 1.39-1.41 GiB lower at 32 than 49a089e's (the model: 1.32); predicted within +0.3..+0.8 %. The other cells of
  that archive (host-thread A/B, the lighter scope, the profiles) keep their peaks to 0.1 GiB. 8ae3f9a (host-thread
  defaults only) measured the proxy's T1 row at micro-batch 64: fp8 full 79.32 GiB (+0.9 %), mxfp4 none 109.08
  (+0.7 %).
- **67e6650: the whole T1 row at micro-batch 64, and what fits.** Eight cells fit (predicted +0.8..+1.1 % over
  the measured peaks), seven went OOM. Their OOM messages give the usable capacity (torch's 139.80 GiB less 4.25-4.72
  GiB outside PyTorch's allocator); with it and the model's error range, five of the seven are predicted OOM and two
  (bf16 attn_ln_mlp and mla_up_proj, 136.2 and 134.1 GiB predicted) at the edge: no run contradicts the model
  ("Fits or OOM" above). Against nvidia-smi's 140.4 GiB those two would have been called fits.
- **P2's MoE layer** (the layer benchmark's final run, be29b77, one H200 and two over NCCL): one forward's saved
  bytes within +0.06..+0.66 % of the model's MoE-layer tensors at that shape with the measured rows per expert
  ("P2's MoE layer" above); the layer's peak in its benchmark harness is not modelled.
- **What the model still leaves out**: cuBLAS/cuDNN workspaces and the kernels' cached launch tables (the measured
  step start is 0.08-0.27 GiB above the static prediction and grows with the micro-batch); the largest one-GPU
  error left is -2.0 % (mxfp4 mla_up_proj at 16 in the probe of 38f25cd).
- The 8-GPU runs of issue 7 are still to come.
"""


def _archive_commit(name: str) -> str:
    m = re.search(r"_([0-9a-f]{7})(?:-[a-z0-9-]+)?\.json(?:\.xz)?$", name)  # <commit>.json[.xz], <commit>-<variant>.json[.xz]
    return m.group(1) if m else "?"


def _git_head(root: Path = ROOT) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _layout(c: Cell) -> str:
    p = c.cfg["parallel"]
    per_rank = c.global_batch // (c.micro_batch * int(p.get("data", 1) or 1))
    return f"EP{p.get('expert', 1)} DP{p.get('data', 1)} PP{p.get('pipeline', 1)}, {per_rank} x {c.micro_batch}"


def render_nccl(rows: Sequence[Row]) -> list[str]:
    """The table of the runs over NCCL (EP2 x DP2, PP2 on two H200s); rows of OUTSIDE_CHECK archives are marked."""
    if not rows:
        return []
    archives = sorted({r.cell.archive for r in rows})
    lines = ["", "## Runs over NCCL (two H200s)", "",
             "Saved bytes: the whole model's (PP: summed over the stages; EP: GPU 0's, whose routed rows follow the "
             "real routing); peak: the largest over the GPUs; the prediction likewise (its static part is that of "
             "the predicted peak's stage; the measured step start is GPU 0's). Under EP the model takes the rows GPU "
             "0's experts received, from the run's own all-to-all metrics (routed rows, or before 4cc9235 the recipe "
             "dispatcher's bytes): the first step's for the saved bytes, the largest measured step's for the peak. "
             "The optimizer state is replicated over the data-parallel ranks for the runs that do not log "
             "`summary/optimizer_state_bytes` (the trainer of those runs kept it so) and sharded as configured "
             "(`parallel.distributed_optimizer`) for the runs that do. "
             f"In the {TARGET_PCT:g} % check: the runs of today's code; not: "
             + ", ".join(f"`{a}`" for a in archives if Path(a).name in OUTSIDE_CHECK)
             + " (older code: the MoE forward kept more rows alive; megatron's bf16 dispatcher logged no routing, "
             "so that bf16 run assumes balanced routing). Archives: " + ", ".join(f"`{a}`" for a in archives) + ".",
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
        lines.append(f"| {_archive_commit(c.archive)} | {c.recipe} | {c.scope} | {_layout(c)} | {routing} | "
                     f"{_f(c.step_start_gib, '.2f')} | "
                     f"{r.pred_static_gib:.2f} | {c.saved_bytes / 1e9:.3f} | {r.pred_saved_bytes / 1e9:.3f} | "
                     f"{r.saved_err_pct:+.2f} | {_f(c.peak_gib, '.2f')} | {r.pred_peak_gib:.2f} | "
                     f"{_f(r.peak_err_pct(), '+.1f')} | {r.pred_phase} | {w} |")
    return lines


def render(rows: Sequence[Row], date: str | None = None, commit: str | None = None,
           nccl_rows: Sequence[Row] = (), fits: Sequence[FitRow] = (), layer: Sequence[LayerRow] = ()) -> str:
    date = date or _dt.date.today().isoformat()
    commit = commit or _git_head()
    archives = sorted({r.cell.archive for r in rows})
    n_peak = [r for r in (*rows, *nccl_rows) if r.checked]
    ok = [r for r in n_peak if r.within_target]
    errs = [r.peak_err_pct() for r in n_peak]
    lo, hi = (min(errs), max(errs)) if errs else (0.0, 0.0)
    max_saved = max((abs(r.saved_err_pct) for r in rows), default=0.0)
    lines = [
        "# The memory model against the H200 proxy runs (issue 6, P5)",
        "",
        f"Written by `python -m fp4moe.scale.calibration` on {date} at commit {commit}. Measured: NVIDIA H200s, "
        "torch 2.11.0+cu130, megatron-core 0.16.1, model `proxy_h200` (4 layers, 1 dense + 3 MoE with 32 experts "
        "top-8, hidden 2048, MLA, vocabulary 16384), one GPU (first table) or two over NCCL (second table), "
        "sequence 4096, FP8 on every linear "
        "(`precision.scope=all_linears`).",
        "",
        "Archives (results/train_proxy/, the commit each was measured at is in its name): "
        + ", ".join(f"`{a}` ({_archive_commit(a)})" for a in archives) + ".",
        "",
        "- **saved**: bytes one micro-batch's forward keeps for backward, parameters excluded "
        "(`saved_activation_bytes_per_micro_batch`, fp4moe.ops.accounting) vs the model's "
        "`per_microbatch_activation_bytes`, in GB = 10^9 B (exact bytes: tests/scale/test_calibration.py).",
        "- **peak**: `torch.cuda.max_memory_allocated` in GiB (2^30 B) vs the model's `allocated_bytes` for the code "
        "the run measured (**code**: 38f25cd = `MEASURED_CODE`, with the two wastes removed since; 61f1fcb, "
        "49a089e, fe9934e, 52fe029, 7a8040d, 841bf8a, 44185b9, 390a277 and 1fb1546 = today's, `FIRST_PRINCIPLES`; "
        "61f1fcb still packed MLA's RoPE frequencies under mxfp4 mla_up_proj): static + saved + the largest of "
        "three phase transients (the head's logits, the last MoE layer's forward, the routed experts' backward), "
        "from tensor shapes; nothing fitted to the peaks. "
        "**phase**: where the model puts the peak.",
        "- **peak now**: the model for the same run with today's code (`FIRST_PRINCIPLES`). For the 38f25cd rows it "
        "was the prediction that the 61f1fcb runs checked.",
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
            f"| {_archive_commit(c.archive)} | {c.recipe} | {c.scope} | {c.micro_batch} | {c.global_batch} | "
            f"{c.outcome} | "
            f"{_f(c.step_start_gib, '.2f')} | {r.pred_static_gib:.2f} | {c.saved_bytes / 1e9:.3f} | "
            f"{r.pred_saved_bytes / 1e9:.3f} | {r.saved_err_pct:+.3f} | {_f(c.peak_gib, '.2f')} | "
            f"{r.pred_peak_gib:.2f} | {_f(r.peak_err_pct(), '+.1f')} | {r.pred_phase} | "
            f"{'—' if w is None else ('yes' if w else 'no')} | {r.pred_peak_now_gib:.2f} |")
    return "\n".join(lines + render_nccl(nccl_rows) + render_fits(fits) + render_layer(layer)) + "\n" + NOTES


def check(sources: Sequence[str | Path], code: MemoryAssumptions = DDP_CODE) -> tuple[str, list[Row]]:
    """Runs measured elsewhere (runs archives, or MLflow stores: a .db file, a folder holding mlflow.db or a URI)
    against the model for ``code`` (default: today's trainer, megatron-core's DDP: ``DDP_CODE``; the archived runs'
    trainer is ``FIRST_PRINCIPLES``): a Markdown table and its rows. For the check of new
    H200 runs before they are archived, e.g. ``python -m fp4moe.scale.calibration --check logs/device/mlflow_probe16_gpu0.db``."""
    import tempfile

    from fp4moe.runs_archive import SUFFIXES, export

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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=DEFAULT_OUT, help="Markdown file to write (relative to the repository root)")
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
    text = render(table(load_cells()), date=args.date, commit=args.commit,
                  nccl_rows=table(load_cells(NCCL_ARCHIVES)), fits=fit_rows(), layer=layer_rows())
    out = ROOT / args.out  # an absolute path stays as it is
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
