"""The paper's T1 (DeepSeek-V3 671B, 256 GPUs) with the lab's setup, predicted by the memory model beside the paper's
numbers, and how each assumption moves each cell (issue 27, part C).

    python -m fp4moe.analysis.paper_t1 [--out FILE]     # results/scale/paper_t1.md (results/manifest.yaml)

Each cell is what ``python -m fp4moe.train experiment=paper_t1`` runs (``memory.experiment_cfg``: the configs
state the setup and its sources, the sister artifact's DeepSeek-V3 runs), under ``paper_setup()``, the model's
assumptions outside the config: DeepEP's buffers (the lab's dispatcher) and the measured memory outside PyTorch
(``fp4moe.analysis.outside_torch_measured``). The headline is the most loaded GPU's peak as nvidia-smi would show it
(``Breakdown.total_bytes``), in GiB and in % of the 80 GB GPU's memory (``GPU_MIB``); PyTorch's allocated peak and
the mean over the 256 GPUs beside it. The paper's cells come from conf/paper/numbers.yaml. Arithmetic only, no torch;
nothing is fitted to the paper.

The model describes the lab's code, not fp4moe's: megatron-core with Transformer Engine 2.8 and the paper release's
patches keep other tensors than fp4moe's own linears and experts, and ``paper_setup()`` turns on every switch of
``memory.LAB_STACK`` (``STACK`` names each one's source in the lab's code). ``VARIANTS`` are the sensitivity table's
rows: one assumption changed at a time, each lab's-stack switch among them. ``sister_check`` puts the model
beside the lab's own measurements of the same setup (numbers.yaml ``sister_dsv3_ep8_memory``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from omegaconf import OmegaConf

from .. import paper
from ..scale.memory import (CONF, GB, LAB_STACK, NOT_MEASURED, MemoryAssumptions, experiment_cfg, mean_total_bytes,
                            per_stage_memory)
from ..scale.outside_torch import nccl_peer_bytes_from_source
from .calibration import PEAK_ERR_RANGE, gpu_outcome, h200_memory
from .output import markdown_cli
from .outside_torch_measured import measured_assumptions

EXPERIMENT = "paper_t1"
# The paper's GPU, an "80 GB" Hopper (H100 / H800 SXM): 81559 MiB of device memory, the total nvidia-smi and
# torch.cuda.get_device_properties report. The paper's "% of 80 GB" is read as a share of it (the abstract's 14.8 %
# = 11.8 GB holds for 80 GiB and for 81559 MiB alike) and a cell fits when its total does; GiB = 2**30 B throughout.
GPU_MIB = 81559
GPU_GIB = GPU_MIB / 1024
# The lab's monitoring reports "GB" (numbers.yaml sister_dsv3_memory) without saying which: both readings, in GiB
SISTER_GB_READINGS = {"GiB": 1.0, "10^9 B": 1e9 / 2**30}
SCOPES = ("attn_ln_experts", "attn_ln_mlp", "mla_up_proj")   # the paper's scopes (numbers.yaml t1.scopes)
RECIPES = ("bf16", "fp8", "mxfp4")
TARGET_PP = 3.0   # issue 27: each cell the paper fits within 3 points of the 80 GB GPU
# NCCL's peers as NCCL 2.28.9's source implies them under the lab's NCCL_MIN_NCHANNELS=32 (run_dlc_e2e.sh): 32 ring
# channels and 32 send / recv channels per peer, 12 MiB each (fp4moe.scale.outside_torch); not measured (no two GPUs)
SOURCE_PEERS = nccl_peer_bytes_from_source(32)
SOURCE_PEERS_NAME = "NCCL's peers from its source (not measured: 384 MiB per ring and per send / recv peer)"
# Each lab's-stack switch: what it is, and the line of the lab's code that says so (megatron = the FP8-Flow-MoE fork
# 021ai/Megatron-LM-FP8FlowMoe and the release's megatron-0.15.0rc7.diff; TE = 021ai/TransformerEngine-FP8FlowMoe
# and the release's transformer_engine-2.8.diff; pretrain_ds.sh = the sister artifact's launch script)
STACK = {
    "fp8_any_shape": (
        "TE's FP8 for every linear shape",
        "TE's utils.py assert_dim_for_fp8_exec asks only for input rows a multiple of 8 and features of 16, so MLA's "
        "kv_down_proj (7168 -> 576), which fp4moe keeps BF16, runs FP8 and saves its own copy"),
    "fp8_weight_workspaces": (
        "TE's FP8 weight copies cached for the run",
        "megatron's TE wrappers (extensions/transformer_engine.py, TELinear / TEGroupedLinear forward) pass "
        "is_first_microbatch unless --disable-parameter-transpose-cache, and TE's linear.py / grouped_linear.py then "
        "keep the quantized weight, rows and columns, via get_weight_workspace(cache_name='weight')"),
    "fp8_saves_columnwise": (
        "TE's column-wise-only FP8 saves",
        "TE's linear.py drops the row-wise data of an input it quantized ('Discard row-wise data since it is not "
        "needed in backward pass'), grouped_linear.py and layernorm_linear.py call update_usage(rowwise_usage=False)"
        " on what they save"),
    "save_original_input": (
        "megatron's save_original_input behind a recomputed norm",
        "megatron's transformer_layer.py, under the 'layernorm' recompute with config.fp8, calls "
        "set_for_recompute_input_layernorm (q_down, kv_down) and set_for_recompute_pre_mlp_layernorm (the shared "
        "expert's fc1), which set save_original_input; the release's save_fp4 needs it off"),
    "fused_norm_linears": (
        "norms fused into TE's LayerNormLinear",
        "megatron's TE layer spec (gpt_layer_specs.py) builds the dense fc1 and, with qk_layernorm, q_up / kv_up as "
        "TELayerNormColumnParallelLinear, with an IdentityOp pre_mlp_layernorm in the dense layers; the release's TE "
        "diff gives save_fp4 to linear.py and grouped_linear.py, not layernorm_linear.py"),
    "dense_swiglu_fp4": (
        "the release's MXFP4 SwiGLU input in the dense MLPs",
        "the release's megatron-0.15.0rc7.diff passes fp4_input_store=config.activation_func_fp4_input_store to "
        "the dense MLP's bias_swiglu_impl (mlp.py), as to the experts' and the shared expert's"),
    "te_grouped_experts": (
        "TE's grouped experts with the wgrad into the main grads",
        "pretrain_ds.sh passes --moe-grouped-gemm (megatron's TEGroupedMLP) and keeps megatron's default "
        "gradient-accumulation fusion, so TE's grouped_linear.py writes the wgrad GEMMs into main_grad "
        "(wgrad_list = main_grads)"),
}
assert tuple(STACK) == tuple(LAB_STACK)


@functools.cache
def paper_setup() -> MemoryAssumptions:
    """The model's assumptions beyond the config: the lab's code (megatron-core + Transformer Engine + the release's
    patches: every switch of ``memory.LAB_STACK``, ``STACK`` says where), its DeepEP dispatcher, and the measured
    terms outside PyTorch."""
    return measured_assumptions(deepep_buffers=True, **LAB_STACK)


def setup_label(a: MemoryAssumptions | None = None, experiment: str = EXPERIMENT) -> str:
    """The assumption set in words (default ``paper_setup()``), for the report's model column and the tables."""
    a = paper_setup() if a is None else a
    on = [k for k in LAB_STACK if getattr(a, k)]
    stack = ("the lab's code (megatron-core + Transformer Engine + the release's patches: all of memory.LAB_STACK)"
             if len(on) == len(LAB_STACK) else "fp4moe's code" if not on else
             f"the lab's code in part ({', '.join(on)} of memory.LAB_STACK)")
    return (f"`experiment={experiment}` (the lab's setup: sister artifact) as {stack}, DeepEP buffers"
            f"{'' if a.deepep_buffers else ' off'}, outside-PyTorch terms: {a.outside_torch_source}")


