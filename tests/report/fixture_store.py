"""A small MLflow store with every kind of run the report reads, logged through the project's own writers
(fp4moe.train.metrics.Tracker, fp4moe.tracking.bench_log, fp4moe.tracking.layer_bench_log), with hand-picked numbers."""
from __future__ import annotations

import json
import time
from pathlib import Path

H200 = "1 x NVIDIA H200 (140 GiB)"
CPU = "1 process(es) on CPU: Test CPU, 2 cores"

# proxy_t1_1gpu on one H200: (scope, recipe) -> (tgs median, min, max, peak GiB, peak %) or "OOM"; one cell absent.
PROXY = {
    ("attn_ln_experts", "bf16"): (5000.0, 4900.0, 5100.0, 90.5, 64.6),
    ("attn_ln_experts", "fp8"): (5200.0, 5100.0, 5300.0, 100.4, 71.6),
    ("attn_ln_experts", "mxfp4"): (5150.0, 5000.0, 5250.0, 80.0, 57.1),
    ("attn_ln_mlp", "bf16"): "OOM",
    ("attn_ln_mlp", "fp8"): "OOM",
    ("attn_ln_mlp", "mxfp4"): (5600.0, 5500.0, 5700.0, 85.0, 60.7),
    ("mla_up_proj", "bf16"): "OOM",
    ("mla_up_proj", "mxfp4"): (5800.0, 5700.0, 5900.0, 95.0, 67.9),
}
# tiny_cpu: loss(step) = (5 - 0.1 step) x factor over 20 steps; final eval loss
TINY = {"bf16": (1.00, 4.00), "fp8": (1.01, 4.04), "mxfp4": (1.02, 4.10)}
TINY_STEPS = 20

KERNEL_JSON = {
    "env": {"date": "2026-11-30T01:00:00Z", "commit": "abc1234", "gpu": "NVIDIA H200", "torch": "2.11.0",
            "command": "python -m fp4moe_kernels.bench.conversions"},
    "copy_gbps": 4000.0,
    "rows": [
        {"shape": "32768x7168", "kernel": "bf16_to_fp4_row", "impl": "fp4moe", "ms": 0.25, "bytes": 1, "gbps": 2000.0,
         "pct_copy": 50.0, "note": ""},
        {"shape": "32768x7168", "kernel": "bf16_to_fp4_row", "impl": "torchao 0.17.0 to_mx (compiled)", "ms": 0.5,
         "bytes": 1, "gbps": 1000.0, "pct_copy": 25.0, "note": ""},
        {"shape": "32768x7168", "kernel": "fp4_row_to_fp8_row", "impl": "fp4moe", "ms": 0.3, "bytes": 1,
         "gbps": 1200.0, "pct_copy": 30.0, "note": ""},
        {"shape": "32768x7168", "kernel": "fp4_row_to_fp8_row", "impl": "torch.compile (unfused, BF16 in HBM)",
         "ms": 0.6, "bytes": 1, "gbps": 600.0, "pct_copy": 15.0, "note": ""},
        {"shape": "32768x7168", "kernel": "fp4_row_to_fp8_row", "impl": "torch eager (unfused)", "ms": 6.0,
         "bytes": 1, "gbps": 60.0, "pct_copy": 1.5, "note": ""},
    ],
}
LAYER_JSON = {
    "env": {"date": "2026-11-30", "commit": "abc1234", "gpu": "h200", "world_size": 1, "command": "python -m fp4moe.bench.moe_layer"},
    "shape": {"hidden": 7168, "ffn": 2048, "local_experts": 32, "experts": 32, "top_k": 8, "tokens": 4096},
    "recipes": [
        {"recipe": "bf16", "tokens_per_s": 100000.0, "saved_bytes": 4000, "saved_bytes_per_token": 240000.0,
         "expert_saved_bytes": 2000, "dispatch_fwd_bytes": 1000, "peak_over_base_gib": 5.0},
        {"recipe": "fp8", "tokens_per_s": 80000.0, "saved_bytes": 5000, "saved_bytes_per_token": 260000.0,
         "expert_saved_bytes": 2000, "dispatch_fwd_bytes": 1000, "peak_over_base_gib": 5.0},
        {"recipe": "mxfp4", "tokens_per_s": 76000.0, "saved_bytes": 1500, "saved_bytes_per_token": 78000.0,
         "expert_saved_bytes": 500, "dispatch_fwd_bytes": 265, "peak_over_base_gib": 4.5},
    ],
}


