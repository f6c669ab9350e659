"""The distributed optimizer (``parallel.distributed_optimizer=true``): fp32 masters and AdamW moments sharded over the
data-parallel group (dense parameters) and the expert-data-parallel group (routed experts), fp4moe.train.optim.

- The shard layout covers every element of every parameter exactly once over the ranks (property test).
- Two gloo processes (DP=2, BF16 parameters with fp32 masters): the sharded run, killed after a checkpoint and
  resumed, gives the losses and gradient norms of the unsharded run bit for bit, and each rank holds half the
  optimizer state (the ``summary/optimizer_state_bytes`` the trainer logs, from the tensors it keeps).
- Four gloo processes (DP=4 with EP=2 inside it, mxfp4): dense parameters sharded over DP=4, each rank's experts
  over the expert-data-parallel group (EDP=2); the losses are those of the unsharded run.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4moe.train.optim import ShardLayout

HERE = Path(__file__).resolve().parent
# 4 optimizer steps of 2 micro-batches per DP rank; BF16 parameters, so the optimizer keeps fp32 masters
COMMON = ["train=short_cpu", "train.params_dtype=bf16", "train.layout_invariant_init=true", "train.steps=4",
          "train.eval_interval=4", "train.eval_steps=1", "train.checkpoint_interval=2", "train.progress_bar=false",
          "parallel.micro_batch=1", "parallel.global_batch=4"]


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(1, 50), min_size=1, max_size=12), size=st.integers(1, 5),
       bucket=st.integers(1, 80))
def test_shard_layout_covers_every_element_once(numels, size, bucket):
    params = [(10 + i, n) for i, n in enumerate(numels)]  # optimizer indices need not start at 0
    layouts = [ShardLayout(params, size, r, bucket_numel=bucket) for r in range(size)]
    seen = {i: [0] * n for i, n in params}
    for lay in layouts:
        for _, i, a, b in lay.slices:
            for k in range(a, b):
                seen[i][k] += 1
    assert all(c == 1 for counts in seen.values() for c in counts)
    # whole parameters per bucket, in order; a bucket closes at the first parameter that reaches the limit
    buckets = layouts[0].buckets
    assert [i for _, members in buckets for i, _, _ in members] == [i for i, _ in params]
    for padded, members in buckets:
        n = sum(m for _, _, m in members)
        assert padded % size == 0 and n <= padded < n + size
        assert n - members[-1][2] < bucket
    # each rank owns at most its 1/size of every bucket
    assert all(lay.owned_numel <= sum(p for p, _ in buckets) // size for lay in layouts)
    assert sum(lay.owned_numel for lay in layouts) == sum(numels)


def test_shard_layout_rejects_a_rank_outside_the_group():
    with pytest.raises(ValueError, match="rank 2 outside a group of 2"):
        ShardLayout([(0, 4)], 2, 2)


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


def test_dp2_sharded_killed_and_resumed_equals_unsharded(tmp_path):
    dp2 = ["precision=fp8", "parallel.data=2"]
    r = _torchrun(tmp_path, [*dp2, "parallel.distributed_optimizer=false"], "full", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    sharded = [*dp2, "parallel.distributed_optimizer=true"]
    r = _torchrun(tmp_path, [*sharded, "+fault.fail_at_step=3"], "sharded", 2)
    assert r.returncode != 0 and "fault.fail_at_step=3" in r.stderr, r.stderr[-3000:]
    r = _torchrun(tmp_path, sharded, "sharded", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr + r.stdout

    full_run, full = _metrics(tmp_path, "full")
    run, got = _metrics(tmp_path, "sharded")
    assert sorted(got["loss"]) == [1, 2, 3, 4]
    # the gradients are all-reduced as without sharding and AdamW is elementwise: the same bits
    assert got["loss"] == full["loss"]
    assert got["grad_norm"] == full["grad_norm"]
    assert got["eval_loss"] == full["eval_loss"]
    # fp32 master + AdamW m, v: 12 B per parameter, half of them per rank (+ at most one padding element per
    # bucket: dense and experts, one bucket each in the tiny model)
    a = full_run.data.metrics["summary/optimizer_state_bytes"]
    b = run.data.metrics["summary/optimizer_state_bytes"]
    assert a % 12 == 0 and a / 2 <= b <= a / 2 + 2 * 12, (a, b)


def test_dp4_ep2_mxfp4_shards_experts_over_expert_data_parallel(tmp_path):
    """4 processes, DP=4 with EP=2 (megatron carves EP out of DP): dense parameters sharded over DP=4 (a quarter
    each), each rank's experts over EDP=2 (a half each)."""
    layout = ["precision=mxfp4", "parallel.data=4", "parallel.expert=2", "train.checkpoint_interval=null"]
    for name, flag in (("full", "false"), ("sharded", "true")):
        r = _torchrun(tmp_path, [*layout, f"parallel.distributed_optimizer={flag}"], name, 4)
        assert r.returncode == 0, r.stderr[-3000:]
    full_run, full = _metrics(tmp_path, "full")
    run, got = _metrics(tmp_path, "sharded")
    assert sorted(got["loss"]) == [1, 2, 3, 4]
    assert got["loss"] == full["loss"] and got["grad_norm"] == full["grad_norm"]
    # 12 B per parameter: dense ones / 4, the rank's experts / 2 (+ padding: at most 3 + 1 elements)
    a = full_run.data.metrics["summary/optimizer_state_bytes"]
    b = run.data.metrics["summary/optimizer_state_bytes"]
    unsharded, sharded = _model(False), _model(True)
    dense, experts = sharded.dense_params, sharded.expert_params
    assert a == 12 * (dense + experts) == unsharded.optimizer_bytes
    assert 12 * (dense / 4 + experts / 2) <= b <= 12 * (dense / 4 + experts / 2 + 4), (a, b, dense, experts)
    # the memory model (fp4moe.scale.memory) predicts what the trainer holds, up to the padding
    assert sharded.optimizer_bytes <= b <= sharded.optimizer_bytes + 12 * 4


