"""fp4moe.train on CPU (gloo, one process): the tiny model trains under each recipe and MLflow holds the run;
a run stopped by a signal, or killed, resumes to the same losses bit for bit; mistakes are clear errors before
training. Data: the byte-level stand-in of conftest.py (tests/fixtures/sonnets.txt)."""
from __future__ import annotations

import json
import math
import os
import signal
import socket
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from fp4moe.config import ConfigError
from fp4moe.tracking.mlflow_store import TrackingUnavailable

pytest.importorskip("megatron.core")

CONF = Path(__file__).resolve().parents[2] / "conf"


def _compose(tmp_path, *overrides):
    base = ["train=short_cpu", "train.progress_bar=false", f"train.checkpoint_dir={tmp_path / 'ckpt'}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=base + list(overrides))


def _client(uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _history(client, run_id, key):
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


@pytest.mark.parametrize("precision", ["bf16", "fp8", "mxfp4"])
def test_tiny_model_trains_and_mlflow_holds_the_run(tmp_path, store, precision):
    import torch.distributed as dist

    from fp4moe.train.loop import train

    steps = 5
    cfg = _compose(tmp_path, f"precision={precision}", f"train.steps={steps}", "train.eval_interval=3",
                   "train.checkpoint_interval=null")
    r = train(cfg)
    assert not dist.is_initialized()  # torn down
    assert sorted(r.losses) == list(range(1, steps + 1)) and r.stopped_by == 0
    assert all(math.isfinite(v) for v in r.losses.values())
    assert r.losses[1] > 5.5                                   # ~ln(512) at init
    assert r.losses[steps] < r.losses[1] - 0.5                 # it learns the byte statistics
    assert sorted(r.eval_losses) == [3, 5] and r.eval_losses[5] < r.losses[1] - 0.5

    c = _client(store)
    run = c.get_run(r.run_id)
    assert run.info.status == "FINISHED"
    p, tags, last = run.data.params, run.data.tags, run.data.metrics
    assert p["recipe"] == precision and p["precision.name"] == precision and p["model.name"] == "tiny_cpu"
    assert p["train.adamw.lr"] == "0.0003" and p["derived.steps"] == str(steps) and p["train.adamw.betas"] == "[0.9, 0.95]"
    assert p["optimizer.name"] == "gpu_fp32" and p["optimizer.distributed"] == "False"
    assert len(p["git_commit"]) in (40, 7) or p["git_commit"] == "unknown"
    assert tags["megatron_core"] == "0.16.1" and tags["torch_version"].startswith("2.13") and "triton" in tags
    assert tags["device"] == "cpu" and "CPU" in tags["hardware"] and tags["peak_memory"] == "not measured (CPU)"
    assert _history(c, r.run_id, "loss") == r.losses           # bit for bit (float32 -> double)
    assert sorted(_history(c, r.run_id, "lr")) == list(range(1, steps + 1))
    assert sorted(_history(c, r.run_id, "grad_norm")) == list(range(1, steps + 1))
    # measure.warmup_steps = 1 in train/short_cpu: step 1 is not measured
    assert sorted(_history(c, r.run_id, "tokens_per_gpu_per_s")) == list(range(2, steps + 1))
    assert _history(c, r.run_id, "eval_loss") == r.eval_losses
    assert sorted(_history(c, r.run_id, "moe/seq_load_balancing_loss")) == list(range(1, steps + 1))
    assert "peak_mem_allocated_gb" not in last and "summary/peak_mem_allocated_gb" not in last  # CPU: skipped
    assert last["summary/measured_steps"] == steps - 1 and last["summary/tgs_mean"] > 0
    assert last["summary/final_loss"] == r.losses[steps]
    # all-to-all bytes per step (recipe dispatcher only) and the saved bytes of the first micro-batch
    a2a = {k: v for k, v in last.items() if k.startswith("a2a/")}
    # routed rows, every recipe: one rank, so received = sent = 4 x 128 tokens per step x top-2 x 1 MoE layer
    assert a2a.pop("a2a/dispatch_forward_sent_rows") == a2a.pop("a2a/dispatch_forward_received_rows") == 4 * 128 * 2
    if precision == "bf16":
        assert not a2a  # megatron's own dispatcher: no payload bytes counted
    else:
        assert sorted(_history(c, r.run_id, "a2a/dispatch_forward_sent_bytes")) == list(range(1, steps + 1))
        fwd, bwd = a2a["a2a/dispatch_forward_sent_bytes"], a2a["a2a/dispatch_backward_sent_bytes"]
        h = 256  # tiny_cpu hidden: mxfp4 rows are H/2 + H/32 bytes, the BF16 gradient rows 2H
        assert fwd > 0 and (fwd * 2 * h == bwd * (h // 2 + h // 32) if precision == "mxfp4" else fwd == bwd)
    assert sorted(_history(c, r.run_id, "saved_activation_bytes_per_micro_batch")) == [1]
    assert last["saved_activation_bytes_per_micro_batch"] > 0


def test_stop_by_signal_and_kill_then_resume_give_the_same_losses(tmp_path, store):
    """Uninterrupted run A; run B stopped by SIGTERM after step 1 then resumed; run C killed (an exception) after
    step 3 with its last checkpoint at step 2, then resumed. B and C reproduce A's losses bit for bit (BF16
    parameters, fp32 masters and AdamW moments restored), and each continues its own MLflow run.

    B runs with train.checkpoint_interval=null (checkpoints on a signal only; the layout invariants allow it, the
    interval is not part of what is trained): its resumed run ends with a checkpoint at its last step, so that the
    same config again finds it finished (before, it resumed from the stop's checkpoint and trained steps 2-4 again
    into the finished MLflow run). Sequences of 64 tokens: 2 micro-batches of 2 per step, as train=short_cpu."""
    from fp4moe.train.loop import train

    common = ["train.steps=4", "train.checkpoint_interval=2", "train.eval_interval=2", "parallel.seq_length=64"]
    a = train(_compose(tmp_path / "a", *common))
    assert sorted(a.losses) == [1, 2, 3, 4] and sorted(a.eval_losses) == [2, 4]

    def sigterm_at_1(step, metrics):
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    on_signal_only = [*common, "train.checkpoint_interval=null"]
    b1 = train(_compose(tmp_path / "b", *on_signal_only), after_step=sigterm_at_1)
    assert b1.stopped_by == signal.SIGTERM and b1.step == 1 and b1.checkpoint.name == "step_0000001"
    assert signal.getsignal(signal.SIGTERM) == before       # our handler is gone again
    assert _client(store).get_run(b1.run_id).info.status == "KILLED"
    b2 = train(_compose(tmp_path / "b", *on_signal_only))
    assert b2.start_step == 1 and b2.run_id == b1.run_id and sorted(b2.losses) == [2, 3, 4]
    assert b2.step == 4 and b2.checkpoint.name == "step_0000004"  # the end of a resumed run is checkpointed
    assert {**b1.losses, **b2.losses} == a.losses           # bit for bit
    assert b2.eval_losses == a.eval_losses
    again = train(_compose(tmp_path / "b", *on_signal_only))
    assert again.already_finished and again.run_id == b1.run_id and not again.losses

    class Crash(RuntimeError):
        pass

    def crash_at_3(step, metrics):
        if step == 3:
            raise Crash("simulated kill")

    with pytest.raises(Crash):
        train(_compose(tmp_path / "c", *common), after_step=crash_at_3)
    ckpts = sorted(p.name for p in (tmp_path / "c" / "ckpt" / "train").iterdir() if "step_" in p.name)
    assert ckpts == ["step_0000002"]                          # no temporary folder left behind
    c2 = train(_compose(tmp_path / "c", *common))
    assert c2.start_step == 2 and c2.losses == {3: a.losses[3], 4: a.losses[4]}
    # throughput over the run's measured steps, the checkpoint's included: each process skips its first step
    # (short_cpu's measure.warmup_steps = 1), so C's summary holds step 2 (measured before the step-2 checkpoint)
    # and step 4 (after the resume); step 3, measured by the crashed process after that checkpoint, is in the
    # history only (its work was redone)
    assert c2.summary["summary/measured_steps"] == 2 and b2.summary["summary/measured_steps"] == 2
    hist = _history(client := _client(store), c2.run_id, "tokens_per_gpu_per_s")
    assert sorted(hist) == [2, 3, 4] and c2.summary["summary/tgs_mean"] == pytest.approx((hist[2] + hist[4]) / 2)

    run = client.get_run(b2.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
    assert _history(client, b2.run_id, "loss") == a.losses    # the finished run found again logged nothing
    assert _history(client, c2.run_id, "loss") == a.losses    # step 3 logged twice, with the same value


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, store):
    from fp4moe.train.loop import train

    # one bf16 step of 2 x 64 tokens makes the checkpoint; the refusals come before the model is built
    small = ["parallel.global_batch=2", "parallel.seq_length=64", "train.eval_interval=null"]
    train(_compose(tmp_path, *small, "precision=bf16", "train.steps=1", "train.checkpoint_interval=1"))
    # the checkpoint keeps the settings behind its fingerprint: the refusal names what differs, with both values
    with pytest.raises(ConfigError, match=r"belongs to a run with other precision \(precision.name: \"bf16\" in the "
                                          r"checkpoint, \"mxfp4\" here\): resume"):
        train(_compose(tmp_path, *small, "train.steps=4", "precision=mxfp4"))
    with pytest.raises(ConfigError, match=r"train.resume=false but .* holds checkpoints"):
        train(_compose(tmp_path, *small, "train.steps=4", "precision=bf16", "train.resume=false"))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_mlflow_is_a_clear_error_before_training(tmp_path, monkeypatch):
    import torch.distributed as dist

    import fp4moe.train.batches as batches
    from fp4moe.train.loop import train

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setattr(batches, "build_token_datasets", lambda settings: pytest.fail("data built before the store check"))
    with pytest.raises(TrackingUnavailable, match=r"MLflow tracking server http://127.0.0.1:\d+ is not reachable"):
        train(_compose(tmp_path))
    assert not dist.is_initialized() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("overrides, match", [
    (["parallel.data=2"], r"parallel.tensor x pipeline x context x data = 1 x 1 x 1 x 2 = 2 != parallel.world_size=1"),
    (["parallel.world_size=2", "cluster.gpus_per_node=2", "parallel.tensor=2"], r"parallel.tensor=2: not supported"),
    (["train.params_dtype=fp16"], r"train.params_dtype='fp16': pick one of bf16, fp32"),
    (["train.schedule.name=linear"], r"train.schedule.name='linear'"),
    (["precision.name=mxfp5"], r"precision: "),
    (["parallel.seq_length=512"], r"parallel.seq_length=512 > model.max_position_embeddings=256"),
    (["recompute=attn_ln_experts", "recompute.megatron_modules=[core_attn,layernorm]"],
     r"recompute.megatron_modules \['layernorm'\] need Transformer Engine.*move \['layernorm'\] to recompute.fp4moe_modules"),
])
def test_config_mistakes_are_clear_errors(tmp_path, store, overrides, match):
    import torch.distributed as dist

    from fp4moe.train.loop import train

    with pytest.raises(ConfigError, match=match):
        train(_compose(tmp_path, *overrides))
    assert not dist.is_initialized()


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_training(tmp_path, store):
    """train.checkpoint_dir under a file (not creatable), or on a file system without room for one checkpoint: a
    ConfigError naming the folder and the fix before the model is built (before, the run trained every step and
    crashed at its first save). Nothing is created."""
    import shutil

    from fp4moe.train import checkpoint as ckpt
    from fp4moe.train.loop import train

    (tmp_path / "a_file").write_text("")
    with pytest.raises(ConfigError, match=r"checkpoint folder .*a_file/ckpt/train cannot be created: .*a_file is not a "
                                          r"writable folder; point train.checkpoint_dir \(or FP4MOE_CKPT_DIR\)"):
        train(_compose(tmp_path, f"train.checkpoint_dir={tmp_path / 'a_file' / 'ckpt'}"))
    free = shutil.disk_usage(tmp_path).free
    too_many = free // ckpt.CHECKPOINT_BYTES_PER_PARAM + 1
    with pytest.raises(ConfigError, match=r"GB free on its file system, one checkpoint needs up to"):
        ckpt.check_writable(tmp_path / "new" / "run", too_many)
    ckpt.check_writable(tmp_path / "new" / "run", 1000)
    assert not (tmp_path / "new").exists()


def test_world_size_must_match_the_processes(tmp_path, store):
    """A config for 2 processes started as 1 process: ConfigError after init, process group torn down."""
    import torch.distributed as dist

    from fp4moe.train.loop import train

    cfg = _compose(tmp_path, "parallel.world_size=2", "cluster.gpus_per_node=2", "parallel.data=2",
                   "parallel.global_batch=8")
    with pytest.raises(ConfigError, match=r"1 process\(es\) started \(single\) but parallel.world_size=2"):
        train(cfg)
    assert not dist.is_initialized()


def test_sampler():
    from fp4moe.train.batches import micro_batch_indices

    # 2 DP ranks x 2 micro-batches of 3: the global batch of 12 starting at 100 is split without overlap
    got = [micro_batch_indices(100, k, 3, r, 2) for k in range(2) for r in range(2)]
    assert sorted(i for g in got for i in g) == list(range(100, 112))


def test_slurm_task_environment(tmp_path, monkeypatch):
    """A Slurm task (srun, one task): the rendezvous comes from submitit's TorchDistributedEnvironment."""
    from fp4moe.settings import Settings
    from fp4moe.train.dist import init_distributed, teardown

    parallel = Settings.from_config(_compose(tmp_path)).parallel
    assert parallel.world_size == 1

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "SUBMITIT_EXECUTOR"):
        # setenv first, so that monkeypatch records the variable and removes what the export below sets in it
        # (a bare delenv of an absent variable records nothing, and later tests would see RANK/WORLD_SIZE)
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_ID": "0",
             "MASTER_PORT": str(_closed_port())}
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)
    info = init_distributed(parallel)
    try:
        assert (info.launcher, info.rank, info.world_size, info.backend) == ("slurm", 0, 1, "gloo")
        assert os.environ["MASTER_ADDR"] == "localhost" and os.environ["WORLD_SIZE"] == "1"
        assert info.hosts == [socket.gethostname()]   # every rank's host, in rank order
    finally:
        teardown(info)


@pytest.mark.parametrize("launcher", ["slurm", "torchrun"])
def test_one_process_world_needs_no_port(launcher, tmp_path, monkeypatch):
    """A one-task Slurm step (or torchrun with one process) starts even when the port it is given is held by another
    process: a process alone in its world keeps its group on an in-process store and binds nothing (a CI run's
    one-task array job failed with EADDRINUSE)."""
    from fp4moe.settings import Settings
    from fp4moe.train.dist import init_distributed, teardown

    parallel = Settings.from_config(_compose(tmp_path)).parallel
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "SUBMITIT_EXECUTOR"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        if launcher == "slurm":
            env = {"SLURM_JOB_ID": "4243", "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                   "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost",
                   "SLURM_STEP_ID": "0"}
        else:
            env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        for k, v in {**env, "MASTER_PORT": str(held.getsockname()[1])}.items():
            monkeypatch.setenv(k, v)
        info = init_distributed(parallel)
        try:
            assert (info.launcher, info.rank, info.world_size) == (launcher, 0, 1)
        finally:
            teardown(info)


def test_host_tags_name_each_host_once_in_rank_order():
    """The run's ``hosts`` / ``num_hosts`` tags from every rank's host name (two nodes x 2 tasks, then 300 hosts,
    cut to MLflow's tag limit)."""
    from fp4moe.tracking.mlflow_store import MAX_TAG_CHARS
    from fp4moe.train.dist import host_tags

    assert host_tags(["node2", "node2", "node1", "node1"]) == {"hosts": "node2,node1", "num_hosts": "2"}
    many = host_tags([f"gpu-node-{i:04d}.cluster.example.org" for i in range(300)])
    assert many["num_hosts"] == "300" and len(many["hosts"]) == MAX_TAG_CHARS


def test_checkpoint_folders_of_multirun_cells_are_separate(tmp_path):
    from fp4moe.train.checkpoint import fingerprint, run_dir

    cfg = _compose(tmp_path, "task_name=proxy")
    assert run_dir(cfg) == tmp_path / "ckpt" / "proxy"
    assert run_dir(cfg, "precision=bf16,recompute=mla_up_proj") == tmp_path / "ckpt" / "proxy" / "precision=bf16,recompute=mla_up_proj"
    # relative: inside the Hydra job folder (one per cell, reused by a requeued job); outside Hydra: from the cwd
    rel = _compose(tmp_path, "task_name=proxy", "train.checkpoint_dir=ckpt")
    assert run_dir(rel, "precision=bf16", tmp_path / "job0") == tmp_path / "job0" / "ckpt"
    assert run_dir(rel) == Path.cwd() / "ckpt" / "proxy"
    # run length and intervals may change between a run and its resume; what is trained may not
    longer = _compose(tmp_path, "task_name=proxy", "train.steps=99", "train.eval_interval=7")
    assert fingerprint(longer) == fingerprint(cfg)
    other = fingerprint(_compose(tmp_path, "task_name=proxy", "precision=fp8"))
    assert [k for k in other if other[k] != fingerprint(cfg)[k]] == ["precision"]
    # nor how the updated parameters reach the ranks (the same bits): checkpoints from before the switch existed
    # (digest of 1e5a9d4) match either setting
    for opg in ("false", "true"):
        offload = _compose(tmp_path, "task_name=proxy", "optimizer=offload", f"optimizer.overlap_param_gather={opg}")
        assert fingerprint(offload)["optimizer"] == "879845e9eb7cefcf"


def test_profile_window_writes_op_tables_and_a_trace(tmp_path, store):
    """train.profile.steps=[2,3]: torch.profiler runs over steps 2-3 only; the op tables and the Chrome trace are
    written and the run is tagged with where they are. A window that is not [first <= last] is refused. bf16 on 2 x
    64 tokens: the profiler records every op, and on CPU the other recipes emulate FP8/MXFP4 with many more (they
    train in test_tiny_model_trains_and_mlflow_holds_the_run)."""
    from fp4moe.train.loop import train

    out = tmp_path / "prof"
    cfg = _compose(tmp_path, "precision=bf16", "parallel.global_batch=2", "parallel.seq_length=64", "train.steps=4",
                   "train.eval_interval=null", "train.checkpoint_interval=null", "train.profile.steps=[2,3]",
                   f"train.profile.dir={out}")
    r = train(cfg)
    folder = out / "profile_rank0"
    table = (folder / "ops_by_device_time.txt").read_text()
    assert "aten::" in table and "Self CPU" in table
    assert "aten::" in (folder / "ops_by_cpu_time.txt").read_text()
    trace = json.loads((folder / "trace.json").read_text())
    assert trace["traceEvents"]
    tags = _client(store).get_run(r.run_id).data.tags
    assert tags["profile_steps"] == "2-3" and tags["profile_dir"] == str(folder.resolve())
    with pytest.raises(ConfigError, match="train.profile.steps"):
        train(_compose(tmp_path, "train.steps=2", "train.profile.steps=[3,1]"))


def test_meter_carries_a_runs_measurements_across_a_restart():
    """Meter: each process skips its own warm-up steps; a restored state goes before this process's steps, and the
    peaks a checkpoint carries are the largest of every process so far."""
    import torch

    from fp4moe.train.metrics import Meter

    first = Meter(tokens_per_step=1000, world_size=2, warmup=1, measure_steps=None, device=torch.device("cpu"))
    for dt in (9.0, 1.0, 2.0):          # the first step is warm-up
        first.after_step(dt)
    first.peak_alloc, first.peak_reserved = 30.0, 32.0   # as on CUDA
    second = Meter(tokens_per_step=1000, world_size=2, warmup=1, measure_steps=None, device=torch.device("cpu"))
    second.load_state_dict(first.state_dict())
    for dt in (7.0, 4.0):               # warm-up again after the restart, then one measured step
        second.after_step(dt)
    second.peak_alloc, second.peak_reserved = 20.0, 40.0
    s = second.summary()
    assert s["summary/measured_steps"] == 3 and second.step_times == [1.0, 2.0, 4.0]
    assert s["summary/tgs_max"] == 500.0 and s["summary/step_time_median_s"] == 2.0
    assert second.state_dict()["peak_alloc"] == 30.0 and second.state_dict()["peak_reserved"] == 40.0
