"""The paper's T1 cells predicted by the memory model under the gradient / optimizer setups a megatron-core user can
pick (issue 6, P5), beside the paper's numbers: which setup reproduces the paper's fit / OOM pattern?

    python -m fp4moe.scale.paper_t1 [--out results/scale/paper_t1.md]

Layout: ``conf/parallel/paper_671b.yaml`` (our reading of the paper: TP1 PP32 EP8 DP8, micro-batch 1, seq 4096,
the distributed optimizer; the paper does not state it), model ``dsv3_671b``. For each setup and cell: the most
loaded pipeline rank's predicted peak (``memory.per_gpu_memory``, what the report shows) and the last rank's (one
micro-batch in flight under 1F1B), in GiB and in % of 80 GiB as the report gives them; the paper's % of 80 GB
(``conf/paper/numbers.yaml``, secondary summaries of the full text). Arithmetic only, no torch; nothing is fitted
to the paper. The model itself is checked against H200 runs on 1-2 GPUs (results/scale/calibration.md), not at this
scale.

Then the readings of what the paper does not state (``readings``): the three EP x PP layouts the same lab ran
DeepSeek-V3 with on that cluster, what the scopes' "attention" recomputes (megatron's core attention, or the whole
self-attention block), and the three setups. A reading is *consistent* with the paper when one usable capacity C
(the part of the 80 GiB left for the model's tensors once the CUDA context, communication buffers and fragmentation
have theirs) separates the nine cells as the paper does: every cell the paper fits at or below C, every cell it
reports OOM above, i.e. max(the paper's fitting cells) < C <= min(its OOM cells) in the model.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from .memory import MemoryAssumptions, compose_cfg, per_gpu_memory, per_stage_memory

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_OUT = "results/scale/paper_t1.md"
GPU_GB = 80.0
SCOPES = ("attn_ln_experts", "attn_ln_mlp", "mla_up_proj")
RECIPES = ("bf16", "fp8", "mxfp4")
# name -> the model's assumptions; megatron-core's options they stand for
SETUPS = {
    "FP32 main grads + distributed optimizer (megatron-core's default)": MemoryAssumptions(),
    "BF16 main grads (precision-aware optimizer)": MemoryAssumptions(grad_bytes=2),
    "BF16 main grads + optimizer states offloaded to the host": MemoryAssumptions(grad_bytes=2,
                                                                                  optimizer_offload=True),
}


# The EP x PP layouts of the same lab's DeepSeek-V3 runs on the 256-GPU cluster (shared notes/paper-details.md
# §1.2: EP8 / PP32, "EP16/PP16 and EP32/PP8 also tried"; TP1, so DP = 256 / PP and EP inside DP). PP32 is
# conf/parallel/paper_671b.yaml; the PP16 / PP8 stage layouts are ours, built the same way (the first stage has
# the embedding and one layer fewer, the last the MTP layer and the loss and two layers fewer; 61 layers in all).
LAYOUTS = {
    "PP32 EP8": {},
    "PP16 EP16": {"pipeline": 16, "expert": 16, "data": 16, "pipeline_layout": "Ettt|(tttt|)*14,ttmL"},
    "PP8 EP32": {"pipeline": 8, "expert": 32, "data": 32, "pipeline_layout": "Ettttttt|(tttttttt|)*6,ttttttmL"},
}
ATTENTION = {"core attention": "core_attn", "whole self-attention": "self_attention"}


def layout_cfg(layout: str, scope: str, recipe: str):
    """The paper_671b config with ``LAYOUTS[layout]``'s parallel overrides."""
    cfg = compose_cfg("dsv3_671b", "paper_671b", scope, recipe)
    for key, value in LAYOUTS[layout].items():
        cfg.parallel[key] = value
    return cfg


@dataclass(frozen=True)
class Reading:
    """One reading of what the paper does not state, against the paper's nine cells (model % of 80 GiB, the most
    loaded pipeline rank). ``window``: the usable capacities C (% of 80 GiB) that separate the cells as the paper
    does, ``(lo, hi]``, empty when lo >= hi; ``errors``: model - paper on the cells the paper fits, in points."""

    layout: str
    attention: str
    setup: str
    window: tuple[float, float]
    errors: tuple[float, ...]

    @property
    def consistent(self) -> bool:
        return self.window[0] < self.window[1]


def reading(pcts: dict[tuple[str, str], float], paper: dict[tuple[str, str], float | None], layout: str = "",
            attention: str = "", setup: str = "") -> Reading:
    """A Reading from the model's % per (scope, recipe) and the paper's (None: OOM)."""
    fit = [pcts[k] for k, v in paper.items() if v is not None]
    oom = [pcts[k] for k, v in paper.items() if v is None]
    lo = max(fit) if fit else 0.0
    hi = min(oom) if oom else float("inf")
    return Reading(layout, attention, setup, (lo, hi), tuple(pcts[k] - v for k, v in paper.items() if v is not None))


