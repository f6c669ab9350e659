"""Paper-scale model (issue 6, P5): per-GPU memory and per-layer all-to-all bytes of a megatron-core
DeepSeek-V3-style run, computed from a composed config (model, parallel, recompute, precision) by arithmetic
only (no torch).

First version: every term is derived from first principles (tensor shapes x bytes per element, optimizer bytes
per parameter, 1F1B micro-batches in flight) and named; nothing is fitted. P5 calibrates it against measured
H200 runs (P3's proxy, P2's layer) before it is applied to the paper's configs; until then its paper-scale
numbers are predictions of this arithmetic, not a reproduction.

    memory.per_gpu_memory(cfg)      -> memory.Breakdown (the most loaded pipeline stage)
    memory.per_stage_memory(cfg)    -> one Breakdown per pipeline rank
    comm.a2a_per_layer(cfg)         -> comm.LayerA2A (dispatch / combine, forward / backward bytes per GPU)
    comm.a2a_time_s(a2a, link_bandwidth_gb_s=...)  time over a bandwidth the caller states
"""
from .comm import LayerA2A, a2a_per_layer, a2a_time_s, payload_row_bytes
from .memory import (Breakdown, MemoryAssumptions, SavedTensor, compose_cfg, layer_saved_tensors,
                     paper_t1_prediction, per_gpu_memory, per_stage_memory)

__all__ = ["Breakdown", "MemoryAssumptions", "SavedTensor", "compose_cfg", "layer_saved_tensors",
           "paper_t1_prediction", "per_gpu_memory", "per_stage_memory",
           "LayerA2A", "a2a_per_layer", "a2a_time_s", "payload_row_bytes"]
