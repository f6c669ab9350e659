"""The MoE layer benchmark (fp4moe.bench.moe_layer) as a CPU smoke test: it runs every recipe on a small layer and
writes a results file whose byte columns are the formats' bytes (times are not checked: CPU)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fp4moe.bench.moe_layer import main
from fp4moe.ops.all_to_all import a2a_payload_bytes
from fp4moe.ops.grouped_experts import expert_saved_bytes
from fp4moe.recipe import Recipe
from fp4moe.tracking.layer_bench_log import layer_bench_id

H, F, EL, K, T = 256, 128, 4, 2, 48


def test_bench_cpu_smoke(tmp_path):
    doc = main(["--device", "cpu", "--hidden", str(H), "--ffn", str(F), "--local-experts", str(EL), "--top-k",
                str(K), "--tokens", str(T), "--shared-ffn", "128", "--warmup", "1", "--iters", "1",
                "--out", str(tmp_path), "--commit", "test"])
    files = sorted(p.name for p in tmp_path.iterdir())
    stem = f"moe_layer_cpu_ep1_t{T}_e{EL}_h{H}_f{F}_k{K}_s128_{doc['env']['date']}_test"  # the shape is not V3's
    assert files == [stem + ".json", stem + ".md"]
    again = main(["--device", "cpu", "--hidden", str(H), "--ffn", str(F), "--local-experts", str(EL), "--top-k",
                  str(K), "--tokens", str(T), "--shared-ffn", "128", "--warmup", "1", "--iters", "1", "--recipes",
                  "bf16,fp8@loop", "--no-gemm", "--no-profile", "--out", str(tmp_path), "--commit", "test"])
    kept = Path(again["files"][0])  # the same day and commit: written beside the first run, which is kept
    assert kept.name.startswith(stem + "_") and (tmp_path / files[0]).exists() and len(list(tmp_path.iterdir())) == 4
    # ... and logged as a benchmark of its own: the time it was measured is part of its id (layer_bench_log)
    assert doc["env"]["measured_at"] < again["env"]["measured_at"]
    assert layer_bench_id(doc["env"], doc["shape"]) != layer_bench_id(again["env"], again["shape"])
    # a recipe @ a grouped_gemm value: its own row, run under that switch, with its ratio to bf16
    assert [(r["recipe"], r["grouped_gemm"]) for r in again["recipes"]] == [("bf16", "loop"), ("fp8@loop", "loop")]
    assert list(again["ratios"]) == ["tokens_per_s fp8@loop/bf16"]
    with pytest.raises(SystemExit, match="fp8@cublas: the part after @ is a grouped_gemm value"):
        main(["--device", "cpu", "--recipes", "fp8@cublas", "--out", str(tmp_path)])
    on_disk = json.loads((tmp_path / files[0]).read_text())
    assert [r["recipe"] for r in on_disk["recipes"]] == ["bf16", "fp8", "mxfp4"] and on_disk["complete"] is True
    assert "Incomplete" not in (tmp_path / files[1]).read_text()
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


def test_bench_cut_short_keeps_the_recipes_it_measured(tmp_path, monkeypatch):
    """A run stopped after its first recipe (on the GPU: a device call's time limit) has written that recipe's row,
    marked incomplete in the JSON and the Markdown; the real first recipe runs, the second is interrupted."""
    import fp4moe.bench.moe_layer as bench

    real, calls = bench._bench_recipe, []

    def first_then_stop(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt  # what a timeout's signal leaves: the process ends here
        return real(*a, **k)

    monkeypatch.setattr(bench, "_bench_recipe", first_then_stop)
    with pytest.raises(KeyboardInterrupt):
        main(["--device", "cpu", "--hidden", str(H), "--ffn", str(F), "--local-experts", str(EL), "--top-k", str(K),
              "--tokens", str(T), "--shared-ffn", "0", "--warmup", "1", "--iters", "1", "--recipes", "bf16,fp8@loop",
              "--no-profile", "--out", str(tmp_path), "--commit", "test"])
    (js,) = tmp_path.glob("*.json")
    doc = json.loads(js.read_text())
    assert doc["complete"] is False and [r["recipe"] for r in doc["recipes"]] == ["bf16"] and doc["gemm"] is None
    assert "**Incomplete**: the run stopped after the 1 recipe(s) below" in js.with_suffix(".md").read_text()
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".md"]  # no temporary file left


def test_bench_fp8_weight_cache(tmp_path):
    """--fp8-weight-cache: each iteration one optimizer step; the copies one forward + backward made are the FP8
    experts' (and the shared expert's where the recipe covers it), none under bf16; a file of its own."""
    from fp4moe.scale.memory import _fp8_matrix_bytes

    doc = main(["--device", "cpu", "--hidden", str(H), "--ffn", str(F), "--local-experts", str(EL), "--top-k",
                str(K), "--tokens", str(T), "--shared-ffn", "128", "--warmup", "1", "--iters", "1", "--recipes",
                "bf16,fp8,mxfp4", "--no-gemm", "--no-profile", "--fp8-weight-cache", "--out", str(tmp_path),
                "--commit", "test"])
    assert doc["env"]["fp8_weight_cache"] and "_wcache_" in Path(doc["files"][0]).name
    experts = EL * (_fp8_matrix_bytes(2 * F, H) + _fp8_matrix_bytes(H, F))
    shared = _fp8_matrix_bytes(2 * 128, H) + _fp8_matrix_bytes(H, 128)
    by = {r["recipe"]: r for r in doc["recipes"]}
    assert by["bf16"]["fp8_weight_cache_bytes"] == 0
    for name in ("fp8", "mxfp4"):
        want = experts + (shared if Recipe.preset(name).applies_to("shared_expert") else 0)
        assert by[name]["fp8_weight_cache_bytes"] == want, name


def test_bench_weight_cache_over_micro_batches(tmp_path):
    """--micro-batches 2: an optimizer step is two iterations, so the weights are quantized half as often as with one
    (the cache's quantizer passes over the timed iterations); the file says so; a count that does not divide --iters
    is refused."""
    common = ["--device", "cpu", "--hidden", str(H), "--ffn", str(F), "--local-experts", str(EL), "--top-k", str(K),
              "--tokens", str(T), "--shared-ffn", "0", "--warmup", "1", "--iters", "4", "--recipes", "fp8",
              "--no-gemm", "--no-profile", "--fp8-weight-cache", "--out", str(tmp_path), "--commit", "test"]
    one, two = main(common), main(common + ["--micro-batches", "2"])
    per_iter = [d["recipes"][0]["fp8_weight_quantizations_per_iter"] for d in (one, two)]
    assert per_iter == [2.0, 1.0]  # the fc1 and the fc2 expert groups, once per step
    assert two["env"]["micro_batches_per_step"] == 2 and "_wcache_mb2_" in Path(two["files"][0]).name
    with pytest.raises(SystemExit, match="--micro-batches 3: give a count >= 1 that divides --iters 4"):
        main(common + ["--micro-batches", "3"])


def test_bench_eight_ranks_on_gloo(tmp_path):
    """Issue 7's command on CPU: 8 torchrun processes (gloo), EP8, every recipe; rank 0 writes one results file whose
    dispatch bytes are the formats' and whose routed rows crossed to other ranks."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                        "-m", "fp4moe.bench.moe_layer", "--device", "cpu", "--hidden", str(H), "--ffn", str(F),
                        "--local-experts", str(EL), "--top-k", str(K), "--tokens", str(T), "--shared-ffn", "128",
                        "--warmup", "1", "--iters", "1", "--no-profile", "--no-gemm", "--out", str(tmp_path),
                        "--commit", "test"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (js,) = tmp_path.glob("moe_layer_cpu_ep8_*_test.json")
    doc = json.loads(js.read_text())
    assert doc["env"]["world_size"] == 8 and doc["shape"]["experts"] == 8 * EL
    assert doc["env"]["command"].startswith("python -m torch.distributed.run --nproc-per-node 8 -m fp4moe.bench.moe_layer")
    for row in doc["recipes"]:  # rank 0's own traffic: T*K rows sent, most of them to the 7 other ranks
        codec = "mxfp4" if row["recipe"] == "mxfp4" else "bf16"
        assert row["dispatch_fwd_bytes"] == a2a_payload_bytes(T * K, H, codec)
        assert 0 < row["dispatch_fwd_remote_bytes"] < row["dispatch_fwd_bytes"]
        assert len(row["expert_counts"]) == EL


@pytest.mark.parametrize("args, message", [
    (["--recipes", "bf16,fp9"], "--recipes fp9: 'fp9' is not a recipe; the part before @ / + is one of bf16 / fp8"),
    (["--tokens", "0"], "--tokens 0: give a whole number >= 1"),
    (["--top-k", "9", "--local-experts", "8"], "--top-k 9 > 8 experts"),
    (["--hidden", "1000", "--recipes", "bf16,fp8"], "--hidden 1000: the fp8 recipe's FP8 GEMMs need a multiple of 128"),
    (["--ffn", "96", "--recipes", "mxfp4"], "--ffn 96: the mxfp4 recipe's FP8 GEMMs need a multiple of 128"),
    # torch's own errors before: 'Expected one of cpu, cuda, ...' and, without a GPU, 'Torch not compiled with CUDA'
    (["--device", "tpu"], "--device tpu: not a device this benchmark runs on; give --device cpu, or leave it out"),
])
def test_a_shape_or_recipe_the_layer_cannot_run_is_one_line_before_any_work(tmp_path, args, message):
    """Before, a misspelled recipe was a RecipeError traceback and --tokens 0 a ZeroDivisionError after the run."""
    with pytest.raises(SystemExit) as err:
        main(["--device", "cpu", "--no-gemm", "--no-profile", "--out", str(tmp_path), *args])
    assert str(err.value.code).startswith(message), err.value.code
    assert not list(tmp_path.iterdir())
    # BF16 alone takes any positive size (no FP8 blocks)
    from fp4moe.bench.moe_layer import _check_shape, _parser
    from fp4moe.recipe import Recipe

    _check_shape(_parser().parse_args(["--hidden", "1000", "--ffn", "96"]), [Recipe.preset("bf16")], 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU that is not there")
def test_device_cuda_without_a_gpu_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as err:
        main(["--device", "cuda", "--out", str(tmp_path)])
    assert err.value.code == ("--device cuda: no CUDA GPU here; give --device cpu, or leave it out (cuda when there is "
                              "a GPU, else cpu)")
    assert not list(tmp_path.iterdir())


def test_shape_tag_names_what_differs_from_the_default_shape():
    from fp4moe.bench.moe_layer import _parser, _shape_tag

    assert _shape_tag(_parser().parse_args([])) == ""
    assert _shape_tag(_parser().parse_args(["--tokens", "8192"])) == "_t8192"
    assert _shape_tag(_parser().parse_args(["--local-experts", "16", "--shared-ffn", "0"])) == "_e16_s0"


@pytest.mark.gpu
def test_bench_memtrace_accounts_for_the_measured_peak(tmp_path):
    """--memtrace on a GPU: the allocator history replayed (fp4moe.tracking.memtrace) gives the bytes above the base
    at the peak that max_memory_allocated measured, within the allocator's whole-block slack (1 %), and names the
    sites."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    doc = main(["--hidden", "1024", "--ffn", "256", "--local-experts", "8", "--tokens", "2048", "--shared-ffn", "256",
                "--warmup", "1", "--iters", "2", "--no-profile", "--no-gemm", "--memtrace", "--out", str(tmp_path),
                "--commit", "test"])
    for r in doc["recipes"]:
        mp = r["memory_peak"]
        over = r["peak_over_base_gib"] * 2**30
        assert abs(mp["traced_at_peak_bytes"] - over) <= 0.01 * over, (r["recipe"], mp["traced_at_peak_bytes"], over)
        assert sum(x["bytes"] for x in mp["by_site"]) == mp["traced_at_peak_bytes"]
        assert any("fp4moe/" in x["where"] for x in mp["by_site"])
    assert "Live at mxfp4's peak" in (tmp_path / Path(doc["files"][1]).name).read_text()


def test_bench_main_grads_as_ddp_adds_them_and_fused(tmp_path):
    """--main-grads fp32: the gradients go into one main-gradient buffer as megatron DDP's hook adds them, zeroed
    every --micro-batches iterations; a +fused entry has the experts' wgrad add itself there; its own file and rows
    with ratios; +fused without --main-grads is refused."""
    common = ["--device", "cpu", "--hidden", str(H), "--ffn", str(F), "--local-experts", str(EL), "--top-k", str(K),
              "--tokens", str(T), "--shared-ffn", "0", "--warmup", "1", "--iters", "2", "--micro-batches", "2",
              "--no-gemm", "--no-profile", "--out", str(tmp_path), "--commit", "test"]
    doc = main(common + ["--recipes", "bf16,fp8,fp8+fused,mxfp4+fused", "--main-grads", "fp32"])
    assert doc["env"]["main_grads"] == "fp32" and "_mgfp32_" in Path(doc["files"][0]).name
    assert [(r["recipe"], r["fused_wgrad"]) for r in doc["recipes"]] == [
        ("bf16", False), ("fp8", False), ("fp8+fused", True), ("mxfp4+fused", True)]
    assert {"tokens_per_s fp8+fused/fp8", "tokens_per_s fp8+fused/bf16", "tokens_per_s mxfp4+fused/bf16"} <= set(
        doc["ratios"])
    with pytest.raises(SystemExit, match=r"fp8\+fused: \+fused adds the wgrad into main gradients: give --main-grads"):
        main(common + ["--recipes", "fp8+fused"])


@pytest.mark.gpu
def test_gpu_profile_covers_one_optimizer_step(tmp_path):
    """On a GPU the profile runs over one optimizer step's iterations (the weight quantizer in the first of four, as
    in the timed loop), and the GPU time per iteration is positive and not above the wall time per iteration by
    more than the profiler's own spread; the gpu_time ratio is there."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    doc = main(["--hidden", "1024", "--ffn", "256", "--local-experts", "8", "--tokens", "2048", "--shared-ffn", "256",
                "--warmup", "4", "--iters", "8", "--micro-batches", "4", "--fp8-weight-cache", "--no-gemm",
                "--recipes", "bf16,fp8", "--out", str(tmp_path), "--commit", "test"])
    for r in doc["recipes"]:
        assert 0 < r["gpu_ms_per_iter"] <= 1.2 * r["ms_per_iter"], (r["recipe"], r["gpu_ms_per_iter"], r["ms_per_iter"])
        assert r["profile"]["iterations"] == 4
    assert {"gpu_time fp8/bf16"} <= set(doc["ratios"])


