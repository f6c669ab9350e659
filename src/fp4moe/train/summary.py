"""The run's summary metrics at its end (``summary/*`` in MLflow, ``summary.json`` in the Hydra job folder).

:func:`summarize` is collective: the peaks are the largest over the GPUs, the optimizer-state and gradient-buffer
bytes the fullest rank's (``summary/<key>``) and the emptiest's (``summary/<key>_min``). Bytes are bytes, memory
peaks GB (1e9), losses nats/token.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STATE_KEYS = ("optimizer_state_bytes", "optimizer_state_host_bytes", "grad_buffer_bytes", "fp8_weight_cache_bytes")


def summarize(meter: Any, opt: Any, ddp: Any, cache_bytes: int, losses: dict[int, float],
              eval_losses: dict[int, float], info: Any) -> dict[str, float | None]:
    """``meter.summary()`` (tokens/GPU/s, step times, peaks; the peaks maximised over the GPUs), the FP32 main
    params + AdamW moments on the GPU and in host memory (offload), megatron DDP's gradient buffers and the FP8
    weight copies of ``train.fp8_weight_cache`` at their largest (``cache_bytes``; fp4moe.scale.memory predicts
    all four), and the last training and held-out losses."""
    import torch
    import torch.distributed as dist

    from fp4moe.train import optim

    device = info.device
    summary = meter.summary()
    for key in ("summary/peak_mem_allocated_gb", "summary/peak_mem_reserved_gb", "summary/peak_mem_pct"):
        if key in summary and info.world_size > 1:  # the largest over the GPUs
            v = torch.tensor([summary[key]], dtype=torch.float64, device=device)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            summary[key] = float(v.item())
    held = optim.state_bytes(opt, ddp)
    state = torch.tensor([float(held["device"]), float(held["host"]), float(optim.grad_buffer_bytes(ddp)),
                          float(cache_bytes)], dtype=torch.float64, device=device)
    low = state.clone()
    if info.world_size > 1:
        dist.all_reduce(state, op=dist.ReduceOp.MAX)
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
    for i, key in enumerate(STATE_KEYS):
        summary[f"summary/{key}"] = float(state[i].item())
        summary[f"summary/{key}_min"] = float(low[i].item())
    if losses:
        summary["summary/final_loss"] = losses[max(losses)]
    if eval_losses:
        summary["summary/final_eval_loss"] = eval_losses[max(eval_losses)]
    return summary


def write_summary_json(output_dir: str | Path, record: dict[str, Any]) -> Path:
    """``<output_dir>/summary.json``: the run id, steps, stop signal, recipe, recompute, checkpoint and the
    summary metrics (one JSON object)."""
    path = Path(output_dir, "summary.json")
    path.write_text(json.dumps(record, indent=1))
    return path


__all__ = ["STATE_KEYS", "summarize", "write_summary_json"]
