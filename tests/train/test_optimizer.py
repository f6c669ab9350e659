"""megatron-core's optimizer in ``python -m fp4moe.train`` (fp4moe.train.optim), on CPU processes (gloo).

- Every ``optimizer`` group trains the tiny model, and the optimizer state and gradient buffers the trainer holds
  are, byte for byte, what ``fp4moe.scale.optimizer_state`` predicts (on the host for ``offload``).
- A run killed after a checkpoint and resumed gives the uninterrupted run's losses, bit for bit, with megatron's
  distributed optimizer and with its offloading HybridDeviceOptimizer (the per-rank optimizer state round trip).
- Two processes (DP=2): the distributed optimizer (state sharded over the two ranks; gradients reduced during the
  backward in buckets of 1e5 elements, which cut through the layers' experts), killed and resumed, equals megatron's
  unsharded optimizer bit for bit (clipping is off here: megatron sums the squared norms per rank and shard, so the
  norm itself agrees to rounding, rel 1e-5, and a clipping factor would differ in the last bits); each rank holds
  the predicted bytes.
- Four processes (DP=4 with EP=2, mxfp4): dense parameters sharded over DP=4, each rank's experts over the
  expert-data-parallel group of 2; the predicted bytes on the fullest and on the emptiest rank.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fp4moe.scale.optimizer_state import rank_bytes, shard_sizes

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
CONF = HERE.parents[1] / "conf"
SETTINGS = ("gpu_fp32", "distributed", "distributed_bf16_grads", "offload")
# 4 steps of 2 micro-batches of 64 tokens per DP rank; BF16 parameters with FP32 main params
COMMON = ["train=short_cpu", "train.params_dtype=bf16", "train.layout_invariant_init=true", "train.steps=4",
          "train.eval_interval=4", "train.eval_steps=1", "train.checkpoint_interval=2", "train.progress_bar=false",
          "parallel.micro_batch=1", "parallel.global_batch=4", "parallel.seq_length=64"]
KEYS = ("optimizer_state_bytes", "optimizer_state_host_bytes", "grad_buffer_bytes")


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def _predicted(cfg) -> dict[str, list[int]]:
    """``KEYS`` -> the predicted bytes of every rank of ``cfg``'s layout (every pipeline stage, DP and expert-DP
    rank, parameters of ``train.params_dtype``), from the config alone."""
    plain = OmegaConf.to_container(cfg, resolve=True)
    dp, edp = shard_sizes(plain)
    stages = int(cfg.parallel.pipeline)
    params_bytes = 4 if cfg.train.params_dtype == "fp32" else 2
    ranks = [rank_bytes(plain, s, d, d % edp, params_bytes=params_bytes) for s in range(stages) for d in range(dp)]
    return {"optimizer_state_bytes": [r.state_device for r in ranks],
            "optimizer_state_host_bytes": [r.state_host for r in ranks], "grad_buffer_bytes": [r.grads for r in ranks]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(setting)``: (config, result, MLflow store URI) of the 3-step run of optimizer ``setting`` with
    no checkpoints, trained once per module (test_every_setting_trains_and_holds_the_predicted_bytes reads it, and
    test_killed_and_resumed_equals_uninterrupted resumes against it)."""
    from fp4moe.train.loop import train

    folder = tmp_path_factory.mktemp("uninterrupted")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    runs = {}

    def get(setting):
        if setting not in runs:
            cfg = _compose(*COMMON, "train.checkpoint_interval=null", "train.eval_interval=null", "train.steps=3",
                           f"optimizer={setting}", f"task_name={setting}", f"train.checkpoint_dir={folder / 'ckpt'}")
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("MLFLOW_TRACKING_URI", uri)
                runs[setting] = (cfg, train(cfg))
        return (*runs[setting], uri)

    return get


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_setting_trains_and_holds_the_predicted_bytes(uninterrupted, setting):
    from mlflow import MlflowClient

    cfg, r, uri = uninterrupted(setting)
    assert r.losses[3] < r.losses[1] - 0.3, r.losses
    want = _predicted(cfg)
    for key in KEYS:
        assert r.summary[f"summary/{key}"] == r.summary[f"summary/{key}_min"] == want[key][0], key
    held = r.summary["summary/optimizer_state_bytes"] + r.summary["summary/optimizer_state_host_bytes"]
    assert held > 0 and (r.summary["summary/optimizer_state_host_bytes"] > 0) == (setting == "offload")
    run = MlflowClient(tracking_uri=uri).get_run(r.run_id)
    assert run.data.tags["optimizer"] == run.data.params["optimizer.name"] == setting
    assert run.data.params["optimizer.distributed"] == str(setting != "gpu_fp32")