def test_gpu_time_beside_wall_time_with_its_ratios(tmp_path):
    """Profiled entries carry their GPU time per iteration (the profile's total): the table shows it beside the wall
    time, and every pair with a tokens/s ratio also gets a gpu_time ratio (base's GPU ms over the entry's, a
    speed-up); entries without a profile get neither. The rows are a real CPU run's, the GPU times set as a
    profile would (the profiler's CUDA events need a GPU: tests/bench GPU run)."""
    from fp4moe.bench.moe_layer import _markdown, _ratios, _recipe_entries

    common = ["--device", "cpu", "--hidden", str(H), "--ffn", str(F), "--local-experts", str(EL), "--top-k", str(K),
              "--tokens", str(T), "--shared-ffn", "0", "--warmup", "1", "--iters", "2", "--micro-batches", "2",
              "--no-gemm", "--no-profile", "--out", str(tmp_path), "--commit", "test", "--main-grads", "fp32"]
    spec = "bf16,bf16+fused,fp8,fp8+fused,mxfp4"
    doc = main(common + ["--recipes", spec])
    assert not any(k.startswith("gpu_time") for k in doc["ratios"]) and "GPU ms/iter: CUDA" not in _markdown(doc)
    gpu = {"bf16": 20.0, "bf16+fused": 16.0, "fp8": 25.0, "fp8+fused": 20.0, "mxfp4": 12.5}
    for r in doc["recipes"]:
        r["gpu_ms_per_iter"] = gpu[r["recipe"]]
    ratios = _ratios(_recipe_entries(spec, "fp32"), doc["recipes"])
    assert ratios["gpu_time bf16+fused/bf16"] == 20.0 / 16.0
    assert ratios["gpu_time fp8+fused/fp8"] == 25.0 / 20.0 and ratios["gpu_time fp8+fused/bf16"] == 20.0 / 20.0
    assert ratios["gpu_time fp8/bf16"] == 0.8 and ratios["gpu_time mxfp4/fp8"] == 2.0
    assert {k.replace("gpu_time", "tokens_per_s") for k in ratios if k.startswith("gpu_time")} <= set(ratios)
    text = _markdown(dict(doc, ratios=ratios))
    assert "| recipe | ms/iter | GPU ms/iter | tokens/s |" in text and "| fp8+fused | " in text
    row = next(line for line in text.splitlines() if line.startswith("| fp8+fused | "))
    assert row.split(" | ")[2] == "20.00"


