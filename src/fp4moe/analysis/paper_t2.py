"""The paper's T2, the DeepSeek-V2 236B peak-memory ablation by FP4 scope, predicted by the memory model with the
same assumptions as T1 (issue 27, part C), beside the paper's numbers.

    python -m fp4moe.analysis.paper_t2 [--out FILE]     # results/scale/paper_t2.md (results/manifest.yaml)

Paper (conf/paper/numbers.yaml t2, secondary summaries of the full text): MXFP4 on the MLP and shared experts -6.9 %
peak memory against FP8, on all of the MoE (routed experts too) -7.2 %, both -11 % against BF16; whether these are
relative changes or points of 80 GB is not known, so both are computed. Each cell is what ``python -m fp4moe.train
experiment=paper_t2`` runs (the lab's DeepSeek-V2 layout and optimizer: conf/experiment/paper_t2.yaml), under
``paper_t1.paper_setup()``. The paper gives no recompute scope: the config's (T1's heaviest) is the base row, every
other scope and the core-attention reading are rows too. Peaks are the most loaded GPU's total (what nvidia-smi
would show). Arithmetic only, no torch; nothing is fitted to the paper.

``mxfp4_mlp_shared`` is what ``fp4moe.recipe.Recipe`` can say of the paper's first row (conf/precision/
mxfp4_mlp_shared.yaml): the routed experts get BF16 dispatch and FP8 inputs, but the FP4 storage of saved inputs and
of the SwiGLU input still covers them, so the model separates the two rows only where the experts' recompute
checkpoint keeps their dispatched rows (MXFP4 under mxfp4, BF16 under mxfp4_mlp_shared).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .. import paper
from ..scale.memory import GB, MemoryAssumptions, experiment_cfg, per_stage_memory
from .output import markdown_cli
from .paper_t1 import GPU_GIB, paper_cells, paper_setup, setup_label

EXPERIMENT = "paper_t2"
RECIPES = ("bf16", "fp8", "mxfp4_mlp_shared", "mxfp4")
# the paper's rows: its label -> our precision config
ROWS = {"mlp_and_shared_experts": "mxfp4_mlp_shared", "all_moe": "mxfp4"}
# (recompute group, attention reading) per row; the first is the experiment's own (conf/experiment/paper_t2.yaml)
SCOPES = (("attn_block_ln_experts", "whole block"), ("attn_ln_experts", "core"), ("attn_block_ln_mlp", "whole block"),
          ("attn_ln_mlp", "core"), ("mla_up_proj", ""), ("full", ""), ("none", ""))


def paper_rows() -> dict[str, tuple[float, float]]:
    """{our precision: (change vs FP8 %, change vs BF16 %)} of the paper's T2, read by fp4moe.paper."""
    return {ROWS[r["row"]]: (r["vs_fp8_pct"], r["vs_bf16_pct"]) for r in paper.t2_rows(paper.load())}


@dataclass(frozen=True)
class Row:
    """One recompute scope: the four recipes' peaks (GiB, the most loaded GPU's total)."""

    scope: str
    attention: str          # '' where the scope recomputes no attention
    peak_gib: dict

    def change(self, recipe: str, ref: str, points: bool = False) -> float:
        """``recipe``'s peak against ``ref``'s: relative % or (``points``) points of the 80 GB GPU (``GPU_GIB``)."""
        a, b = self.peak_gib[recipe], self.peak_gib[ref]
        return 100.0 * (a - b) / GPU_GIB if points else 100.0 * (a / b - 1.0)

    def distance(self, paper: dict[str, tuple[float, float]], points: bool = False) -> float:
        """Largest |model - paper| over the paper's four numbers (in the unit the reading takes them in)."""
        return max(max(abs(self.change(rec, "fp8", points) - p8), abs(self.change(rec, "bf16", points) - p16))
                   for rec, (p8, p16) in paper.items())


def rows(a: MemoryAssumptions | None = None) -> list[Row]:
    """One Row per scope of ``SCOPES`` under ``a`` (default ``paper_setup()``)."""
    a = paper_setup() if a is None else a
    out = []
    for scope, attention in SCOPES:
        peaks = {}
        for rec in RECIPES:
            stages = per_stage_memory(experiment_cfg(EXPERIMENT, f"precision={rec}", f"recompute={scope}"), a)
            peaks[rec] = max(b.total_bytes for b in stages) / GB
        out.append(Row(scope, attention, peaks))
    return out