def sweep_recompute(experiment: str = EXPERIMENT) -> dict[str, str]:
    """{the paper's scope: the recompute group the experiment sweeps for it} (each group's ``paper_scope``)."""
    names = str(OmegaConf.load(CONF / "experiment" / f"{experiment}.yaml").hydra.sweeper.params.recompute).split(",")
    return {str(OmegaConf.load(CONF / "recompute" / f"{n}.yaml").paper_scope): n for n in names}


# The lab's three DeepSeek-V3 layouts (run_dlc_e2e.sh): ep8 is conf/parallel/paper_671b.yaml; ep16: PP16 with
# MP_PPN_LAYERS=1 (4 layers per stage, 1 on the last); ep32: PP8 with MP_PPN_LAYERS=5 (8 per stage, 5 on the last)
LAYOUTS = {
    "ep8": (),
    "ep16": ("parallel.pipeline=16", "parallel.expert=16", "parallel.data=16",
             "parallel.pipeline_layout='Etttt|(tttt|)*14,tL'"),
    "ep32": ("parallel.pipeline=8", "parallel.expert=32", "parallel.data=32",
             "parallel.pipeline_layout='Etttttttt|(tttttttt|)*6,tttttL'"),
}
CORE_ATTENTION = {"attn_ln_experts": "attn_ln_experts", "attn_ln_mlp": "attn_ln_mlp", "mla_up_proj": "mla_up_proj"}


def paper_cells() -> dict[tuple[str, str], float | None]:
    """The paper's T1 peaks, % of 80 GB (None: OOM), read by fp4moe.paper (the one reader of numbers.yaml)."""
    return {(c["scope"], c["recipe"]): (None if c["oom"] else float(c["peak_memory_pct"]))
            for c in paper.t1_cells(paper.load())}


@dataclass(frozen=True)
class Cell:
    """One T1 cell: the paper's % of 80 GB (None: OOM) and the model's most loaded GPU (GiB; ``pct``: % of
    ``GPU_GIB``)."""

    scope: str
    recipe: str
    recompute: str                # the recompute group that ran it
    paper_pct: float | None
    total_gib: float              # what nvidia-smi shows at the peak (allocated + outside PyTorch)
    allocated_gib: float          # torch.cuda.max_memory_allocated
    mean_gib: float               # the mean over every GPU of the job
    rank: int                     # the pipeline rank of the most loaded GPU
    in_flight: int
    parts: dict                   # GiB by component of that GPU (Breakdown.table)
    stage: str = ""               # that GPU's layout letters (t: a transformer layer)

    @property
    def pct(self) -> float:
        return 100.0 * self.total_gib / GPU_GIB

    @property
    def fits(self) -> bool:
        return self.total_gib <= GPU_GIB

    @property
    def matches_paper(self) -> bool:
        return self.fits == (self.paper_pct is not None)

    @property
    def at_edge(self) -> bool:
        """Whether the model's peak error measured on H200s (``calibration.PEAK_ERR_RANGE`` of the allocated peak,
        ``gpu_outcome``; not checked at this scale) puts the cell on either side of the GPU's memory less the memory
        outside PyTorch: the model does not decide its fit / OOM outcome."""
        return gpu_outcome(self.total_gib, self.allocated_gib, GPU_GIB) == "edge"

    @property
    def error_pp(self) -> float | None:
        """model - paper in points of the GPU's memory, where both fit."""
        return None if self.paper_pct is None or not self.fits else self.pct - self.paper_pct


# the components of a cell's GPU (Breakdown fields, GiB); the optimizer's host share is not GPU memory
PARTS = ("params", "grads", "optimizer", "optimizer_host", "fp8_weight_cache", "activations", "transient",
         "cuda_context", "nccl", "deepep", "allocator_gap")


