"""Pipeline parallelism in ``python -m fp4moe.train`` on CPU: two gloo processes under torchrun, PP=2 (megatron-core's
1F1B schedule, 2 micro-batches per step so that the stages' forward and backward passes interleave), train the
tiny model to the same losses as one process; a PP=2 run killed after its checkpoint resumes to the same losses;
four processes (DP=2 x PP=2) on an uneven ``parallel.pipeline_layout`` (an embedding-only first stage and MTP on
the last, as the paper's) with tied embeddings (their gradient summed over megatron's embedding group) train like
one process too, and so do four processes of PP=2 x DP=2 with EP=2 under mxfp4, and experiment=paper_t1's setting
in small (the same layout with an embedding-only first stage, mxfp4 over every linear, the offloading optimizer),
resumed bit for bit. Every layout starts from the same weights through ``train.layout_invariant_init``."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp4moe.config import ConfigError

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# 3 optimizer steps of 2 micro-batches (micro 2 x 64 tokens, global 4); fp32 parameters, so that the only
# differences between layouts could come from the reduction order. No gradient clipping: megatron's optimizer sums
# the squared norms per stage, so under PP the norm (and a clipping factor below 1) differs from one process's in the
# last bits; unclipped, the layouts' losses match bit for bit on CPU.
COMMON = ["train=short_cpu", "train.params_dtype=fp32", "train.layout_invariant_init=true", "train.steps=4",
          "train.eval_interval=4", "train.eval_steps=1", "train.checkpoint_interval=2", "train.progress_bar=false",
          "train.adamw.grad_clip=null", "parallel.seq_length=64"]
PP2 = ["parallel.world_size=2", "cluster.gpus_per_node=2", "parallel.pipeline=2"]


def _torchrun(tmp_path, overrides, name, nproc=2):
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(HERE / "cli.py"), *COMMON, *PP2, *overrides, f"task_name={name}",
                           f"train.checkpoint_dir={tmp_path / 'ckpt'}", f"hydra.run.dir={tmp_path / name}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def _one_process(tmp_path, monkeypatch, overrides, name="pp1", ckpt="ckpt"):
    """The same run in this process, on one CPU thread as each torchrun process (OMP_NUM_THREADS=1): a CPU matmul
    sums in another order on two threads (rel 3e-6 on the loss after 4 steps). ``name``: its task; ``ckpt``: its
    checkpoint folder under ``tmp_path``."""
    import torch
    from hydra import compose, initialize_config_dir

    from fp4moe.train.loop import train

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*COMMON, *overrides, f"task_name={name}",
                                          f"train.checkpoint_dir={tmp_path / ckpt}"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(cfg)
    finally:
        torch.set_num_threads(threads)


def _run_metrics(tmp_path, name):
    """The one MLflow run of experiment ``name``: its tags and {metric: {step: last value logged}}."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(client.get_experiment_by_name(name).experiment_id)
    out = {}
    for key in ("loss", "grad_norm", "eval_loss", "moe/seq_load_balancing_loss", "saved_activation_bytes_per_micro_batch"):
        hist = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp))
        out[key] = {m.step: m.value for m in hist}
    return run, out


def _shard_ranks(folder):
    """The ranks that wrote shards (``__<rank>_<k>.distcp``) of the sharded checkpoint in ``folder``."""
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["format"] == "torch_dist", meta
    return {n.split("_")[2] for n in meta["files"] if n.endswith(".distcp")}