def test_bf16_main_grads_have_the_fp32_norm_of_their_values(uninterrupted):
    """megatron's global gradient norm (logged, and the clipping factor) with BF16 main grads reads each gradient in
    FP32 (fp4moe.model.cpu_shims 0h), as apex's kernel does: megatron's own stand-in without apex rounded every
    per-tensor norm to BF16 (one process, mxfp4: 2.390625 where FP32 main grads give 2.38772). Step 1, before the
    settings' updates differ: the norms differ only by the gradients' BF16 rounding (rel 2e-6 there)."""
    _, fp32, _ = uninterrupted("gpu_fp32")
    for setting in ("distributed_bf16_grads", "offload"):
        _, bf16, _ = uninterrupted(setting)
        assert bf16.grad_norms[1] == pytest.approx(fp32.grad_norms[1], rel=1e-4, abs=0), setting


@pytest.mark.parametrize("setting", ["distributed", "offload"])
def test_killed_and_resumed_equals_uninterrupted(tmp_path, store, uninterrupted, setting):
    """The run fails at step 2 after its step-1 checkpoint and resumes from it: steps 2-3 give the uninterrupted
    run's losses and gradient norms bit for bit (step 3's loss follows from update 2, which uses update 1's moments;
    intervals are not part of what is trained, so the uninterrupted run needs no checkpoint)."""
    from fp4moe.train.loop import train

    _, full, _ = uninterrupted(setting)
    resumed = [*COMMON, "train.checkpoint_interval=1", "train.eval_interval=null", "train.steps=3",
               f"optimizer={setting}", "task_name=resumed", f"train.checkpoint_dir={tmp_path / 'b'}"]
    with pytest.raises(RuntimeError, match="faults.fail_at_step: step=2"):
        train(_compose(*resumed, "+train.hooks.fail={factory: faults:fail_at_step, step: 2}"))
    r = train(_compose(*resumed))
    assert r.start_step == 1 and sorted(r.losses) == [2, 3]
    assert {s: full.losses[s] for s in (2, 3)} == r.losses
    assert {s: full.grad_norms[s] for s in (2, 3)} == r.grad_norms


def _torchrun(tmp_path, overrides, name, nproc):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(HERE / "cli.py"), *COMMON, f"parallel.world_size={nproc}",
                           f"cluster.gpus_per_node={nproc}", *overrides, f"task_name={name}",
                           f"train.checkpoint_dir={tmp_path / 'ckpt'}", f"hydra.run.dir={tmp_path / name}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _metrics(tmp_path, name):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(client.get_experiment_by_name(name).experiment_id)
    out = {}
    for key in ("loss", "grad_norm", "eval_loss"):
        hist = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))
        out[key] = {m.step: m.value for m in hist}
    return run, out


def _assert_predicted(run, overrides):
    _assert_bytes_as_predicted(run, _compose(*COMMON, *overrides))


def _assert_bytes_as_predicted(run, cfg):
    """The MLflow ``run``'s summary (largest and smallest rank) of every ``KEYS`` entry is :func:`_predicted`'s for
    ``cfg``, the run's composed config."""
    want = _predicted(cfg)
    m = run.data.metrics
    for key in KEYS:
        assert (m[f"summary/{key}"], m[f"summary/{key}_min"]) == (max(want[key]), min(want[key])), key