def test_bench_wgrad_loop_entries(tmp_path):
    """+wloop / +rowcol / +swq: the entry runs with the wgrad_gemm switch at loop / fp8_row_col at 1 /
    fused_swiglu_fp8 at 1 (recorded per row),
    beside the same entry without it,
    with its ratio to that one; modifiers combine with @ and +fused in any order; a typo is refused by name."""
    common = ["--device", "cpu", "--hidden", str(H), "--ffn", str(F), "--local-experts", str(EL), "--top-k", str(K),
              "--tokens", str(T), "--shared-ffn", "0", "--warmup", "1", "--iters", "2", "--micro-batches", "2",
              "--no-gemm", "--no-profile", "--out", str(tmp_path), "--commit", "test", "--main-grads", "fp32"]
    doc = main(common + ["--recipes", "fp8@loop,fp8@loop+wloop,mxfp4+wloop+fused,fp8@loop+rowcol,fp8@loop+swq,bf16+gsum,bf16+tsum"])
    assert [(r["recipe"], r["grouped_gemm"], r["wgrad_gemm"], r["fused_wgrad"]) for r in doc["recipes"]] == [
        ("fp8@loop", "loop", "triton", False), ("fp8@loop+wloop", "loop", "loop", False),
        ("mxfp4+wloop+fused", "loop", "loop", True), ("fp8@loop+rowcol", "loop", "triton", False),
        ("fp8@loop+swq", "loop", "triton", False), ("bf16+gsum", "loop", "triton", False),
        ("bf16+tsum", "loop", "triton", False)]
    assert [r["fp8_row_col"] for r in doc["recipes"]] == ["0", "0", "0", "1", "0", "0", "0"]
    assert [r["fused_swiglu_fp8"] for r in doc["recipes"]] == ["0", "0", "0", "0", "1", "0", "0"]
    assert [r["gather_sum"] for r in doc["recipes"]] == ["triton"] * 6 + ["torch"]
    assert {"tokens_per_s fp8@loop+wloop/fp8@loop", "tokens_per_s fp8@loop+rowcol/fp8@loop",
            "tokens_per_s fp8@loop+swq/fp8@loop"} <= set(doc["ratios"])
    with pytest.raises(SystemExit, match=r"fp8\+wlop: unknown modifier\(s\) \['wlop'\]; after \+ come fused / gsum / rowcol / swq / tsum / wloop"):
        main(common + ["--recipes", "fp8+wlop"])


