"""Paper-scale model (issues 6 and 27): per-GPU memory and per-layer all-to-all bytes of a megatron-core
DeepSeek-V3-style run, computed from a composed config (model, parallel, recompute, precision, optimizer) by
arithmetic only (no torch).

Every term is derived from first principles (tensor shapes x bytes per element, megatron's exact optimizer layout
per rank, 1F1B micro-batches in flight, the largest of three phase transients) or measured (the memory outside
PyTorch: CUDA context, NCCL buffers, the allocator's gap), and named; nothing is fitted.
``fp4moe.scale.calibration`` checks the allocated peak against the measured H200 proxy runs
(results/scale/calibration.md): the saved activations agree to within 0.15 % and the peak within 5 % in every run,
on one GPU and on two over NCCL (EP2 x DP2, PP2); nothing at paper scale is checked, so its paper-scale numbers are
predictions of this arithmetic, not a reproduction.

    memory.per_gpu_memory(cfg)      -> memory.Breakdown (the most loaded pipeline stage)
    memory.per_stage_memory(cfg)    -> one Breakdown per pipeline rank
    memory.experiment_cfg("paper_t1", "precision=fp8", ...)   one cell as python -m fp4moe.train composes it
    optimizer_state.rank_bytes(cfg, stage, ...)   megatron's parameters, gradient buffer and optimizer state
    outside_torch.MEASURED          the measured terms outside PyTorch (results/scale/outside_torch_h200.json)
    comm.a2a_per_layer(cfg)         -> comm.LayerA2A (dispatch / combine, forward / backward bytes per GPU)
    comm.a2a_time_s(a2a, link_bandwidth_gb_s=...)  time over a bandwidth the caller states
    calibration.table() / python -m fp4moe.scale.calibration   measured H200 runs vs the model
    paper_t1.cells() / python -m fp4moe.scale.paper_t1         the paper's T1 cells as experiment=paper_t1 runs
        them, a sensitivity table (paper_t1.VARIANTS) and the lab's own measurements (paper_t1.sister_check)
    paper_t2.rows() / python -m fp4moe.scale.paper_t2          the 236B ablation under every recompute scope
    throughput.time_per_token(cfg, ...) / python -m fp4moe.scale.throughput   RATIOS of tokens/GPU/s between
        recipes and recompute scopes (FLOPs / measured rates + conversions + all-to-all + measured glue), checked
        against the H200 probe (results/scale/throughput.md); not absolute tokens/s
"""
from .comm import LayerA2A, a2a_per_layer, a2a_time_s, payload_row_bytes
from .memory import (Breakdown, MemoryAssumptions, SavedTensor, compose_cfg, experiment_cfg, layer_saved_tensors,
                     mean_total_bytes, per_gpu_memory, per_stage_memory)

__all__ = ["Breakdown", "MemoryAssumptions", "SavedTensor", "compose_cfg", "experiment_cfg", "layer_saved_tensors",
           "mean_total_bytes", "per_gpu_memory", "per_stage_memory",
           "LayerA2A", "a2a_per_layer", "a2a_time_s", "payload_row_bytes"]