def cells(a: MemoryAssumptions | None = None, overrides: Sequence[str] = (), recompute: dict[str, str] | None = None,
          experiment: str = EXPERIMENT, recipes: Sequence[str] = RECIPES) -> list[Cell]:
    """The cells of ``experiment`` (+ Hydra ``overrides``) under ``a`` (default ``paper_setup()``), scope by scope;
    ``recompute`` maps the paper's scopes to recompute groups (default: the experiment's sweep)."""
    a = paper_setup() if a is None else a
    paper = paper_cells()
    groups = recompute or sweep_recompute(experiment)
    out = []
    for scope in SCOPES:
        for recipe in recipes:
            cfg = experiment_cfg(experiment, f"precision={recipe}", f"recompute={groups[scope]}", *overrides)
            stages = per_stage_memory(cfg, a)
            b = max(stages, key=lambda x: x.total_bytes)
            out.append(Cell(scope, recipe, groups[scope], paper[scope, recipe], b.total_gb, b.allocated_gb,
                            mean_total_bytes(stages) / GB, b.pipeline_rank, b.in_flight,
                            {k: b.gb(k) for k in PARTS}, b.stage_letters))
    return out


# ---------------------------------------------------------------------------------------------- sensitivity

@dataclass(frozen=True)
class Variant:
    """One assumption changed: Hydra ``overrides`` of the experiment, model ``assumptions``, or ``recompute``; for
    the cells of ``recipes`` only (a precision key of one recipe)."""

    name: str
    overrides: tuple[str, ...] = ()
    assumptions: Callable[[MemoryAssumptions], MemoryAssumptions] = lambda a: a
    recompute: dict | None = None
    recipes: tuple[str, ...] = RECIPES


VARIANTS = (
    Variant("attention = megatron's core attention (conf/recompute/attn_ln_*)", recompute=CORE_ATTENTION),
    Variant("optimizer state on the GPU (optimizer=distributed_bf16_grads)", ("optimizer=distributed_bf16_grads",)),
    Variant("FP32 main grads, state on the GPU (optimizer=distributed)", ("optimizer=distributed",)),
    Variant("outside-PyTorch memory x 0.5", assumptions=lambda a: replace(a, outside_torch_scale=0.5)),
    Variant("outside-PyTorch memory x 1.5", assumptions=lambda a: replace(a, outside_torch_scale=1.5)),
    Variant("NCCL's all-to-all instead of DeepEP", assumptions=lambda a: replace(a, deepep_buffers=False)),
    Variant(SOURCE_PEERS_NAME, assumptions=lambda a: replace(a, nccl_peer_bytes=SOURCE_PEERS[0],
                                                             nccl_p2p_peer_bytes=SOURCE_PEERS[1])),
    Variant(f"{SOURCE_PEERS_NAME} and NCCL's all-to-all instead of DeepEP",
            assumptions=lambda a: replace(a, nccl_peer_bytes=SOURCE_PEERS[0], nccl_p2p_peer_bytes=SOURCE_PEERS[1],
                                          deepep_buffers=False)),
    # measured already, in another way: what a one-GPU proxy process held outside PyTorch's allocator when it went
    # OOM on an H200 (calibration.h200_memory, the largest of seven OOM messages; no NCCL peers there)
    Variant("CUDA context = the H200 proxy's OOM messages (calibration.md)",
            assumptions=lambda a: replace(a, cuda_context_bytes=round(h200_memory().non_torch_gib * GB))),
    Variant("fp4moe's MXFP4 recompute caches (our extension)", ("precision.recompute_cache_fp4=null",),
            recipes=("mxfp4",)),
    Variant("MoE-expert checkpoint keeps BF16 rows (+precision.expert_input_fp4=false)",
            ("+precision.expert_input_fp4=false",), recipes=("mxfp4",)),
    Variant("MTP layer (DeepSeek-V3 has one)", ("model.mtp_num_layers=1", "parallel.pipeline_layout='E|(tt|)*30,tmL'")),
    Variant("PP16 EP16 (the lab's ep16 layout)", LAYOUTS["ep16"]),
    Variant("PP8 EP32 (the lab's ep32 layout)", LAYOUTS["ep32"]),
    Variant("fp4moe's code instead of the lab's (all of memory.LAB_STACK off)",
            assumptions=lambda a: replace(a, **{k: False for k in LAB_STACK})),
) + tuple(Variant(f"without {label} ({name} off: fp4moe's code)",
                  assumptions=lambda a, name=name: replace(a, **{name: False})) for name, (label, _) in STACK.items())


def variant_cells(v: Variant, base: Sequence[Cell], a: MemoryAssumptions | None = None) -> list[Cell]:
    """The nine cells with ``v``'s one change to ``a`` (default ``paper_setup()``; ``base``'s cells for the recipes
    it does not apply to)."""
    a = paper_setup() if a is None else a
    changed = {(c.scope, c.recipe): c for c in cells(v.assumptions(a), v.overrides, v.recompute, recipes=v.recipes)}
    return [changed.get((c.scope, c.recipe), c) for c in base]


# ---------------------------------------------------------------------------------------------- the sister check

@dataclass(frozen=True)
class SisterCell:
    """The lab's own measurement of a DeepSeek-V3 cell ("GB" of its monitoring; None: OOM) beside the model's most
    loaded GPU (GiB)."""

    layout: str
    ac: str
    recipe: str
    measured_gb: float | None
    total_gib: float
    allocated_gib: float

    @property
    def same_outcome(self) -> bool:
        return (self.measured_gb is None) == (self.total_gib > GPU_GIB)

    def measured_gib(self, reading: str) -> float | None:
        """The measurement in GiB under one reading of the monitoring's "GB" (``SISTER_GB_READINGS``)."""
        return None if self.measured_gb is None else self.measured_gb * SISTER_GB_READINGS[reading]


