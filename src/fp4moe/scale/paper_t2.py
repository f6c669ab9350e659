"""The paper's T2, the DeepSeek-V2 236B peak-memory ablation by FP4 scope, predicted by the memory model beside the
paper's numbers (issue 6, P5).

    python -m fp4moe.scale.paper_t2 [--out results/scale/paper_t2.md]

Paper (``conf/paper/numbers.yaml`` t2, secondary summaries of the full text): MXFP4 on the MLP and shared experts
-6.9 % peak memory against FP8, on all of the MoE (routed experts too) -7.2 %, both -11 % against BF16; whether these
are relative changes or points of 80 GB is not known. The paper gives neither the layout nor the recompute scope:
the layout is ``conf/parallel/paper_236b.yaml`` (ours: TP1 PP16 EP8 DP16, micro-batch 1, sequence 4096, the
distributed optimizer), and every recompute scope is predicted, with both readings of "attention" (core attention,
the whole self-attention block) and the three gradient / optimizer setups of ``paper_t1.SETUPS``. Each change is
given both ways: relative (peak / reference peak - 1, %) and in points of 80 GiB. Peaks are the most loaded pipeline
rank's (``memory.per_gpu_memory``). Arithmetic only, no torch; nothing is fitted to the paper.

``mxfp4_mlp_shared`` is what ``fp4moe.recipe.Recipe`` can say of the paper's first row (conf/precision/
mxfp4_mlp_shared.yaml): the routed experts get BF16 dispatch and FP8 inputs, but the FP4 storage of saved inputs and
of the SwiGLU input still covers them, so the model separates the two rows only under attn_ln_experts, where the
experts' recompute checkpoint keeps their dispatched rows (MXFP4 under mxfp4, BF16 under mxfp4_mlp_shared).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

from .memory import MemoryAssumptions, compose_cfg, per_gpu_memory
from .paper_t1 import ATTENTION, SETUPS, write_markdown_cli

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_OUT = "results/scale/paper_t2.md"
GPU_GIB = 80.0
MODEL, LAYOUT = "dsv2_236b", "paper_236b"
SCOPES = ("none", "attn_ln_experts", "attn_ln_mlp", "mla_up_proj", "full")
RECIPES = ("bf16", "fp8", "mxfp4_mlp_shared", "mxfp4")
# the paper's rows: its label -> our precision config
ROWS = {"mlp_and_shared_experts": "mxfp4_mlp_shared", "all_moe": "mxfp4"}
ATTN_SCOPES = ("attn_ln_experts", "attn_ln_mlp")   # the scopes whose "attention" has two readings


def paper_rows() -> dict[str, tuple[float, float]]:
    """{our precision: (change vs FP8 %, change vs BF16 %)} of the paper's T2, read by fp4moe.report.paper."""
    from fp4moe.report.paper import load, t2_rows

    return {ROWS[r["row"]]: (r["vs_fp8_pct"], r["vs_bf16_pct"]) for r in t2_rows(load())}


@dataclass(frozen=True)
class Row:
    """One reading (setup, attention, scope): the four recipes' peaks (GiB, the most loaded pipeline rank)."""

    setup: str
    attention: str          # '' where the scope recomputes no attention
    scope: str
    peak_gib: dict

    def change(self, recipe: str, ref: str, points: bool = False) -> float:
        """``recipe``'s peak against ``ref``'s: relative % or (``points``) points of 80 GiB."""
        a, b = self.peak_gib[recipe], self.peak_gib[ref]
        return 100.0 * (a - b) / GPU_GIB if points else 100.0 * (a / b - 1.0)

    def distance(self, paper: dict[str, tuple[float, float]], points: bool = False) -> float:
        """Largest |model - paper| over the paper's four numbers (in the unit the reading takes them in)."""
        return max(max(abs(self.change(rec, "fp8", points) - p8), abs(self.change(rec, "bf16", points) - p16))
                   for rec, (p8, p16) in paper.items())


def rows(setups: dict[str, MemoryAssumptions] = SETUPS) -> list[Row]:
    out = []
    for name, a in setups.items():
        for scope in SCOPES:
            for attention, attn in (ATTENTION.items() if scope in ATTN_SCOPES else (("", "core_attn"),)):
                aa = replace(a, attn_recompute=attn)
                peaks = {rec: per_gpu_memory(compose_cfg(MODEL, LAYOUT, scope, rec), aa).total_gb for rec in RECIPES}
                out.append(Row(name, attention, scope, peaks))
    return out