def _params(model: str, recipe: str, scope: str, micro: int, seq: int, gbs: int, steps: int) -> dict[str, str]:
    return {"model.name": model, "precision.name": recipe, "recompute.name": scope, "parallel.world_size": "1",
            "parallel.tensor": "1", "parallel.pipeline": "1", "parallel.expert": "1", "parallel.data": "1",
            "parallel.micro_batch": str(micro), "parallel.seq_length": str(seq), "parallel.global_batch": str(gbs),
            "train.steps": str(steps), "train.seed": "1234", "data.name": "shakespeare", "recipe": recipe}


def _trainer_run(uri, experiment, model, hardware, recipe, scope, params, steps_metrics, status, extra_tags=None):
    from fp4moe.train.metrics import Tracker

    t = Tracker(uri, experiment, enabled=True)
    tags = {"hardware": hardware, "device": "cuda" if "H200" in hardware else "cpu", "world_size": "1",
            "recipe": recipe, "recompute": scope, "model": model, **(extra_tags or {})}
    t.start(f"{experiment}/{model}/{recipe}/{scope}", params, tags, resume_run_id=None)
    for step, m in steps_metrics:
        t.log(step, m)
    t.finish(status)
    time.sleep(0.005)  # distinct start times: "the latest run" is well defined
    return t.run_id


def build(folder: Path) -> str:
    """Create the store in ``folder`` (mlflow.db) and return its URI."""
    from fp4moe.tracking import bench_log, layer_bench_log

    folder.mkdir(parents=True, exist_ok=True)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    # an older, superseded run of one cell, and a failed run that is not an OOM: both must be ignored
    p = _params("proxy_h200", "bf16", "attn_ln_experts", 8, 4096, 32, 12)
    _trainer_run(uri, "proxy_t1_1gpu", "proxy_h200", H200, "bf16", "attn_ln_experts", p,
                 [(12, {"summary/tgs_median": 1.0, "summary/tgs_min": 1.0, "summary/tgs_max": 1.0})], "FINISHED")
    _trainer_run(uri, "proxy_t1_1gpu", "proxy_h200", H200, "fp8", "mla_up_proj",
                 _params("proxy_h200", "fp8", "mla_up_proj", 8, 4096, 32, 12), [], "FAILED")
    for (scope, recipe), cell in PROXY.items():
        p = _params("proxy_h200", recipe, scope, 8, 4096, 32, 12)
        if cell == "OOM":
            _trainer_run(uri, "proxy_t1_1gpu", "proxy_h200", H200, recipe, scope, p, [], "FAILED",
                         {"outcome": "OOM", "oom_step": "1"})
            continue
        med, lo, hi, gib, pct = cell
        _trainer_run(uri, "proxy_t1_1gpu", "proxy_h200", H200, recipe, scope, p,
                     [(12, {"summary/tgs_median": med, "summary/tgs_min": lo, "summary/tgs_max": hi,
                            "summary/peak_mem_allocated_gb": gib, "summary/peak_mem_pct": pct,
                            "summary/final_loss": 7.0})], "FINISHED")
    for recipe, (factor, ev) in TINY.items():
        p = _params("tiny_cpu", recipe, "attn_ln_experts", 2, 128, 4, TINY_STEPS)
        steps = [(s, {"loss": (5 - 0.1 * s) * factor}) for s in range(1, TINY_STEPS + 1)]
        steps.append((TINY_STEPS, {"eval_loss": ev, "summary/tgs_median": 300.0, "summary/tgs_min": 250.0,
                                   "summary/tgs_max": 350.0, "summary/final_loss": (5 - 0.1 * TINY_STEPS) * factor,
                                   "summary/final_eval_loss": ev}))
        _trainer_run(uri, "tiny_cpu", "tiny_cpu", CPU, recipe, "attn_ln_experts", p, steps, "FINISHED",
                     {"peak_memory": "not measured (CPU)"})
    kj, lj = folder / "kernels_test.json", folder / "moe_layer_test.json"
    kj.write_text(json.dumps(KERNEL_JSON))
    lj.write_text(json.dumps(LAYER_JSON))
    bench_log.log_file(kj, uri)
    layer_bench_log.log_file(lj, uri)
    return uri
