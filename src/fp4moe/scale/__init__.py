"""Paper-scale model (issues 6 and 27): per-GPU memory, per-layer all-to-all bytes and time per token of a
megatron-core DeepSeek-V3-style run, computed from a composed config (model, parallel, recompute, precision,
optimizer) and the rates and measured terms the caller gives, by arithmetic only (no torch, no result files).

Every term is derived from first principles (tensor shapes x bytes per element, megatron's exact optimizer layout
per rank, 1F1B micro-batches in flight, the largest of three phase transients) or is a named input (the memory
outside PyTorch, the kernels' rates); nothing is fitted. ``fp4moe.analysis`` holds the measured inputs, checks the
model against the measured H200 runs and predicts the paper's tables (results/scale/).

    memory.per_gpu_memory(cfg, a)   -> memory.Breakdown (the most loaded pipeline stage; a: MemoryAssumptions)
    memory.per_stage_memory(cfg, a) -> one Breakdown per pipeline rank
    memory.experiment_cfg("paper_t1", "precision=fp8", ...)   one cell as python -m fp4moe.train composes it
    optimizer_state.rank_bytes(cfg, stage, ...)   megatron's parameters, gradient buffer and optimizer state
    outside_torch                   how the memory outside PyTorch scales (communicators, DeepEP's buffers, the gap)
    comm.a2a_per_layer(cfg)         -> comm.LayerA2A (dispatch / combine, forward / backward bytes per GPU)
    comm.a2a_time_s(a2a, link_bandwidth_gb_s=...)  time over a bandwidth the caller states
    throughput.time_per_token(cfg, rates, ...)   seconds per token of the slowest stage (FLOPs / rates + conversions
        + all-to-all + glue), whose RATIOS between recipes and scopes are the prediction; not absolute tokens/s
"""
from .comm import LayerA2A, a2a_per_layer, a2a_time_s, payload_row_bytes
from .memory import (Breakdown, MemoryAssumptions, SavedTensor, compose_cfg, experiment_cfg, layer_saved_tensors,
                     mean_total_bytes, per_gpu_memory, per_stage_memory)

__all__ = ["Breakdown", "MemoryAssumptions", "SavedTensor", "compose_cfg", "experiment_cfg", "layer_saved_tensors",
           "mean_total_bytes", "per_gpu_memory", "per_stage_memory",
           "LayerA2A", "a2a_per_layer", "a2a_time_s", "payload_row_bytes"]