def render(rs: Sequence[Row]) -> str:
    paper = paper_rows()
    p = {rec: f"{v[0]:+.1f} / {v[1]:+.1f}" for rec, v in paper.items()}
    lines = ["# The paper's T2: the 236B peak-memory ablation by FP4 scope (issue 6, P5)", "",
             "Written by `python -m fp4moe.scale.paper_t2`. Model `dsv2_236b`, layout `paper_236b` (TP1 PP16 EP8 "
             "DP16, micro-batch 1, seq 4096, distributed optimizer: ours, the paper gives no layout for T2) under "
             "every recompute scope, both readings of \"attention\" and the three setups of results/scale/"
             "paper_t1.md. **model**: `fp4moe.scale.memory`, the most loaded pipeline rank, checked against H200 runs "
             "on 1-2 GPUs (results/scale/calibration.md), not at this scale. **paper**: `conf/paper/numbers.yaml` "
             f"(secondary summaries): MXFP4 on MLP + shared experts {p['mxfp4_mlp_shared']} % vs FP8 / BF16, on all "
             f"MoE {p['mxfp4']} %; whether relative or points of 80 GB is not known, so both are given. "
             "`mxfp4_mlp_shared` differs from `mxfp4` only in the routed experts' dispatch and FP8 inputs "
             "(fp4moe.recipe cannot keep their saved inputs out of FP4; conf/precision/mxfp4_mlp_shared.yaml). "
             "Nothing here is fitted to the paper.", ""]
    for name in dict.fromkeys(r.setup for r in rs):
        lines += [f"## {name}", "",
                  "| recompute | attention | peak GiB bf16 / fp8 / mxfp4_mlp_shared / mxfp4 | MLP + shared vs FP8, "
                  "rel. % / pp | all MoE vs FP8, rel. % / pp | all MoE vs BF16, rel. % / pp | fp8 / bf16 peak |",
                  "|---|---|---|---|---|---|---:|"]
        for r in (x for x in rs if x.setup == name):
            pk = " / ".join(f"{r.peak_gib[rec]:.1f}" for rec in RECIPES)
            ch = [f"{r.change(rec, ref):+.1f} / {r.change(rec, ref, True):+.1f}"
                  for rec, ref in (("mxfp4_mlp_shared", "fp8"), ("mxfp4", "fp8"), ("mxfp4", "bf16"))]
            lines.append(f"| {r.scope} | {r.attention or '-'} | {pk} | {' | '.join(ch)} | "
                         f"{r.peak_gib['fp8'] / r.peak_gib['bf16']:.3f} |")
        lines.append("")
    lines += ["## What it says", ""] + summary(rs, paper) + [""]
    return "\n".join(lines)


def _label(r: Row) -> str:
    return f"{r.scope}" + (f" ({r.attention})" if r.attention else "") + f", {r.setup}"


def summary(rs: Sequence[Row], paper: dict[str, tuple[float, float]]) -> list[str]:
    """Closest readings, the order of bf16 and fp8, and how far the FP4 saving spans over the scopes (computed)."""
    out = []
    for points, unit in ((False, "relative %"), (True, "points of 80 GiB")):
        best = min(rs, key=lambda r: r.distance(paper, points))
        ch = [best.change(rec, ref, points) for rec, ref in (("mxfp4_mlp_shared", "fp8"), ("mxfp4", "fp8"),
                                                              ("mxfp4", "bf16"))]
        out.append(f"- Taking the paper's numbers as {unit}, no reading comes within "
                   f"{best.distance(paper, points):.1f} of all four; the closest is {_label(best)} (MLP + shared vs "
                   f"FP8 {ch[0]:+.1f}, all MoE vs FP8 {ch[1]:+.1f}, vs BF16 {ch[2]:+.1f}).")
    from .paper_t1 import paper_cells

    t1 = paper_cells()
    t1_bf16, t1_fp8 = t1["attn_ln_experts", "bf16"], t1["attn_ln_experts", "fp8"]
    above = sum(r.peak_gib["fp8"] > r.peak_gib["bf16"] for r in rs)
    p8, p16 = paper["mxfp4"]
    line = (f"- FP8 peaks above BF16 in {above} of {len(rs)} readings; in the paper's own T1 too (attn_ln_experts: "
            f"fp8 {t1_fp8:.2f} %, bf16 {t1_bf16:.2f} % of 80 GB).")
    if p16 < p8 and above == len(rs) and t1_fp8 > t1_bf16:
        line += (f" The paper's T2 has MXFP4 saving more against BF16 ({p16:+.1f}) than against FP8 ({p8:+.1f}), "
                 "which needs BF16 above FP8: the opposite order. So the T2 numbers as summarised (the same vs-BF16 "
                 "number in both rows, which numbers.yaml flags) are not consistent with T1, and no reading can "
                 "match all four.")
    out.append(line)
    by_scope: dict[str, list[float]] = {}
    for r in rs:
        by_scope.setdefault(r.scope, []).append(r.change("mxfp4", "fp8"))
    spans = "; ".join(f"{s} {min(v):+.1f} to {max(v):+.1f}" for s, v in by_scope.items())
    near = min(by_scope, key=lambda s: min(abs(v - p8) for v in by_scope[s]))
    out.append(f"- All MoE in MXFP4 vs FP8 by scope (relative %, over setups and attention readings): {spans}. The "
               f"paper's {p8:+.1f} is nearest {near}"
               + (", where little is saved at all: a single-digit saving would need most of the saved activations "
                  "recomputed in T2, or a peak that is not the activations' (the summaries do not say which)."
                  if near == "full" else "."))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    return write_markdown_cli(argv, __doc__, DEFAULT_OUT, lambda: render(rows()))


if __name__ == "__main__":
    raise SystemExit(main())