def _model(dist_opt: bool):
    """fp4moe.scale.memory's breakdown of one rank of this test's layout (DP4 with EP2, mxfp4)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from fp4moe.scale.memory import per_gpu_memory

    with initialize_config_dir(config_dir=str(HERE.parents[1] / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["parallel.world_size=4", "cluster.gpus_per_node=4", "parallel.data=4",
                                          "parallel.expert=2", "precision=mxfp4", *COMMON,
                                          f"parallel.distributed_optimizer={str(dist_opt).lower()}"])
    return per_gpu_memory(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)))


@pytest.mark.gpu
@pytest.mark.skipif(not (__import__("torch").cuda.device_count() >= 2), reason="needs two CUDA GPUs")
def test_dp2_sharded_equals_unsharded_on_two_gpus(tmp_path):
    """The same on two GPUs over NCCL (all_gather_into_tensor, AdamW's foreach kernels on the slices): fp8, DP=2,
    the sharded run's losses and gradient norms are the unsharded run's, each GPU holds half the state."""
    dp2 = ["precision=fp8", "parallel.data=2", "train.checkpoint_interval=null"]
    for name, flag in (("full", "false"), ("sharded", "true")):
        r = _torchrun(tmp_path, [*dp2, f"parallel.distributed_optimizer={flag}"], name, 2)
        assert r.returncode == 0, r.stderr[-3000:]
    full_run, full = _metrics(tmp_path, "full")
    run, got = _metrics(tmp_path, "sharded")
    assert run.data.tags["device"] == "cuda" and run.data.tags["world_size"] == "2"
    assert got["loss"] == full["loss"] and got["grad_norm"] == full["grad_norm"]
    a = full_run.data.metrics["summary/optimizer_state_bytes"]
    b = run.data.metrics["summary/optimizer_state_bytes"]
    assert a / 2 <= b <= a / 2 + 2 * 12, (a, b)
