"""The MoE layer benchmark (fp4moe.moe.bench) as a CPU smoke test: it runs every recipe on a small layer and
writes a results file whose byte columns are the formats' bytes (times are not checked: CPU)."""
from __future__ import annotations

import json

from fp4moe.moe.bench import main
from fp4moe.ops.all_to_all import a2a_payload_bytes
from fp4moe.ops.grouped_experts import expert_saved_bytes
from fp4moe.recipe import Recipe

H, F, EL, K, T = 256, 128, 4, 2, 48


def test_bench_cpu_smoke(tmp_path):
    doc = main(["--device", "cpu", "--hidden", str(H), "--ffn", str(F), "--local-experts", str(EL), "--top-k",
                str(K), "--tokens", str(T), "--shared-ffn", "128", "--warmup", "1", "--iters", "1",
                "--out", str(tmp_path), "--commit", "test"])
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"moe_layer_cpu_ep1_{doc['env']['date']}_test.json", f"moe_layer_cpu_ep1_{doc['env']['date']}_test.md"]
    on_disk = json.loads((tmp_path / files[0]).read_text())
    assert [r["recipe"] for r in on_disk["recipes"]] == ["bf16", "fp8", "mxfp4"]
    rows = T * K
    for r in on_disk["recipes"]:
        codec = "mxfp4" if r["recipe"] == "mxfp4" else "bf16"
        assert r["dispatch_fwd_bytes"] == a2a_payload_bytes(rows, H, codec)
        assert r["dispatch_bwd_bytes"] == r["combine_fwd_bytes"] == r["combine_bwd_bytes"] == a2a_payload_bytes(rows, H, "bf16")
        assert r["routed_rows"] == rows and r["tokens_per_s"] > 0 and r["peak_gib"] is None
        # the expert part follows the formats (counts of the measured routing sum to T*K)
        assert sum(r["expert_counts"]) == rows and len(r["expert_counts"]) == EL
        assert r["expert_saved_bytes"] == expert_saved_bytes(r["expert_counts"], H, F, Recipe.preset(r["recipe"]))
        assert r["saved_bytes"] > r["expert_saved_bytes"] > 0
    by = {r["recipe"]: r for r in on_disk["recipes"]}
    assert by["mxfp4"]["saved_bytes"] < 0.5 * by["fp8"]["saved_bytes"]
    assert on_disk["ratios"]["dispatch_fwd_bytes mxfp4/bf16"] == (H // 2 + H // 32) / (2 * H)
    assert [g["gemm"] for g in on_disk["gemm"]] == ["fc1 fprop", "fc2 fprop", "fc1 dgrad", "fc1 wgrad"]
    for g in on_disk["gemm"]:  # every variant ran (the Triton one under the interpreter)
        assert g["triton_tflops"] > 0 and g["loop_tflops"] > 0 and g["dense_tflops"] > 0