@pytest.mark.parametrize("recipe", ["bf16", "fp8", "mxfp4"])
def test_main_grads_hold_the_micro_batches_sum_hooked_or_fused(recipe):
    """MainGrads: after two micro-batches the buffer holds the sum of the two backward passes' gradients (DDP's hook:
    exactly the sum of the .grad each pass would have; fused: the experts' weights added by the GEMM, within the BF16
    rounding the hook adds), every parameter's .grad dropped; close() leaves the parameters as they were."""
    from fp4moe.bench.moe_layer import MainGrads
    from fp4moe.moe.layer import MoELayer

    layer = MoELayer(H, F, EL, K, Recipe.preset(recipe), seed=3)
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(T, H, generator=g).bfloat16() for _ in range(2)]
    dys = [(torch.randn(T, H, generator=g) * 1e-3).bfloat16() for _ in range(2)]
    params = list(layer.parameters())
    want = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    for x, dy in zip(xs, dys):   # the plain gradients of each pass
        layer(x.requires_grad_()).backward(dy)
        for w, p in zip(want, params):
            w += p.grad.double()
            p.grad = None
    for fused in (False, True):
        mg = MainGrads(params, torch.float32, fused=[layer.w1, layer.w2] if fused else ())
        mg.zero()
        for x, dy in zip(xs, dys):
            layer(x.detach().requires_grad_()).backward(dy)
        got = [p.main_grad.double().clone() for p in params]
        assert all(p.grad is None for p in params)
        assert [p.grad_added_to_main_grad for p in params] == [fused and (p is layer.w1 or p is layer.w2)
                                                             for p in params]
        mg.close()
        for w, gg, p in zip(want, got, params):
            if not fused or p is not layer.w1 and p is not layer.w2:
                assert torch.equal(gg, w.float().double()), (fused, p.shape)
            else:   # one rounding (FP32) where the hook adds two BF16-rounded passes
                assert ((gg - w).norm() / w.norm()).item() < 5e-3, p.shape
    assert not any(hasattr(p, "main_grad") for p in params)