def test_dp2_distributed_killed_and_resumed_equals_unsharded(tmp_path):
    """DP=2, fp8: megatron's distributed optimizer with overlapped gradient reduction and parameter all-gather (the
    lab's setting: the updated shards gathered during the next forward, bucket after bucket by megatron's forward
    pre-hooks), killed after step 3 and resumed from step 2's checkpoint, written with no forward between the
    update and the save: the same losses as the unsharded optimizer, bit for bit. Before the gather was
    fp4moe's to handle: the experts' and the shared expert's forwards read weights of modules they do not call, so
    megatron's pre-hooks never awaited their all-gather (step 2 computed with step 1's expert weights; with other
    bucket sizes megatron's next dispatch asserted: fp4moe.model.recipe_moe.await_parameters), and the checkpoint
    held the other rank's shards as before step 2's update (the resumed step 3 differed: fp4moe.train.optim.
    gather_updated_params).

    The resumed run has other gradient buckets (megatron's one bucket, no overlapped reduction): the sharded
    checkpoint holds the optimizer state per parameter, so it resumes (fp4moe.train.checkpoint.SCHEDULING_KEYS),
    with the same bits at DP2 (a sum of two gradients has one order)."""
    dp2 = ["precision=fp8", "parallel.data=2", "train.adamw.grad_clip=null"]
    r = _torchrun(tmp_path, [*dp2, "optimizer=gpu_fp32"], "full", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    gather = [*dp2, "optimizer=distributed", "optimizer.overlap_param_gather=true"]
    buckets = ["optimizer.overlap_grad_reduce=true", "optimizer.bucket_size=100000"]
    r = _torchrun(tmp_path, [*gather, *buckets, "+train.hooks.fail={factory: faults:fail_at_step, step: 3}"],
                  "sharded", 2)
    assert r.returncode != 0 and "faults.fail_at_step: step=3" in r.stderr, r.stderr[-3000:]
    r = _torchrun(tmp_path, gather, "sharded", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr + r.stdout
    _, full = _metrics(tmp_path, "full")
    run, got = _metrics(tmp_path, "sharded")
    assert sorted(got["loss"]) == [1, 2, 3, 4]
    # the same gradients reach an elementwise AdamW on shards instead of whole parameters: the same bits
    assert got["loss"] == full["loss"] and got["eval_loss"] == full["eval_loss"]
    # megatron's norm: fp32 sums of squares per rank and shard, then over the ranks (measured: rel 2e-6)
    assert got["grad_norm"] == pytest.approx(full["grad_norm"], rel=1e-5, abs=0)
    _assert_predicted(run, [*gather, "parallel.world_size=2", "cluster.gpus_per_node=2"])  # the resumed process's
    assert run.data.params["optimizer.overlap_param_gather"] == "True"
    assert run.data.tags["resume.changed_params"] == "optimizer.bucket_size,optimizer.overlap_grad_reduce"


def test_dp4_ep2_shards_experts_over_expert_data_parallel(tmp_path):
    """4 processes, DP=4 with EP=2 (megatron carves EP out of DP), mxfp4, the lab's offload setting: the host holds
    each rank's quarter of the dense state and half of its experts' (expert-data-parallel group of 2)."""
    layout = ["precision=mxfp4", "parallel.data=4", "parallel.expert=2", "train.checkpoint_interval=null",
              "optimizer=offload"]
    r = _torchrun(tmp_path, layout, "offload", 4)
    assert r.returncode == 0, r.stderr[-3000:]
    run, got = _metrics(tmp_path, "offload")
    assert sorted(got["loss"]) == [1, 2, 3, 4] and got["loss"][4] < got["loss"][1]
    assert run.data.metrics["summary/optimizer_state_bytes"] == 0
    _assert_predicted(run, [*layout, "parallel.world_size=4", "cluster.gpus_per_node=4"])


def test_fp8_weight_cache_trains_bit_for_bit_quantizing_each_weight_once_per_step(tmp_path, store):
    """train.fp8_weight_cache (fp4moe.ops.weight_cache) changes no bit of the run and makes one quantizer pass per
    FP8 weight and optimizer step: 4 micro-batches x (forward + dgrad) = 8 requests, 1 pass, 7 reuses. Every linear
    in FP8 (experts, shared expert, attention, dense MLP; MLA's kv_down, 256 -> 160, stays BF16)."""
    from fp4moe.ops.weight_cache import CACHE
    from fp4moe.scale.memory import per_stage_memory
    from fp4moe.train.loop import train

    base = [*COMMON, "train.checkpoint_interval=null", "train.eval_interval=null", "train.steps=2", "precision=mxfp4",
            "+precision.scope=all_linears"]
    plain = train(_compose(*base, "task_name=plain", f"train.checkpoint_dir={tmp_path / 'a'}"))
    cached = train(_compose(*base, "task_name=cached", "train.fp8_weight_cache=true",
                            f"train.checkpoint_dir={tmp_path / 'b'}"))
    assert cached.losses == plain.losses and cached.grad_norms == plain.grad_norms
    misses, hits = CACHE.stats.misses, CACHE.stats.hits
    assert not CACHE.enabled and CACHE.bytes() == 0  # the trainer turned it off and freed the copies
    assert misses > 0 and misses % 2 == 0 and hits == 7 * misses, (misses, hits)
    # the copies it held, byte for byte what fp4moe.scale.memory predicts for this config (0 without the cache)
    predicted = [per_stage_memory(_compose(*base, f"train.fp8_weight_cache={on}"))[0].fp8_weight_cache_bytes
                 for on in ("true", "false")]
    only_experts = per_stage_memory(_compose(*base[:-1], "train.fp8_weight_cache=true"))[0].fp8_weight_cache_bytes
    assert cached.summary["summary/fp8_weight_cache_bytes"] == predicted[0] > only_experts > 0
    assert plain.summary["summary/fp8_weight_cache_bytes"] == 0 == predicted[1]


@pytest.mark.parametrize("setting", ["gpu_fp32", "distributed_bf16_grads"])
def test_wgrad_accumulation_fusion_trains_as_ddps_hook_does(tmp_path, store, setting):
    """train.wgrad_accumulation_fusion: the routed experts' wgrad is added into megatron DDP's main_grad (FP32, or
    BF16 under the precision-aware optimizer) by the GEMM instead of DDP's hook adding each micro-batch's BF16
    gradient. The same first loss; gradient norms and the next loss within the hook's BF16 rounding (4
    micro-batches per step), so nowhere near twice the experts' gradient (no double accumulation), and the next
    loss not equal (the fusion ran: one rounding where the hook rounds twice)."""
    from fp4moe.train.loop import train

    base = [*COMMON, "train.checkpoint_interval=null", "train.eval_interval=null", "train.steps=2", "precision=mxfp4",
            f"optimizer={setting}"]
    hook = train(_compose(*base, "task_name=hook", "train.wgrad_accumulation_fusion=false",
                          f"train.checkpoint_dir={tmp_path / 'a'}"))
    fused = train(_compose(*base, "task_name=fused", "train.wgrad_accumulation_fusion=true",
                           f"train.checkpoint_dir={tmp_path / 'b'}"))
    assert fused.losses[1] == hook.losses[1]
    for s in (1, 2):
        assert abs(fused.grad_norms[s] / hook.grad_norms[s] - 1) < 2e-3, (s, fused.grad_norms, hook.grad_norms)
    assert fused.losses[2] != hook.losses[2] and abs(fused.losses[2] / hook.losses[2] - 1) < 1e-3


def test_wgrad_accumulation_fusion_takes_megatrons_linears_and_keeps_the_tied_embeddings_lookup(tmp_path, store,
                                                                                              monkeypatch):
    """bf16 on megatron-core's own layers with tied embeddings: the fusion (the default) turns on megatron's
    gradient_accumulation_fusion in its linears, which add their weight gradients into DDP's main_grad through
    fp4moe's stand-in for apex's extension (called: the real arithmetic, counted); the output layer, whose weight is
    the embedding's, adds into the same main gradient as the embedding lookup's autograd gradient, which is not lost
    (zero_out_wgrad): the same first loss, gradient norms and later losses within the hook's rounding."""
    from fp4moe.ops import wgrad_accumulation
    from fp4moe.train.loop import train

    calls = {"fp32": 0}
    real = wgrad_accumulation.wgrad_gemm_accum_fp32

    def counted(*args):
        calls["fp32"] += 1
        return real(*args)

    monkeypatch.setattr(wgrad_accumulation, "wgrad_gemm_accum_fp32", counted)
    base = [*COMMON, "train.checkpoint_interval=null", "train.eval_interval=null", "train.steps=3", "precision=bf16",
            "model.tie_embeddings=true"]
    hook = train(_compose(*base, "task_name=hook", "train.wgrad_accumulation_fusion=false",
                          f"train.checkpoint_dir={tmp_path / 'a'}"))
    assert calls["fp32"] == 0
    fused = train(_compose(*base, "task_name=fused", f"train.checkpoint_dir={tmp_path / 'b'}"))
    assert calls["fp32"] > 0   # megatron's linears went through the stand-in
    assert fused.losses[1] == hook.losses[1]
    for s in (1, 2, 3):
        assert abs(fused.grad_norms[s] / hook.grad_norms[s] - 1) < 2e-3, (s, fused.grad_norms, hook.grad_norms)
    assert abs(fused.losses[3] / hook.losses[3] - 1) < 1e-3, (fused.losses, hook.losses)
