"""The paper-scale model's side of the report: fp4moe.scale's per-GPU memory for T1's cells, and what-ifs.

Each cell is what ``experiment=paper_t1`` runs (the lab's setup, conf/experiment/paper_t1.yaml) under the model's
assumption set ``fp4moe.analysis.paper_t1.paper_setup()`` (``assumption_set()`` in words), labelled
``MODEL_LABEL``. What is checked, and where: the model's allocated peak against H200 proxy runs on one and two GPUs
(within 5 %, results/scale/calibration.md); nothing at paper scale, so every number from here is a prediction. The
total is what nvidia-smi would show (allocated + the memory outside PyTorch); GB are 2**30 B; "% of 80 GB" divides by
the 80 GB Hopper's 81559 MiB (``fp4moe.analysis.paper_t1.GPU_GIB``), as the paper's cells are read.
"""
from __future__ import annotations

from typing import Any, Sequence

MODEL_LABEL = "model (paper_t1 setup)"
SCOPES = ("attn_ln_experts", "attn_ln_mlp", "mla_up_proj")
RECIPES = ("bf16", "fp8", "mxfp4")
ATTENTION = ("self_attention", "core_attn")   # the whole attention block (the config's reading) or core attention
PAPER_T1_ATTENTION = ATTENTION[0]              # the reading experiment=paper_t1 runs: the model column's, everywhere


def assumption_set() -> str:
    """The model column's assumption set in words (config + the model's own assumptions)."""
    from fp4moe.analysis.paper_t1 import setup_label

    return setup_label()


def _row(cell: Any, gpu_memory_gb: float) -> dict[str, Any]:
    return {"scope": cell.scope, "recipe": cell.recipe, "recompute": cell.recompute, "total_gb": cell.total_gib,
            "allocated_gb": cell.allocated_gib, "mean_gb": cell.mean_gib,
            "pct_of_gpu": 100.0 * cell.total_gib / gpu_memory_gb, "fits": cell.total_gib <= gpu_memory_gb,
            "pipeline_rank": cell.rank, "in_flight": cell.in_flight, **{f"{k}_gb": v for k, v in cell.parts.items()}}


def _recompute(attention: str | None) -> dict[str, str] | None:
    from fp4moe.analysis import paper_t1

    if attention not in (None, *ATTENTION):
        raise ValueError(f"attention={attention!r}: one of {ATTENTION}")
    return paper_t1.CORE_ATTENTION if attention == "core_attn" else None


def t1_prediction(gpu_memory_gb: float | None = None, memory_assumptions: Any = None, *,
                  optimizer: str | None = None, attention: str | None = None, overrides: Sequence[str] = (),
                  recipes: Sequence[str] = RECIPES) -> list[dict[str, Any]]:
    """The model's T1 cells as rows (scope, recipe, recompute, total_gb, allocated_gb, mean_gb, pct_of_gpu, fits,
    components): experiment=paper_t1 with ``overrides`` (``optimizer``: another conf/optimizer group; ``attention``:
    'core_attn' for megatron's core attention) under ``memory_assumptions`` (default ``paper_setup()``);
    ``pct_of_gpu`` and ``fits`` against ``gpu_memory_gb`` GiB (default ``paper_t1.GPU_GIB``)."""
    from fp4moe.analysis import paper_t1

    gpu_memory_gb = paper_t1.GPU_GIB if gpu_memory_gb is None else gpu_memory_gb
    extra = [*overrides, *([f"optimizer={optimizer}"] if optimizer else [])]
    cells = paper_t1.cells(memory_assumptions or paper_t1.paper_setup(), extra, _recompute(attention), recipes=recipes)
    return [_row(c, gpu_memory_gb) for c in cells]


def even_layout(num_layers: int, pipeline: int, mtp_layers: int = 0) -> str:
    """A pipeline_layout that splits the transformer layers as evenly as possible (earlier stages take the
    remainder); embedding on the first stage, MTP and loss on the last. Not tuned: a what-if default."""
    if pipeline < 1 or num_layers < pipeline:
        raise ValueError(f"pipeline={pipeline} needs 1 <= pipeline <= num_layers={num_layers}")
    base, extra = divmod(num_layers, pipeline)
    stages = ["t" * (base + (i < extra)) for i in range(pipeline)]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp_layers + "L"
    return "|".join(stages)


def what_if(*, expert: int | None = None, pipeline: int | None = None, micro_batch: int | None = None,
            seq_length: int | None = None, optimizer: str | None = None, attention: str | None = None,
            scopes: tuple[str, ...] = SCOPES, recipes: tuple[str, ...] = RECIPES,
            gpu_memory_gb: float | None = None, memory_assumptions: Any = None) -> list[dict[str, Any]]:
    """Predicted peak memory per (scope, recipe) of experiment=paper_t1 with some settings changed (world size
    fixed: data parallel = world / (tensor x pipeline x context)); a changed pipeline gets ``even_layout``. Raises
    ValueError for a layout that does not divide."""
    from fp4moe.analysis import paper_t1
    from fp4moe.scale.memory import experiment_cfg

    base = experiment_cfg(paper_t1.EXPERIMENT)
    p, m = base.parallel, base.model
    ep, pp = int(expert or p.expert), int(pipeline or p.pipeline)
    world, tp, cp = int(p.world_size), int(p.tensor), int(p.context)
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not a multiple of TP x PP x CP = {tp * pp * cp}")
    if world % (ep * int(p.expert_tensor or tp) * pp):
        raise ValueError(f"world size {world} is not a multiple of EP x ETP x PP")
    if int(m.moe.num_experts) % ep:
        raise ValueError(f"{m.moe.num_experts} experts do not split over EP={ep}")
    over = [f"parallel.expert={ep}", f"parallel.data={world // (tp * pp * cp)}"]
    if pp != int(p.pipeline):
        layout = even_layout(int(m.num_layers), pp, int(m.get("mtp_num_layers") or 0))
        over += [f"parallel.pipeline={pp}", f"parallel.pipeline_layout='{layout}'"]
    if micro_batch is not None:
        over.append(f"parallel.micro_batch={int(micro_batch)}")
    if seq_length is not None:
        over.append(f"parallel.seq_length={int(seq_length)}")
    rows = [r for r in t1_prediction(gpu_memory_gb, memory_assumptions, optimizer=optimizer, attention=attention,
                                     overrides=over, recipes=recipes) if r["scope"] in scopes]
    par = {"tp": tp, "pp": pp, "ep": ep, "dp": world // (tp * pp * cp),
           "micro_batch": int(micro_batch or p.micro_batch), "seq_length": int(seq_length or p.seq_length)}
    return [{**r, **par} for r in rows]


__all__ = ["ATTENTION", "MODEL_LABEL", "PAPER_T1_ATTENTION", "RECIPES", "SCOPES", "assumption_set", "even_layout", "t1_prediction",
           "what_if"]