def readings(setups: dict[str, MemoryAssumptions] = SETUPS) -> list[Reading]:
    paper = paper_cells()
    out = []
    for layout in LAYOUTS:
        for attention, attn in ATTENTION.items():
            for name, a in setups.items():
                a = replace(a, attn_recompute=attn)
                pcts = {k: 100.0 * per_gpu_memory(layout_cfg(layout, *k), a).total_gb / GPU_GB for k in paper}
                out.append(reading(pcts, paper, layout, attention, name))
    return out


@dataclass(frozen=True)
class Cell:
    setup: str
    scope: str
    recipe: str
    paper_pct: float | None      # % of 80 GB; None: OOM in the paper
    peak_gib: float              # the most loaded pipeline rank
    peak_rank: int
    in_flight: int               # micro-batches whose activations that rank holds (1F1B)
    last_rank_gib: float         # the last pipeline rank (1 micro-batch in flight)

    @property
    def pct(self) -> float:
        return 100.0 * self.peak_gib / GPU_GB

    @property
    def fits(self) -> bool:
        return self.peak_gib <= GPU_GB

    @property
    def matches_paper(self) -> bool:
        """The same outcome as the paper's: fits where the paper fits, OOM where it went OOM."""
        return self.fits == (self.paper_pct is not None)


def paper_cells() -> dict[tuple[str, str], float | None]:
    """The paper's T1 peaks, % of 80 GB (None: OOM), read by fp4moe.report.paper, the one reader of numbers.yaml
    (torch-free, light)."""
    from fp4moe.report.paper import load, t1_cells

    return {(c["scope"], c["recipe"]): (None if c["oom"] else float(c["peak_memory_pct"])) for c in t1_cells(load())}


def cells(setups: dict[str, MemoryAssumptions] = SETUPS) -> list[Cell]:
    paper = paper_cells()
    out = []
    for name, a in setups.items():
        for scope in SCOPES:
            for recipe in RECIPES:
                cfg = compose_cfg("dsv3_671b", "paper_671b", scope, recipe)
                b = per_gpu_memory(cfg, a)
                out.append(Cell(name, scope, recipe, paper[scope, recipe], b.total_gb, b.pipeline_rank, b.in_flight,
                                per_stage_memory(cfg, a)[-1].total_gb))
    return out


def render(rows: Sequence[Cell], reads: Sequence[Reading] = ()) -> str:
    lines = ["# The paper's T1 cells under three gradient / optimizer setups (issue 6, P5)", "",
             "Written by `python -m fp4moe.scale.paper_t1`. Model `dsv3_671b`, layout `paper_671b` (TP1 PP32 EP8 DP8, "
             "micro-batch 1, seq 4096, distributed optimizer: our reading, the paper does not state it). **model**: "
             "`fp4moe.scale.memory`, the most loaded pipeline rank (as the report shows it) and the last rank "
             "(one micro-batch in flight), GiB and % of 80 GiB; checked against H200 runs on 1-2 GPUs "
             "(results/scale/calibration.md), not at this scale. **paper**: % of 80 GB, `conf/paper/numbers.yaml` "
             "(secondary summaries of the full text). Nothing here is fitted to the paper.", ""]
    for name in dict.fromkeys(r.setup for r in rows):
        sub = [r for r in rows if r.setup == name]
        ok = sum(r.matches_paper for r in sub)
        lines += [f"## {name}", "",
                  f"Fit / OOM as in the paper: {ok} of {len(sub)} cells.", "",
                  "| recompute | recipe | paper | model, most loaded rank | rank | model, last rank | same outcome |",
                  "|---|---|---|---|---|---|---|"]
        for r in sub:
            paper = "OOM" if r.paper_pct is None else f"{r.paper_pct:.2f} %"
            model = f"{r.peak_gib:.1f} GiB ({r.pct:.1f} %)" + ("" if r.fits else ", OOM")
            last = f"{r.last_rank_gib:.1f} GiB ({100 * r.last_rank_gib / GPU_GB:.1f} %)"
            lines.append(f"| {r.scope} | {r.recipe} | {paper} | {model} | {r.peak_rank} | {last} | "
                         f"{'yes' if r.matches_paper else 'no'} |")
        lines.append("")
    if reads:
        lines += render_readings(reads)
    lines += ["## What it says", ""] + summary(rows) + readings_summary(reads) + [""]
    return "\n".join(lines)


def _window(w: tuple[float, float]) -> str:
    hi = "-" if w[1] == float("inf") else f"{w[1]:.1f}"
    return f"({w[0]:.1f}, {hi}]"


