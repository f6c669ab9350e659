"""The paper-scale model's side of the report: fp4moe.scale's per-GPU memory for T1's cells, and what-ifs.

Checked on one and two H200s: fp4moe.scale's peak memory is within 5 % of every H200 proxy run of the checked code
versions, on one GPU and over NCCL (EP2 x DP2, PP2; results/scale/calibration.md), not at paper scale, so every
number from here is a prediction, labelled ``MODEL_LABEL``. GB here are fp4moe.scale's (2**30 B); "% of 80 GB" divides by 80 of them.
"""
from __future__ import annotations

from typing import Any

MODEL_LABEL = "model, checked on 1-2 H200s"
SCOPES = ("attn_ln_experts", "attn_ln_mlp", "mla_up_proj")
RECIPES = ("bf16", "fp8", "mxfp4")


def _row(scope: str, recipe: str, b: Any, gpu_memory_gb: float) -> dict[str, Any]:
    return {"scope": scope, "recipe": recipe, "total_gb": b.total_gb, "pct_of_gpu": 100.0 * b.total_gb / gpu_memory_gb,
            "fits": b.fits(gpu_memory_gb), "pipeline_rank": b.pipeline_rank, "in_flight": b.in_flight,
            "peak_phase": b.peak_phase,
            **{f"{name}_gb": b.gb(name) for name in ("params", "grads", "optimizer", "activations", "held",
                                                      "static_buffers", "transient", "loss_transient", "a2a_buffers",
                                                      "expert_backward", "recompute_transient", "head_saved")}}


def assumptions(precision_aware_optimizer: bool = False, attention: str = "core_attn") -> Any:
    """fp4moe.scale's defaults, or (True) BF16 main grads with the optimizer states offloaded to the host: the
    setup of the paper lab's sister scripts, an open question of the model (fp4moe.scale.memory docstring).
    ``attention``: what the scopes' "attention" recomputes, ``core_attn`` or ``self_attention`` (the whole block,
    the reading results/scale/paper_t1.md supports)."""
    from fp4moe.scale import MemoryAssumptions

    if precision_aware_optimizer:
        return MemoryAssumptions(grad_bytes=2, optimizer_offload=True, attn_recompute=attention)
    return MemoryAssumptions(attn_recompute=attention)


def t1_prediction(gpu_memory_gb: float = 80.0, memory_assumptions: Any = None) -> list[dict[str, Any]]:
    """fp4moe.scale.paper_t1_prediction as rows (scope, recipe, total_gb, pct_of_gpu, fits, components)."""
    from fp4moe.scale import paper_t1_prediction

    cells = paper_t1_prediction(memory_assumptions, gpu_memory_gb=gpu_memory_gb)
    return [_row(s, r, cells[s][r], gpu_memory_gb) for s in SCOPES for r in RECIPES]


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


def what_if(*, model: str = "dsv3_671b", parallel: str = "paper_671b", expert: int | None = None,
            pipeline: int | None = None, micro_batch: int | None = None, seq_length: int | None = None,
            scopes: tuple[str, ...] = SCOPES, recipes: tuple[str, ...] = RECIPES,
            gpu_memory_gb: float = 80.0, memory_assumptions: Any = None) -> list[dict[str, Any]]:
    """Predicted peak memory per (scope, recipe) with some parallel settings changed (world size fixed: data
    parallel = world / (tensor x pipeline x context)); a changed pipeline gets ``even_layout``. Raises
    ValueError for a layout that does not divide."""
    from fp4moe.scale import compose_cfg, per_gpu_memory

    rows = []
    for scope in scopes:
        for recipe in recipes:
            cfg = compose_cfg(model, parallel, scope, recipe)
            p = cfg.parallel
            if expert is not None:
                p.expert = int(expert)
            if micro_batch is not None:
                p.micro_batch = int(micro_batch)
            if seq_length is not None:
                p.seq_length = int(seq_length)
            if pipeline is not None and int(pipeline) != int(p.pipeline):
                p.pipeline = int(pipeline)
                p.pipeline_layout = even_layout(int(cfg.model.num_layers), int(pipeline),
                                                int(cfg.model.get("mtp_num_layers") or 0))
            world, tp, pp, cp = int(p.world_size), int(p.tensor), int(p.pipeline), int(p.context)
            if world % (tp * pp * cp):
                raise ValueError(f"world size {world} is not a multiple of TP x PP x CP = {tp * pp * cp}")
            p.data = world // (tp * pp * cp)
            if world % (int(p.expert) * int(p.expert_tensor) * pp):
                raise ValueError(f"world size {world} is not a multiple of EP x ETP x PP")
            if int(cfg.model.moe.num_experts) % int(p.expert):
                raise ValueError(f"{cfg.model.moe.num_experts} experts do not split over EP={p.expert}")
            rows.append({**_row(scope, recipe, per_gpu_memory(cfg, memory_assumptions), gpu_memory_gb),
                         "tp": tp, "pp": pp, "ep": int(p.expert), "dp": int(p.data), "micro_batch": int(p.micro_batch),
                         "seq_length": int(p.seq_length)})
    return rows


__all__ = ["MODEL_LABEL", "RECIPES", "SCOPES", "assumptions", "even_layout", "t1_prediction", "what_if"]