def render(rs: Sequence[Row], a: MemoryAssumptions | None = None) -> str:
    a = paper_setup() if a is None else a
    paper = paper_rows()
    p = {rec: f"{v[0]:+.1f} / {v[1]:+.1f}" for rec, v in paper.items()}
    lines = ["# The paper's T2: the 236B peak-memory ablation by FP4 scope (issue 27)", "",
             "Written by `python -m fp4moe.analysis.paper_t2`. Each cell is what `python -m fp4moe.train "
             "experiment=paper_t2` runs: DeepSeek-V2 236B with the lab's layout (sister artifact: TP1 PP16 EP8 DP16, 2 "
             "layers on the first and the last stage, micro-batch 1, global batch 8192, sequence 4096) and T1's "
             "optimizer and precision settings (offloaded optimizer with BF16 main grads, FP8 / MXFP4 on every linear, "
             f"no MXFP4 recompute caches). **Assumption set**: T1's, {setup_label(a, EXPERIMENT)}. The paper gives no "
             "recompute scope: the first row is the config's (T1's heaviest, the whole-block reading), the others are "
             "the alternatives. **model**: `fp4moe.scale.memory`, the most loaded GPU's total (allocated + outside "
             "PyTorch), GiB; checked against H200 runs on 1-2 GPUs, not at this scale. **paper**: conf/paper/"
             f"numbers.yaml (secondary summaries): MXFP4 on MLP + shared experts {p['mxfp4_mlp_shared']} % vs FP8 / "
             f"BF16, on all MoE {p['mxfp4']} %; whether relative or points of 80 GB is not known, so both are given. "
             "`mxfp4_mlp_shared` differs from `mxfp4` only in the routed experts' dispatch and FP8 inputs "
             "(conf/precision/mxfp4_mlp_shared.yaml). Nothing here is fitted to the paper.", "",
             "| recompute | attention | peak GiB bf16 / fp8 / mxfp4_mlp_shared / mxfp4 | MLP + shared vs FP8, rel. % / "
             "pp | all MoE vs FP8, rel. % / pp | all MoE vs BF16, rel. % / pp | fp8 / bf16 peak |",
             "|---|---|---|---|---|---|---:|"]
    for r in rs:
        pk = " / ".join(f"{r.peak_gib[rec]:.1f}" for rec in RECIPES)
        ch = [f"{r.change(rec, ref):+.1f} / {r.change(rec, ref, True):+.1f}"
              for rec, ref in (("mxfp4_mlp_shared", "fp8"), ("mxfp4", "fp8"), ("mxfp4", "bf16"))]
        lines.append(f"| {r.scope} | {r.attention or '-'} | {pk} | {' | '.join(ch)} | "
                     f"{r.peak_gib['fp8'] / r.peak_gib['bf16']:.3f} |")
    lines += ["", "## What it says", ""] + summary(rs, paper) + [""]
    return "\n".join(lines)


def summary(rs: Sequence[Row], paper: dict[str, tuple[float, float]]) -> list[str]:
    """The base row against the paper, the closest row, the order of bf16 and fp8, and the saving's span (computed)."""
    base = rs[0]
    out = []
    for points, unit in ((False, "relative %"), (True, "points of the 80 GB GPU (81559 MiB)")):
        ch = [base.change(rec, ref, points) for rec, ref in (("mxfp4_mlp_shared", "fp8"), ("mxfp4", "fp8"),
                                                              ("mxfp4", "bf16"))]
        best = min(rs, key=lambda r: r.distance(paper, points))
        out.append(f"- As {unit}: the config's scope ({base.scope}) predicts MLP + shared vs FP8 {ch[0]:+.1f}, all MoE "
                   f"vs FP8 {ch[1]:+.1f}, vs BF16 {ch[2]:+.1f} (up to {base.distance(paper, points):.1f} from the "
                   f"paper's); the closest row is {best.scope}"
                   + (f" ({best.attention})" if best.attention else "")
                   + f", within {best.distance(paper, points):.1f}.")
    t1 = paper_cells()
    t1_bf16, t1_fp8 = t1["attn_ln_experts", "bf16"], t1["attn_ln_experts", "fp8"]
    above = [r for r in rs if r.peak_gib["fp8"] > r.peak_gib["bf16"]]
    below = [f"{r.scope}{' (' + r.attention + ')' if r.attention else ''}" for r in rs if r not in above]
    p8, p16 = paper["mxfp4"]
    line = (f"- FP8 peaks above BF16 in {len(above)} of {len(rs)} rows; in the paper's own T1 too (attn_ln_experts: "
            f"fp8 {t1_fp8:.2f} %, bf16 {t1_bf16:.2f} % of 80 GB).")
    if p16 < p8 and t1_fp8 > t1_bf16:
        line += (f" The paper's T2 has MXFP4 saving more against BF16 ({p16:+.1f}) than against FP8 ({p8:+.1f}), "
                 "which needs BF16 above FP8")
        if below:
            line += (f": in the model, the rows {', '.join(below)}, which keep the routed experts' activations (TE's "
                     "FP8 experts save the column-wise copy of their inputs, about half of BF16's rows). With the "
                     "config's scope, T1's heaviest, T2's numbers cannot all hold at once with T1's; with one of "
                     "those rows' scopes they can.")
        else:
            line += (": the opposite order. So T2's published numbers cannot all hold at once with T1's (numbers.yaml "
                     "flags the same vs-BF16 number in both rows), and no row can match all four.")
    out.append(line)
    spans = "; ".join(f"{r.scope}{' (' + r.attention + ')' if r.attention else ''} {r.change('mxfp4', 'fp8'):+.1f}"
                      for r in rs)
    out.append(f"- All MoE in MXFP4 vs FP8 by scope (relative %): {spans}. The paper's {p8:+.1f} needs a peak "
               "dominated by what MXFP4 does not shrink (full recompute's layer inputs, weights, optimizer state).")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    return markdown_cli(argv, __doc__, "paper_t2", lambda: render(rows()))


if __name__ == "__main__":
    raise SystemExit(main())