def sister_check(a: MemoryAssumptions | None = None) -> list[SisterCell]:
    """The model for the sister artifact's measured cells (numbers.yaml ``sister_dsv3_memory``): the paper_t1 setup at
    that layout (``LAYOUTS``) with its recipe and recompute (``full``, or ``sel`` = attn layernorm moe_expert: the
    experiment's group for attn_ln_experts). ``a``: default ``paper_setup()``."""
    a = paper_setup() if a is None else a
    group = {"full": "full", "sel": sweep_recompute()["attn_ln_experts"]}
    out = []
    for c in paper.sister_memory_cells(paper.load()):
        cfg = experiment_cfg(EXPERIMENT, f"precision={c['recipe']}", f"recompute={group[c['ac']]}",
                             *LAYOUTS[c["layout"]])
        b = max(per_stage_memory(cfg, a), key=lambda x: x.total_bytes)
        out.append(SisterCell(c["layout"], c["ac"], c["recipe"], c["gb"], b.total_gb, b.allocated_gb))
    return out


# ---------------------------------------------------------------------------------------------- Markdown

def _pct(c: Cell) -> str:
    return f"{c.pct:.1f} %" + ("" if c.fits else " OOM")


def render(rows: Sequence[Cell], variants: Sequence[tuple[Variant, list[Cell]]] = (),
           sister: Sequence[SisterCell] = (), a: MemoryAssumptions | None = None) -> str:
    a = paper_setup() if a is None else a
    ok = sum(r.matches_paper for r in rows)
    errs = [r.error_pp for r in rows if r.error_pp is not None]
    lines = [
        "# The paper's T1 with the lab's setup: the memory model beside the paper (issue 27)", "",
        "Written by `python -m fp4moe.analysis.paper_t1`. Each cell is what `python -m fp4moe.train "
        "experiment=paper_t1` runs (conf/experiment/paper_t1.yaml and its groups name the source of every setting: "
        "the paper, its release, "
        "the sister artifact 021ai/FP8-FLOW-MOE-AE, or our assumption): DeepSeek-V3 without MTP, TP1 PP32 EP8 DP8, "
        "layout `E|(tt|)*30,tL`, micro-batch 1, global batch 15360, sequence 4096, the distributed optimizer with BF16 "
        "main grads and the optimizer state offloaded to the host, FP8 / MXFP4 on every linear, no MXFP4 recompute "
        "caches, the paper's \"attention\" read as the whole self-attention block; modelled as the lab's code runs it "
        "(megatron-core with Transformer Engine 2.8 and the paper release's patches: the section \"The lab's code, "
        "term by term\" below says which tensors that changes and where the lab's code says so).", "",
        f"**Assumption set** (`fp4moe.analysis.paper_t1.paper_setup()`): {setup_label(a)}. **model**: "
        "`fp4moe.scale.memory` "
        "for the most loaded GPU: **total** = PyTorch's allocated peak + the memory outside it (CUDA context, NCCL "
        "communicators, DeepEP's buffers, the allocator's reserved - allocated), i.e. what nvidia-smi would show, "
        f"in GiB (2^30 B) and % of the 80 GB GPU's {GPU_MIB} MiB (= {GPU_GIB:.2f} GiB, what nvidia-smi reports for "
        "an H100 / H800 80 GB; a cell fits when its total does); **allocated** = `torch.cuda.max_memory_allocated`'s "
        "peak; **mean**: the total averaged over the 256 GPUs. The model is checked against H200 runs on 1-2 GPUs "
        "(results/scale/calibration.md, allocated bytes), not at this scale. **paper**: % of 80 GB, conf/paper/"
        "numbers.yaml, read as % of the same 81559 MiB (80 GiB would lower every model % by 0.4 %, i.e. 0.3 points "
        "at 70 %; 80 x 10^9 B would raise it by 6.9 %). Nothing here is fitted to the paper.", "",
        f"Fit / OOM as in the paper: **{ok} of {len(rows)}** cells. Where both fit, model - paper: "
        + (", ".join(f"{e:+.1f}" for e in errs) + f" points (target: within {TARGET_PP:g})." if errs else "-"), "",
        "| recompute (paper) | recipe | paper | model total | allocated (GiB) | outside PyTorch (GiB) | mean over GPUs "
        "(GiB) | rank (in flight) | same outcome | model - paper (pp) |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        paper = "OOM" if r.paper_pct is None else f"{r.paper_pct:.2f} %"
        out = r.total_gib - r.allocated_gib
        err = "-" if r.error_pp is None else f"{r.error_pp:+.1f}"
        lines.append(f"| {r.scope} (`{r.recompute}`) | {r.recipe} | {paper} | {r.total_gib:.1f} GiB ({_pct(r)}) | "
                     f"{r.allocated_gib:.1f} | {out:.2f} | {r.mean_gib:.1f} | {r.rank} ({r.in_flight}) | "
                     f"{'yes' if r.matches_paper else 'no'} | {err} |")
    lines += ["", "The most loaded GPU by component (GiB, `Breakdown` fields; `optimizer_host` is the offloaded state "
              "in host memory, not in the totals):", "",
              "| recompute | recipe | " + " | ".join(PARTS) + " |", "|---|---|" + "---:|" * len(PARTS)]
    for r in rows:
        lines.append(f"| {r.scope} | {r.recipe} | " + " | ".join(f"{r.parts[k]:.2f}" for k in PARTS) + " |")
    lines += [""] + render_break_even(rows)
    if variants:
        lines += render_variants(rows, variants)
        lines += render_stack(rows, variants)
    if sister:
        lines += render_sister(sister)
    lines += ["## What it says", ""] + summary(rows, variants, sister, a) + [""]
    lines += render_gaps(rows, variants)
    return "\n".join(lines)


def render_break_even(rows: Sequence[Cell]) -> list[str]:
    """How much memory outside PyTorch would flip each cell's outcome: the GPU's memory - allocated."""
    return [f"How much memory outside PyTorch's allocated bytes each cell can take before it goes OOM ({GPU_GIB:.2f} "
            "GiB - allocated; the model's outside terms for that GPU in brackets):", "",
            "| recompute | " + " | ".join(RECIPES) + " |", "|---|" + "---:|" * len(RECIPES)] + [
        f"| {s} | " + " | ".join(f"{GPU_GIB - r.allocated_gib:.1f} ({r.total_gib - r.allocated_gib:.2f})"
                                 for r in rows if r.scope == s) + " |" for s in SCOPES] + [""]


SHORT = {"attn_ln_experts": "ale", "attn_ln_mlp": "alm", "mla_up_proj": "mla"}


def render_variants(base: Sequence[Cell], variants: Sequence[tuple[Variant, list[Cell]]]) -> list[str]:
    head = " | ".join(f"{SHORT[s]} {r}" for s in SCOPES for r in RECIPES)
    lines = ["## Sensitivity: one assumption changed at a time", "",
             "Each row changes one assumption of the base above; each cell is the change of the model's total, in "
             f"points of the GPU's {GPU_GIB:.2f} GiB (`*`: its fit / OOM outcome flips; "
             + ", ".join(f"{v} = {k}" for k, v in SHORT.items())
             + "). **outcomes**: fit / OOM as in the paper (of 9); **max |model - paper|**: over the cells both fit.",
             "",
             f"| assumption | {head} | outcomes | max \\|model - paper\\| (pp) |",
             "|---|" + "---:|" * (len(SCOPES) * len(RECIPES)) + "---:|---:|"]
    for v, rs in [(Variant("base (the table above)"), list(base))] + list(variants):
        deltas = []
        for b, r in zip(base, rs, strict=True):
            d = r.pct - b.pct
            deltas.append(f"{d:+.1f}{'*' if r.fits != b.fits else ''}")
        errs = [abs(r.error_pp) for r in rs if r.error_pp is not None]
        lines.append(f"| {v.name} | {' | '.join(deltas)} | {sum(r.matches_paper for r in rs)} | "
                     f"{max(errs):.1f} |" if errs else f"| {v.name} | {' | '.join(deltas)} | "
                     f"{sum(r.matches_paper for r in rs)} | - |")
    return lines + [""]


def _variant(variants: Sequence[tuple[Variant, list[Cell]]], suffix: str) -> list[Cell] | None:
    return next((rs for v, rs in variants if v.name.endswith(suffix)), None)


def render_stack(base: Sequence[Cell], variants: Sequence[tuple[Variant, list[Cell]]]) -> list[str]:
    """Each lab's-stack switch, its source in the lab's code, and what it adds to each cell (base - without it)."""
    lines = ["## The lab's code, term by term", "",
             "The paper's runs used megatron-core with Transformer Engine and the paper release's patches, not "
             "fp4moe's linears and experts; the model's `memory.LAB_STACK` switches say where that code keeps other "
             "tensors than fp4moe's (each off: fp4moe's code, what results/scale/calibration.md checks on the H200s). "
             "Each line: the switch, the line of the lab's code it rests on, and what it adds to each cell in points "
             "(the base above minus the base without it; ale / alm / mla, bf16 / fp8 / mxfp4).", ""]
    for name, (label, source) in STACK.items():
        rs = _variant(variants, f"({name} off: fp4moe's code)")
        if rs is None:
            continue
        eff = "; ".join(f"{SHORT[s]} " + " / ".join(f"{b.pct - r.pct:+.1f}" for b, r in zip(base, rs)
                                                     if b.scope == s) for s in SCOPES)
        lines.append(f"- `{name}`, {label}: {source}. Adds {eff}.")
    rs = _variant(variants, "(all of memory.LAB_STACK off)")
    if rs is not None:
        eff = "; ".join(f"{SHORT[s]} " + " / ".join(f"{b.pct - r.pct:+.1f}" for b, r in zip(base, rs)
                                                     if b.scope == s) for s in SCOPES)
        lines.append(f"- All of them together add {eff} (fp4moe's own code would give the sensitivity table's "
                     "row \"fp4moe's code instead of the lab's\").")
    lines += ["",
              "Checked against the lab's code and left as the model had them: the micro-batches in flight (megatron's "
              "1F1B, schedules.py forward_backward_pipelining_without_interleaving: PP - r - 1 warm-up forwards, so PP "
              "- r in flight at rank r's peak; no virtual pipeline in pretrain_ds.sh); each stage's output freed once "
              "sent (megatron's training arguments set deallocate_pipeline_outputs); the first stage holding the "
              "embedding alone and the last one layer, the final norm, the output layer and the loss (its FP32 softmax "
              "and BF16 logits [T, V], one micro-batch in flight: far below rank 3); the moe_expert checkpoint keeping "
              "the permuted dispatched rows, their probabilities and the tokens per expert (the fork's moe_layer.py); "
              "mla_up_proj's checkpoint discarding q, k and v after core attention (multi_latent_attention.py "
              "discard_output_and_register_recompute); the router saving its BF16 input (moe_utils.py "
              "RouterGatingLinearFunction)."]
    return lines + [""]


# What a measurement of the lab's stack would check for a cell the model misses (render_gaps)
MEASURE = ("The measurement that would tell, for every cell below: the lab's stack (Transformer Engine 2.8 with the "
           "release's patches, megatron's flex dispatcher on DeepEP) running one pipeline stage of two DeepSeek-V3 "
           "MoE layers at EP8 on one 8-GPU H200 node, with the cell's recipe and recompute and a few micro-batches in "
           "flight: its saved bytes per micro-batch (`torch.cuda.memory_allocated` after each forward), its backward "
           "peak above them and nvidia-smi minus `max_memory_allocated`, against the model's numbers given per cell. "
           "That needs Transformer Engine, DeepEP and the release's kernels built on the H200s (none is in fp4moe's "
           "stack); the per-micro-batch bytes of one layer, which dominate rank 3 (29 micro-batches in flight), would "
           "already separate the readings.")


def render_gaps(rows: Sequence[Cell], variants: Sequence[tuple[Variant, list[Cell]]] = ()) -> list[str]:
    """For each cell the model misses (outcome, or more than TARGET_PP points): how much the lab's most loaded GPU
    would have to hold more or less, per transformer layer and micro-batch in flight, and what would tell."""
    miss = [r for r in rows if not r.matches_paper or (r.error_pp is not None and abs(r.error_pp) > TARGET_PP)]
    if not miss:
        return []
    cell = {(r.scope, r.recipe): r for r in rows}
    lines = ["## What would have to be true for the cells the model misses", "",
             "For each cell off target: the difference in GiB on the model's most loaded GPU, spread over its "
             "transformer layers x micro-batches in flight (what it would be if it were activations), what the lab's "
             "code and its own measurements say, and the model's numbers a measurement would check. " + MEASURE, ""]
    for r in miss:
        layers = max(1, r.stage.count("t"))
        per_mb = 1024 * r.parts["activations"] / max(1, r.in_flight)
        m = (f"The model's numbers to measure against: {per_mb:.0f} MiB saved per micro-batch, "
             f"{r.parts['transient']:.2f} GiB backward peak above them, {r.total_gib - r.allocated_gib:.1f} GiB "
             "outside PyTorch.")
        if r.paper_pct is None:
            need = GPU_GIB - r.total_gib
            what = (f"the model leaves {need:.1f} GiB free on pipeline rank {r.rank}; the paper's OOM needs at least "
                    f"that much more ({1024 * need / (layers * r.in_flight):.0f} MiB per layer and micro-batch over "
                    f"{layers} layers x {r.in_flight} in flight)")
        elif not r.fits:
            need = r.total_gib - GPU_GIB
            what = f"the model is {need:.1f} GiB over the GPU on pipeline rank {r.rank}; the paper's run fitted"
        else:
            d = (r.paper_pct - r.pct) / 100 * GPU_GIB
            what = (f"the lab's most loaded GPU would hold {abs(d):.1f} GiB {'more' if d > 0 else 'less'} than the "
                    f"model's (pipeline rank {r.rank}: {1024 * abs(d) / (layers * r.in_flight):.0f} MiB per layer and "
                    f"micro-batch over {layers} layers x {r.in_flight} in flight)")
        note = GAP_NOTES[r.scope, r.recipe](cell, variants) if (r.scope, r.recipe) in GAP_NOTES else ""
        lines.append(f"- **{r.scope} {r.recipe}** (paper {'OOM' if r.paper_pct is None else f'{r.paper_pct:.2f} %'}, "
                     f"model {_pct(r)}): {what}. {note}{' ' if note else ''}{m}")
    return lines + [""]


def _per_layer_mib(gib: float, c: Cell) -> float:
    """``gib`` spread over the cell's GPU's transformer layers x micro-batches in flight, MiB."""
    return 1024 * gib / (max(1, c.stage.count("t")) * max(1, c.in_flight))


def _note_ale_bf16(cell, variants) -> str:
    return ("The lab's own runs of this nominal setup (sister artifact, sel PP32 EP8, the table above) measured more "
            "than the model, not less: the paper's runs must have held less than the lab's FP8-Flow-MoE runs "
            "(another code base, the release's megatron 0.15.0rc7 against the FP8-Flow-MoE fork; what its `attn` "
            "module recomputes, which neither names), or less outside PyTorch than the model carries "
            f"({cell['attn_ln_experts', 'bf16'].total_gib - cell['attn_ln_experts', 'bf16'].allocated_gib:.1f} GiB, "
            "measured on fp4moe's H200 process).")


def _note_ale_fp8(cell, variants) -> str:
    b, f = cell["attn_ln_experts", "bf16"], cell["attn_ln_experts", "fp8"]
    return (f"As for bf16, the lab's own sel PP32 EP8 fp8 run measured more than the model. The model's fp8 - bf16 "
            f"here is {f.total_gib - b.total_gib:.1f} GiB, of which {f.parts['fp8_weight_cache']:.1f} GiB are TE's FP8 "
            f"weight copies; the paper's {f.paper_pct - b.paper_pct:.1f} points are "
            f"{(f.paper_pct - b.paper_pct) / 100 * GPU_GIB:.1f} GiB.")


def _note_ale_mxfp4(cell, variants) -> str:
    b, m = cell["attn_ln_experts", "bf16"], cell["attn_ln_experts", "mxfp4"]
    return (f"The model's MXFP4 saves {b.pct - m.pct:.1f} points against BF16 at this scope, the paper's "
            f"{b.paper_pct - m.paper_pct:.1f}: mostly the moe_expert checkpoint's dispatched rows (MXFP4, 0.53 "
            "B/element, against BF16's 2), less the FP8 weight copies bf16 does not have. Either the paper's MXFP4 run "
            "held more per layer than the release's code shows (its TE patch permutes the MXFP4Tensor and the "
            "checkpoint keeps it), or its BF16 run less (the bf16 line above).")


def _note_alm_bf16(cell, variants) -> str:
    return ("At the edge: the outside-PyTorch terms x 1.5 (sensitivity table) would flip it, and the lab's own "
            "measurements of this setup sit above the model by more than that in every fitting cell (the table "
            "above).")


def _note_alm_fp8(cell, variants) -> str:
    rs = _variant(variants, "(fp8_saves_columnwise off: fp4moe's code)")
    c = {(r.scope, r.recipe): r for r in rs}["attn_ln_mlp", "fp8"] if rs else None
    with_rows = f" ({_pct(c)})" if c is not None else ""
    return ("TE's FP8 experts save the column-wise copy of their inputs only (`fp8_saves_columnwise`, above); with "
            f"rows and columns, as fp4moe saves them, this cell would be OOM{with_rows}: the paper's OOM fits a stack "
            "that kept both copies of the experts' FP8 inputs, which the lab's TE code does not.")


def _note_mla_mxfp4(cell, variants) -> str:
    a, m = cell["attn_ln_mlp", "mxfp4"], cell["mla_up_proj", "mxfp4"]
    extra = 1024 * (m.parts["activations"] / m.in_flight - a.parts["activations"] / a.in_flight) / max(
        1, m.stage.count("t"))
    paper_extra = _per_layer_mib((m.paper_pct - a.paper_pct) / 100 * GPU_GIB, m)
    return (f"Per MoE layer and micro-batch the model keeps {extra:.0f} MiB more under mla_up_proj than under "
            "attn_ln_mlp (both keep the experts' MXFP4 tensors): flash attention's output [T, 128 x 128] BF16 (128 "
            "MiB), the output projection's, q_down's and kv_down's MXFP4 copies, the q / kv latents the checkpoint "
            "holds and the router's BF16 input [T, H]. The paper's two cells differ by "
            f"{m.paper_pct - a.paper_pct:.1f} points, {paper_extra:.0f} MiB per layer and micro-batch on the same "
            "GPU: about the attention output alone.")


# What the lab's code and the lab's own measurements say about each cell the model may miss (render_gaps):
# (scope, recipe) -> f(cells by (scope, recipe), variants) -> text
GAP_NOTES = {
    ("attn_ln_experts", "bf16"): _note_ale_bf16,
    ("attn_ln_experts", "fp8"): _note_ale_fp8,
    ("attn_ln_experts", "mxfp4"): _note_ale_mxfp4,
    ("attn_ln_mlp", "bf16"): _note_alm_bf16,
    ("attn_ln_mlp", "fp8"): _note_alm_fp8,
    ("mla_up_proj", "mxfp4"): _note_mla_mxfp4,
}


def render_sister(sister: Sequence[SisterCell]) -> list[str]:
    lines = ["## Against the lab's own measurements of this setup (not the paper's numbers)", "",
             "The sister artifact measured DeepSeek-V3 with this batch and optimizer at its three layouts (conf/paper/"
             "numbers.yaml `sister_dsv3_memory`: \"GB\" per GPU from the cluster's GPU monitoring, which does not say "
             "whether its GB are 2^30 or 10^9 B, so the difference is given in GiB under both readings; `sel` = attn "
             "layernorm moe_expert, `full` = full recompute; fp8 = its blockwise FP8). The model for the same cells:",
             "", "| layout | recompute | recipe | measured (GB) | model total (GiB) | model allocated (GiB) | "
             "measured - model (GiB), GB = GiB | measured - model (GiB), GB = 10^9 B | same outcome |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for s in sister:
        meas = "OOM" if s.measured_gb is None else f"{s.measured_gb:g}"
        diffs = ["-" if s.measured_gb is None else f"{s.measured_gib(k) - s.total_gib:+.1f}"
                 for k in SISTER_GB_READINGS]
        lines.append(f"| {s.layout} | {s.ac} | {s.recipe} | {meas} | {s.total_gib:.1f} | {s.allocated_gib:.1f} | "
                     f"{' | '.join(diffs)} | {'yes' if s.same_outcome else 'no'} |")
    return lines + [""]


def summary(rows: Sequence[Cell], variants: Sequence[tuple[Variant, list[Cell]]] = (),
            sister: Sequence[SisterCell] = (), a: MemoryAssumptions | None = None) -> list[str]:
    """What the tables say, computed from them (``a``: the assumption set of ``rows``, default ``paper_setup()``)."""
    a = paper_setup() if a is None else a
    ok = sum(r.matches_paper for r in rows)
    miss = [f"{r.scope} {r.recipe} (paper {'OOM' if r.paper_pct is None else f'{r.paper_pct:.2f} %'}, model "
            f"{_pct(r)})" for r in rows if not r.matches_paper]
    out = [f"- Fit / OOM: {ok} of {len(rows)} as in the paper" + (f"; not {'; '.join(miss)}." if miss else ".")]
    edge = [r for r in rows if r.at_edge]
    if edge:
        lo, hi = (100 * e for e in PEAK_ERR_RANGE)
        out.append("- At the edge: " + "; ".join(
            f"{r.scope} {r.recipe} ({_pct(r)}, paper {'OOM' if r.paper_pct is None else f'{r.paper_pct:.2f} %'})"
            for r in edge) + f" lies within the model's peak error measured on H200s ({lo:+.1f} % to {hi:+.1f} % of "
            "the allocated peak, the calibration's rule for an undecided cell) of the GPU's memory, so the model "
            "does not decide its outcome (the dry run warns of such a cell); that error is not checked at this "
            "scale.")
    far = [r for r in rows if r.error_pp is not None and abs(r.error_pp) > TARGET_PP]
    near = [r for r in rows if r.error_pp is not None and abs(r.error_pp) <= TARGET_PP]
    if near:
        out.append(f"- Within {TARGET_PP:g} points of the paper: " + "; ".join(
            f"{r.scope} {r.recipe} {r.error_pp:+.1f}" for r in near) + ".")
    if far:
        out.append(f"- Further than {TARGET_PP:g} points: " + "; ".join(
            f"{r.scope} {r.recipe} {r.error_pp:+.1f}" for r in far) + ".")
    cell = {(r.scope, r.recipe): r for r in rows}
    b, m = cell["attn_ln_experts", "bf16"], cell["attn_ln_experts", "mxfp4"]
    if b.paper_pct is not None and m.paper_pct is not None:
        out.append(f"- At attn_ln_experts the model's MXFP4 saves {b.pct - m.pct:.1f} points against BF16, the "
                   f"paper's {b.paper_pct - m.paper_pct:.1f}: the MXFP4 cells' misses are the activations, not a "
                   "constant offset (an offset outside PyTorch moves every cell alike).")
    own = _variant(variants, "(all of memory.LAB_STACK off)")
    if own is not None:
        flips = [f"{b.scope} {b.recipe} ({_pct(o)} with fp4moe's code)" for b, o in zip(rows, own) if b.fits != o.fits]
        errs = [abs(o.error_pp) for o in own if o.error_pp is not None]
        out.append(f"- The lab's code against fp4moe's own (the sensitivity row with every `memory.LAB_STACK` switch "
                   f"off): {sum(o.matches_paper for o in own)} of {len(own)} outcomes as the paper with fp4moe's, "
                   f"max |model - paper| {max(errs):.1f} points; the lab's code changes the outcome of "
                   + ("; ".join(flips) if flips else "no cell")
                   + ". The switches follow the lab's code, not the paper's numbers: where they move a cell away from "
                   "the paper, the section below says what would have to be true.")
    for v, rs in variants:
        if v.overrides[:1] == ("+precision.expert_input_fp4=false",):
            c = {(r.scope, r.recipe): r for r in rs}["attn_ln_experts", "mxfp4"]
            out.append(f"- If the MoE-expert checkpoint kept its dispatched rows in BF16 (the MXFP4 dispatch "
                       f"dequantized before it), mxfp4 at attn_ln_experts would be {c.pct:.1f} % (paper "
                       f"{c.paper_pct:.2f} %). The paper's release keeps them MXFP4 (its TE patch permutes "
                       "MXFP4Tensors and checkpoints them), so this is a what-if, not the base.")
    peers = _variant(variants, SOURCE_PEERS_NAME)
    if peers is not None and not (a.nccl_peer_bytes or a.nccl_p2p_peer_bytes):
        flips = [f"{b.scope} {b.recipe} ({_pct(o)})" for b, o in zip(rows, peers) if b.fits != o.fits]
        moves = sorted({round(100 * (o.total_gib - b.total_gib) / GPU_GIB, 1) for b, o in zip(rows, peers)})
        errs = [abs(o.error_pp) for o in peers if o.error_pp is not None]
        move = f"{moves[0]:.1f}" if len(moves) == 1 else f"{moves[0]:.1f} to {moves[-1]:.1f}"
        out.append(f"- NCCL's per-peer buffers are not measured (that needs two GPUs; none lent since the measuring "
                   f"tool was written): 0 in the base. As NCCL 2.28.9's source implies them under the lab's "
                   f"`NCCL_MIN_NCHANNELS=32` (the sensitivity row; NVLink connections everywhere, a first-order "
                   f"reading: fp4moe.scale.outside_torch says what it leaves out), they add {move} points to every "
                   f"cell: {sum(o.matches_paper for o in peers)} of {len(peers)} outcomes as the paper"
                   + (f", the outcome changing for {'; '.join(flips)}" if flips else "")
                   + (f"; max |model - paper| {max(errs):.1f} points" if errs else "")
                   + ". `tools/device/measure_outside_torch.py` on two GPUs measures them.")
    if a.outside_torch_source == NOT_MEASURED:
        out.append("- The CUDA context, NCCL buffers and the allocator's gap are not measured yet (0 here): each cell "
                   "would move up by their sum; the break-even table says how much each cell can take. The H200 "
                   f"proxy's OOM messages put one training process's memory outside PyTorch's allocator at "
                   f"{h200_memory().non_torch_gib:.2f} GiB (one GPU, no NCCL peers): the sensitivity table's row with "
                   "it.")
    if sister:
        same = sum(s.same_outcome for s in sister)
        spans = []
        for k in SISTER_GB_READINGS:
            gaps = [s.measured_gib(k) - s.total_gib for s in sister if s.measured_gb is not None]
            spans.append(f"{min(gaps):+.1f} to {max(gaps):+.1f} GiB if its GB are {k}")
        out.append(f"- The lab's own measurements of this setup: {same} of {len(sister)} fit / OOM outcomes as the "
                   f"model's; where they fit, the measured peak is {' and '.join(spans)} above the model's total.")
        ep8 = {(s.ac, s.recipe): s for s in sister if s.layout == "ep8" and s.measured_gb is not None}
        pairs = [(r, ep8.get(("sel", r.recipe))) for r in rows if r.scope == "attn_ln_experts" and r.paper_pct]
        pairs = [(r, s) for r, s in pairs if s is not None]
        if pairs:
            pct = {k: ", ".join(f"{r.recipe} {100 * s.measured_gib(k) / GPU_GIB:.1f} %" for r, s in pairs)
                   for k in SISTER_GB_READINGS}
            out.append("- The lab measured the paper's attn_ln_experts setup itself (sel, PP32 EP8): "
                       + " or ".join(f"{v} (GB = {k})" for k, v in pct.items())
                       + " of the GPU, against the paper's " + ", ".join(f"{r.recipe} {r.paper_pct:.2f} %"
                                                                        for r, _ in pairs)
                       + ": under either reading the paper's runs held less than the lab's own runs of the same "
                       "setup, so a model that met those would overshoot the paper's cells.")
    return out


def document() -> str:
    """results/scale/paper_t1.md's text."""
    base = cells()
    return render(base, [(v, variant_cells(v, base)) for v in VARIANTS], sister_check())


def main(argv: Sequence[str] | None = None) -> int:
    return markdown_cli(argv, __doc__, "paper_t1", document)


if __name__ == "__main__":
    raise SystemExit(main())