def test_pp2_killed_and_resumed_equals_one_process(tmp_path, monkeypatch):
    """mxfp4 (the default recipe), PP=2: the run fails at step 3 (after its step-2 checkpoint: each stage writes
    its shards), the same command resumes it from step 2 into the same MLflow run; its losses, gradient norms,
    evaluation loss and MoE aux loss (rank 0 is the first stage, the loss is the last stage's) equal one process's.
    The step-2 checkpoint also resumes in one process (PP2 -> PP1) to one process's losses, bit for bit."""
    r = _torchrun(tmp_path, ["+train.hooks.fail={factory: faults:fail_at_step, step: 3}"], "pp2")
    assert r.returncode != 0 and "faults.fail_at_step: step=3" in r.stderr, r.stderr[-3000:]
    ckpts = tmp_path / "ckpt" / "pp2"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_0000002"]
    assert _shard_ranks(ckpts / "step_0000002") == {"0", "1"}
    r = _torchrun(tmp_path, [], "pp2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr + r.stdout
    run, got = _run_metrics(tmp_path, "pp2")
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
    assert _shard_ranks(ckpts / "step_0000004") == {"0", "1"}

    one = _one_process(tmp_path, monkeypatch, [])
    assert sorted(got["loss"]) == [1, 2, 3, 4]
    assert got["loss"] == one.losses and got["eval_loss"] == one.eval_losses
    assert got["grad_norm"] == pytest.approx(one.grad_norms, rel=1e-6, abs=0)  # summed per stage, then over them
    _, ref = _run_metrics(tmp_path, "pp1")
    assert got["moe/seq_load_balancing_loss"] == pytest.approx(ref["moe/seq_load_balancing_loss"], rel=1e-6)
    # summed over the two stages: the bytes one micro-batch's forward keeps for backward in the whole model
    assert got["saved_activation_bytes_per_micro_batch"][1] == pytest.approx(
        ref["saved_activation_bytes_per_micro_batch"][1], rel=0.01)

    # the PP2 run's step-2 checkpoint (sharded: each stage's layers under their global numbers) goes on in one
    # process, to the same bits
    (tmp_path / "pp_to_one" / "pp2").mkdir(parents=True)
    shutil.copytree(ckpts / "step_0000002", tmp_path / "pp_to_one" / "pp2" / "step_0000002")
    resumed = _one_process(tmp_path, monkeypatch, [], name="pp2", ckpt="pp_to_one")
    assert resumed.start_step == 2 and resumed.run_id == run.info.run_id
    assert resumed.losses == {s: one.losses[s] for s in (3, 4)} and resumed.eval_losses == one.eval_losses


def test_dp2_pp2_uneven_layout_tied_mtp_bf16_equals_one_process(tmp_path, monkeypatch):
    """4 processes, DP=2 x PP=2, precision=bf16 (megatron's own MoE path), micro-batch 1 (2 per DP rank and step),
    tied embeddings and an MTP layer on the paper's kind of layout 'E|ttmL': stage 0 holds the embedding only,
    stage 1 both layers, the MTP block, the final norm and the (tied) output layer, whose copy of the embedding is
    kept in sync through megatron's embedding group. Same losses and MoE aux loss (reduced over the stages and
    the DP ranks) as one process with 4 micro-batches, with the distributed optimizer (each stage shards its own
    parameters over its DP group, the two copies of the tied embedding included; the replicated optimizer under PP
    runs in test_pp2_killed_and_resumed_equals_one_process and test_ep2_dp2_pp2_mxfp4_equals_one_process), its
    gradient reduction and parameter all-gather overlapped, several buckets, and a checkpoint at step 2.

    Stage 1 has no unused output weight (fp4moe.model.gpt_model.drop_unused_output_weight): megatron-core 0.16.1
    allocated one there, which never got a gradient (the overlapped reduction asserted at step 2), made the
    checkpoint's save assert (megatron's sharded state dict, and its GPTModel's own read of the metadata it was
    not given: fp4moe.train.checkpoint passes it) and held 0.5 MB of optimizer state per rank here (a [vocab,
    hidden] weight: 0.93 G parameters at DeepSeek-V3's size); each rank's optimizer and gradient bytes are
    fp4moe.scale.optimizer_state's, exactly."""
    from hydra import compose, initialize_config_dir

    from tests.train.test_optimizer import _assert_bytes_as_predicted

    model = ["precision=bf16", "model.tie_embeddings=true", "model.mtp_num_layers=1", "parallel.micro_batch=1",
             "train.steps=3", "train.eval_interval=3", "train.checkpoint_interval=null"]
    layout = ["parallel.world_size=4", "cluster.gpus_per_node=4", "parallel.data=2",
              "parallel.pipeline_layout='E|ttmL'", "optimizer=distributed", "optimizer.overlap_grad_reduce=true",
              "optimizer.overlap_param_gather=true", "optimizer.bucket_size=20000"]
    r = _torchrun(tmp_path, [*model, *layout, "train.checkpoint_interval=2"], "uneven", nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "ckpt" / "uneven" / "step_0000002" / "meta.json").is_file()
    run, got = _run_metrics(tmp_path, "uneven")
    assert run.data.tags["world_size"] == "4"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        _assert_bytes_as_predicted(run, compose("train", overrides=[*COMMON, *PP2, *model, *layout]))
    one = _one_process(tmp_path, monkeypatch, model)
    _, ref = _run_metrics(tmp_path, "pp1")
    assert sorted(got["loss"]) == [1, 2, 3]
    assert got["loss"] == pytest.approx(one.losses, rel=1e-6, abs=0)
    assert got["eval_loss"] == pytest.approx(one.eval_losses, rel=1e-6, abs=0)
    assert got["moe/seq_load_balancing_loss"] == pytest.approx(ref["moe/seq_load_balancing_loss"], rel=1e-6)


def test_ep2_dp2_pp2_mxfp4_equals_one_process(tmp_path, monkeypatch):
    """The paper's kind of layout (pipeline x expert x data) in small: 4 processes, PP=2 x DP=2 with EP=2 over the DP
    ranks, mxfp4 (MXFP4 payloads through the recipe's all-to-all on each stage), micro-batch 1. Same losses as one
    process (the layout-invariant weights key experts by their global index) within 1e-5: an expert's GEMMs see both
    DP ranks' tokens at once, so fp32 sums run in another order."""
    model = ["parallel.micro_batch=1", "train.steps=3", "train.eval_interval=3", "train.checkpoint_interval=null"]
    r = _torchrun(tmp_path, [*model, "parallel.world_size=4", "cluster.gpus_per_node=4", "parallel.data=2",
                             "parallel.expert=2"], "ep2pp2", nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    run, got = _run_metrics(tmp_path, "ep2pp2")
    assert run.data.metrics["a2a/dispatch_forward_sent_remote_bytes"] > 0
    one = _one_process(tmp_path, monkeypatch, model)
    assert sorted(got["loss"]) == [1, 2, 3]
    assert got["loss"] == pytest.approx(one.losses, rel=1e-5, abs=0)
    assert got["eval_loss"] == pytest.approx(one.eval_losses, rel=1e-5, abs=0)


def test_paper_t1_setting_in_small_trains_like_one_process_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """experiment=paper_t1's setting in small: 4 processes, PP=2 x DP=2 with EP=2 over the DP ranks on the paper's
    kind of layout (an embedding-only first stage, 'E|ttL'), mxfp4 over every linear (precision.scope=all_linears),
    the whole attention block, the layernorms and the experts recomputed, BF16 parameters and megatron's offloading
    optimizer (BF16 main grads) with overlapped gradient reduction and parameter all-gather, micro-batch 1. The
    first stage holds no transformer layer and no MoE layer: the recipe check passes it (it refused it as built
    from another recipe's spec), and its expert optimizer, which holds no parameter, checkpoints (a bare
    AssertionError before, fp4moe.model.cpu_shims 0g).

    3 steps, then step 3 again from the step-2 checkpoint (step 3's removed): the same loss and gradient norm, bit
    for bit. Against one process: step 1's loss within 1e-5 (fp32 sums in another order: an expert's GEMMs see both
    DP ranks' tokens at once); after updates within 1e-3, since the BF16 main grads are summed over the DP ranks in
    BF16 (rel 1.4e-4 measured at step 2)."""
    from mlflow import MlflowClient

    model = ["parallel.micro_batch=1", "train.steps=3", "train.eval_interval=3", "train.params_dtype=bf16",
             "optimizer=offload", "optimizer.overlap_grad_reduce=true", "optimizer.overlap_param_gather=true",
             "+precision.scope=all_linears",
             "precision.recompute_cache_fp4=false", "recompute=attn_block_ln_experts"]
    layout = ["parallel.world_size=4", "cluster.gpus_per_node=4", "parallel.data=2", "parallel.expert=2",
              "parallel.pipeline_layout='E|ttL'"]
    r = _torchrun(tmp_path, [*model, *layout], "paper", nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpts = tmp_path / "ckpt" / "paper"
    assert {"0", "2"} <= _shard_ranks(ckpts / "step_0000002")  # both stages (ranks 0-1, 2-3)
    shutil.rmtree(ckpts / "step_0000003", ignore_errors=True)
    r = _torchrun(tmp_path, [*model, *layout], "paper", nproc=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr + r.stdout
    run, got = _run_metrics(tmp_path, "paper")
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    for key in ("loss", "grad_norm"):
        twice = [m.value for m in client.get_metric_history(run.info.run_id, key) if m.step == 3]
        assert len(twice) == 2 and twice[0] == twice[1], (key, twice)
    assert run.data.metrics["a2a/dispatch_forward_sent_remote_bytes"] > 0
    one = _one_process(tmp_path, monkeypatch, model)
    assert sorted(got["loss"]) == [1, 2, 3]
    assert got["loss"][1] == pytest.approx(one.losses[1], rel=1e-5, abs=0)
    assert got["loss"] == pytest.approx(one.losses, rel=1e-3, abs=0)
    assert got["eval_loss"] == pytest.approx(one.eval_losses, rel=1e-3, abs=0)


@pytest.mark.parametrize("overrides, match", [
    (["parallel.tensor=2"], r"parallel.tensor=2: not supported by fp4moe.train yet"),
    (["parallel.pipeline=2", "parallel.virtual_pipeline=2", "parallel.pipeline_layout='E|t|t|L'"],
     r"parallel.virtual_pipeline=2: the interleaved \(virtual\) pipeline schedule is not supported"),
    (["parallel.pipeline=2", "parallel.pipeline_layout='Et|L'"], r"1 't' layers, model.num_layers = 2"),
    (["parallel.pipeline=2", "parallel.global_batch=3"], r"parallel.global_batch=3 is not a multiple"),
])
def test_pipeline_config_mistakes_are_clear_errors(tmp_path, overrides, match):
    """Refused in preflight, before any process group exists (ConfigError naming the fix)."""
    from hydra import compose, initialize_config_dir

    from fp4moe.train.loop import preflight

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["parallel.world_size=2", "cluster.gpus_per_node=2", *overrides])
    with pytest.raises(ConfigError, match=match):
        preflight(cfg)


def test_even_and_uneven_layouts_pass_preflight(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from fp4moe.train.loop import preflight

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    for layout in ("null", "'Et|tL'", "'E|ttL'", "'Ett|L'"):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[*PP2, f"parallel.pipeline_layout={layout}"])
        assert preflight(cfg)["grad_accum_steps"] == 2