def render_readings(reads: Sequence[Reading]) -> list[str]:
    lines = ["## Which readings are consistent with the paper's fit / OOM pattern", "",
             "Layouts: the three EP x PP layouts the same lab ran DeepSeek-V3 with on that cluster (TP1, DP = 256 / "
             "PP; PP16 and PP8 stage layouts are ours: `paper_t1.LAYOUTS`). Attention: what the scopes' "
             "\"attention\" recomputes, megatron's core attention (conf/recompute, the trainer) or the whole "
             "self-attention block (`MemoryAssumptions.attn_recompute`). **capacity window**: the usable capacities "
             "C, in % of 80 GiB, under which the model fits exactly the cells the paper fits (max over its "
             "fitting cells < C <= min over its OOM cells); empty: no C does. **model - paper**: on the five cells "
             "the paper fits, in points of 80 GiB.", "",
             "| layout | attention | setup | capacity window (% of 80 GiB) | consistent | model - paper (pp) |",
             "|---|---|---|---|---|---|"]
    for r in reads:
        err = f"{min(r.errors):+.1f} to {max(r.errors):+.1f}" if r.errors else "-"
        lines.append(f"| {r.layout} | {r.attention} | {r.setup} | {_window(r.window)} | "
                     f"{'yes' if r.consistent else 'no'} | {err} |")
    return lines + [""]


def readings_summary(reads: Sequence[Reading]) -> list[str]:
    """Which attention readings admit a consistent capacity at all, and which consistent readings need no more than
    the 80 GiB the GPU has (computed)."""
    if not reads:
        return []
    by = {a: [r.consistent for r in reads if r.attention == a] for a in dict.fromkeys(r.attention for r in reads)}
    out = [f"- With {attention} recomputed, {sum(ok)} of {len(ok)} readings (layout x setup) are consistent with the "
           "paper's fit / OOM pattern." for attention, ok in by.items()]
    if not any(by.get("core attention", [True])) and all(by.get("whole self-attention", [False])):
        out.append("- So only the whole-block reading orders the nine cells as the paper does, in every layout and "
                   "setup: the paper's \"attention\" most likely recomputes the whole self-attention block (the "
                   "FP8-Flow-MoE fork's `attn` module), not core attention (conf/recompute/attn_ln_*.yaml; the "
                   "trainer runs the whole block with conf/recompute/attn_block_*.yaml). With core attention, a cell "
                   "the paper fits needs at least as much memory in the model as a cell it reports OOM, whatever the "
                   "layout and setup.")
    real = [r for r in reads if r.consistent and r.window[0] < 100.0]
    if real:
        out.append("- Consistent with a usable capacity below 80 GiB: " + "; ".join(
            f"{r.layout}, {r.attention}, {r.setup}: C in {_window(r.window)} %, model - paper "
            f"{min(r.errors):+.1f} to {max(r.errors):+.1f} pp" for r in real) + ".")
    else:
        out.append("- No reading is consistent with a usable capacity below 80 GiB.")
    return out


def summary(rows: Sequence[Cell]) -> list[str]:
    """The closest setup, where it differs from the paper, and model vs paper where both fit (computed)."""
    names = list(dict.fromkeys(r.setup for r in rows))
    score = {n: sum(r.matches_paper for r in rows if r.setup == n) for n in names}
    best = max(names, key=lambda n: score[n])
    sub = [r for r in rows if r.setup == best]
    miss = [f"{r.scope} {r.recipe} (paper {'OOM' if r.paper_pct is None else f'{r.paper_pct:.1f} %'}, model "
            f"{r.pct:.1f} %)" for r in sub if not r.matches_paper]
    both = [f"{r.scope} {r.recipe} {r.pct:.1f} % vs {r.paper_pct:.1f} %" for r in sub
            if r.fits and r.paper_pct is not None]
    heavy = [r for r in rows if r.recipe in ("bf16", "fp8") and r.scope == "attn_ln_experts"]
    out = [f"- Closest: **{best}**, {score[best]} of {len(sub)} cells with the paper's outcome"
           + (f"; it differs in {'; '.join(miss)}." if miss else ".")]
    if both:
        out.append(f"- Where the model and the paper both fit (model vs paper, % of 80): {'; '.join(both)}.")
    if heavy and not any(r.fits for r in heavy):
        flight = sorted({r.in_flight for r in heavy})
        out.append(f"- bf16 and fp8 at attn_ln_experts stay above 80 GiB in every setup: the most loaded rank holds "
                   f"{', '.join(map(str, flight))} micro-batches' activations under 1F1B in this layout. The paper "
                   "fits them, so its run held fewer activations per GPU than this layout gives (another layout, "
                   "recompute or micro-batch schedule, or another rank reported): the open question of issue 6.")
    return out


def write_markdown_cli(argv: Sequence[str] | None, doc: str, default_out: str, text: Callable[[], str]) -> int:
    """The ``--out`` command line of a module that writes one Markdown file: ``text()`` written atomically (a .tmp
    beside the target, then renamed), the path relative to the repository root unless absolute."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=default_out, help="Markdown file to write (relative to the repository root)")
    args = ap.parse_args(argv)
    out = ROOT / args.out  # an absolute path stays as it is
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(text())
    tmp.replace(out)
    print(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return write_markdown_cli(argv, __doc__, DEFAULT_OUT, lambda: render(cells(), readings()))


if __name__ == "__main__":
    raise SystemExit(main())