def test_host_profile_attributes_each_recipes_python_time(tmp_path):
    """--host-profile: per recipe, the issue time of one optimizer step's iterations and the functions with the most
    own time under cProfile, per iteration, named from their package on (fp4moe's own code among them on CPU, where
    the FP8 arithmetic is Python-driven emulation); the file shows them."""
    doc = main(["--device", "cpu", "--hidden", str(H), "--ffn", str(F), "--local-experts", str(EL), "--top-k",
                str(K), "--tokens", str(T), "--shared-ffn", "0", "--warmup", "1", "--iters", "2", "--micro-batches",
                "2", "--recipes", "bf16,fp8", "--no-gemm", "--no-profile", "--fp8-weight-cache", "--host-profile",
                "--out", str(tmp_path), "--commit", "test"])
    md = Path(doc["files"][1]).read_text()
    for r in doc["recipes"]:
        hp = r["host_profile"]
        assert hp["iterations"] == 2 and hp["issue_ms_per_iter"] > 0 and hp["profiled_ms_per_iter"] > 0
        own = [f["own_ms"] for f in hp["top"]]
        assert len(own) == 25 and own == sorted(own, reverse=True)
        assert sum(own) <= hp["profiled_ms_per_iter"] * (1 + 1e-9)
        assert all(f["cum_ms"] >= f["own_ms"] * (1 - 1e-9) and f["calls"] > 0 for f in hp["top"])
        assert any(f["function"].startswith("fp4moe/") for f in hp["top"]), hp["top"]
        cum = [f["cum_ms"] for f in hp["ours_cumulative"]]
        assert cum == sorted(cum, reverse=True)
        assert all(f["function"].startswith(("fp4moe/", "fp4moe_kernels/")) for f in hp["ours_cumulative"])
        names = [f["function"] for f in hp["ours_cumulative"]]
        assert names[0].endswith("(step)") and any(n.startswith("fp4moe/moe/layer.py:") for n in names)
        assert not any(f["function"].startswith("/") for f in hp["top"])  # no machine's folders in results/
        assert f"## Host {r['recipe']}: {hp['issue_ms_per_iter']:.2f} ms per iteration to issue" in md
    plain = main(["--device", "cpu", "--hidden", str(H), "--ffn", str(F), "--local-experts", str(EL), "--top-k",
                  str(K), "--tokens", str(T), "--shared-ffn", "0", "--warmup", "1", "--iters", "1", "--recipes",
                  "bf16", "--no-gemm", "--no-profile", "--out", str(tmp_path), "--commit", "test"])
    assert "host_profile" not in plain["recipes"][0] and "## Host" not in Path(plain["files"][1]).read_text()


def test_host_profile_names_files_from_their_package_on(monkeypatch):
    from fp4moe.bench.moe_layer import _short_path

    monkeypatch.setattr("sys.path", ["", "/tmp/site", "/tmp"])
    assert _short_path("/tmp/site/triton/runtime/jit.py") == "triton/runtime/jit.py"  # the longest entry holding it
    monkeypatch.setattr("sys.path", [])
    assert _short_path("/usr/lib/python3.12/site-packages/torch/nn/modules/module.py") == "torch/nn/modules/module.py"
    assert _short_path("/home/user/repo/src/fp4moe/ops/grouped_experts.py") == "fp4moe/ops/grouped_experts.py"
    assert _short_path("/home/user/repo/kernels/fp4moe_kernels/launchers.py") == "fp4moe_kernels/launchers.py"
    assert _short_path("/tmp/site/triton/runtime/jit.py") == "/tmp/site/triton/runtime/jit.py"
