"""Sharded checkpoints (fp4moe.train.checkpoint, megatron-core dist_checkpointing, torch_dist) resume at another
parallel layout: a run checkpointed by EP2 x DP2 (2 gloo processes under torchrun, each holding half of the
experts and half of the distributed optimizer's state) goes on in ONE process, and a one-process checkpoint goes on
as EP2 x DP2; the data order (consumed samples), the learning-rate schedule and the MLflow run carry over. A
damaged sharded checkpoint (a shard cut short, a file missing, one unreadable at its full size) is skipped with a
warning; torch's shard index (`.metadata`, a pickle) may name nothing but its own classes."""
from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from fp4moe.train import checkpoint as ckpt

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
CONF = HERE.parents[1] / "conf"
# fp32 parameters (the EP2 x DP2 = one process comparison of test_cli.py), the distributed optimizer (main params
# and moments sharded over DP and, for the experts, over expert-DP), gradient clipping on
COMMON = ["train=short_cpu", "train.params_dtype=fp32", "optimizer=distributed", "parallel.seq_length=64",
          "train.eval_interval=null", "train.checkpoint_interval=2", "train.keep_checkpoints=3",
          "train.progress_bar=false"]
EP2_DP2 = ["parallel.world_size=2", "cluster.gpus_per_node=2", "parallel.data=2", "parallel.expert=2"]


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=[*COMMON, *overrides])


def _torchrun(tmp_path, uri, *overrides):
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(HERE / "cli.py"), *COMMON, *EP2_DP2, *overrides,
                        f"hydra.run.dir={tmp_path / 'out'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # megatron's distributed optimizer over FP32 parameters warns at every zero_grad, and torch 2.13 at each of its
    # collectives: known-harmless, silenced (fp4moe.known_warnings); nothing else warns
    assert "Warning" not in r.stdout + r.stderr, r.stderr[-3000:]
    return r


def _history(uri, run_id, key):
    from mlflow import MlflowClient

    return {m.step: m.value for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)}


def test_ep2_dp2_checkpoint_resumes_on_one_process_and_back(tmp_path, monkeypatch):
    """(1) One process trains 4 steps uninterrupted (checkpoints at 2 and 4). (2) EP2 x DP2 trains 2 steps and
    checkpoints; ONE process resumes that checkpoint to step 4 in the same MLflow run. (3) EP2 x DP2 resumes the
    one-process run's step-2 checkpoint to step 4.

    The resumed runs' losses (and gradient norms, within rel 1e-4) at steps 3 and 4 equal the uninterrupted run's
    within rel 1e-5,
    not bit for bit: at EP2 an expert's GEMMs see both ranks' tokens at once instead of one micro-batch after the
    other, so fp32 sums run in another order (the same 1e-6-level difference as test_cli's EP2 x DP2 = one process,
    with no checkpoint involved). A resume that lost the optimizer's moments, the data order or the schedule is off
    by far more (step 4's loss follows from update 3, which uses the moments of updates 1-2). The learning rates
    are the same bits. Same-layout resumes are bit for bit (test_optimizer.py, test_faults.py)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    from fp4moe.train.loop import train

    one = train(_compose("train.steps=4", "task_name=one", f"train.checkpoint_dir={tmp_path / 'one'}"))
    assert sorted(one.losses) == [1, 2, 3, 4]

    # (2) EP2 x DP2 -> one process
    _torchrun(tmp_path, uri, "train.steps=2", "task_name=ep2", f"train.checkpoint_dir={tmp_path / 'ckpt'}")
    root = tmp_path / "ckpt" / "ep2"
    meta = json.loads((root / "step_0000002" / "meta.json").read_text())
    assert meta["format"] == ckpt.SHARDED and meta["world_size"] == 2 and meta["consumed_samples"] == 8
    assert {"common.pt", ".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(meta["files"])
    first = _history(uri, meta["mlflow_run_id"], "loss")
    assert first == pytest.approx({s: one.losses[s] for s in (1, 2)}, rel=1e-5, abs=0)
    r = train(_compose("train.steps=4", "task_name=ep2", f"train.checkpoint_dir={tmp_path / 'ckpt'}"))
    assert r.start_step == 2 and sorted(r.losses) == [3, 4] and r.run_id == meta["mlflow_run_id"]
    assert r.lrs == {s: one.lrs[s] for s in (3, 4)}
    assert r.losses == pytest.approx({s: one.losses[s] for s in (3, 4)}, rel=1e-5, abs=0)
    # the norm squares and sums every gradient, each already summed in another order at EP2, and step 4's come from
    # weights that update 3 moved by slightly different amounts: rel 4e-5 at step 4 was seen on a 2-core machine
    assert r.grad_norms == pytest.approx({s: one.grad_norms[s] for s in (3, 4)}, rel=1e-4, abs=0)
    assert sorted(_history(uri, r.run_id, "loss")) == [1, 2, 3, 4]  # one MLflow run over both layouts
    assert json.loads((root / "step_0000004" / "meta.json").read_text())["world_size"] == 1

    # (3) one process -> EP2 x DP2, from the uninterrupted run's step-2 checkpoint
    back = tmp_path / "back" / "one"
    back.mkdir(parents=True)
    shutil.copytree(tmp_path / "one" / "one" / "step_0000002", back / "step_0000002")
    _torchrun(tmp_path, uri, "train.steps=4", "task_name=one", f"train.checkpoint_dir={tmp_path / 'back'}")
    got = _history(uri, one.run_id, "loss")
    assert got[1] == one.losses[1] and got[2] == one.losses[2]  # logged by the one-process run
    assert {s: got[s] for s in (3, 4)} == pytest.approx({s: one.losses[s] for s in (3, 4)}, rel=1e-5, abs=0)
    meta4 = json.loads((back / "step_0000004" / "meta.json").read_text())
    assert meta4["world_size"] == 2 and meta4["consumed_samples"] == 16


def test_a_damaged_sharded_checkpoint_is_skipped(tmp_path, monkeypatch, caplog):
    """One process, a sharded checkpoint at steps 1-4. Step 4's shard cut short (meta.json records each file's
    size), step 3's common.pt gone, step 2's shard overwritten at its full size (found while loading): each is
    skipped with a warning naming it, and the run resumes from step 1 to the uninterrupted losses, bit for bit."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    from fp4moe.train.loop import train

    cfg = _compose("parallel.global_batch=2", "train.steps=4", "train.checkpoint_interval=1",
                   "train.keep_checkpoints=4", f"train.checkpoint_dir={tmp_path / 'ckpt'}")
    a = train(cfg)
    root = tmp_path / "ckpt" / "train"
    assert [f.name for f, _ in ckpt.scan(root)[0]] == [f"step_{s:07d}" for s in (4, 3, 2, 1)]
    cut = root / "step_0000004" / "__0_0.distcp"
    size = cut.stat().st_size
    cut.write_bytes(cut.read_bytes()[: size // 2])
    (root / "step_0000003" / "common.pt").unlink()
    bad = root / "step_0000002" / "__0_1.distcp"
    bad.write_bytes(b"\xff" * bad.stat().st_size)
    caplog.set_level(logging.INFO, logger="fp4moe.train")
    b = train(cfg)
    assert b.start_step == 1 and b.run_id == a.run_id and b.losses == {s: a.losses[s] for s in (2, 3, 4)}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "fp4moe.train"]
    assert warned[:2] == [
        f"checkpoint {root / 'step_0000004'} is damaged ({cut} has {size // 2} bytes, {size} were written: "
        "truncated or overwritten); falling back to the newest complete one",
        f"checkpoint {root / 'step_0000003'} is damaged ({root / 'step_0000003' / 'common.pt'} is missing); "
        "falling back to the newest complete one"]
    assert len(warned) == 3 and warned[2].startswith(
        f"checkpoint {root / 'step_0000002'} is damaged ({root / 'step_0000002'} cannot be read: "), warned
    assert warned[2].endswith("; falling back to the previous one")


def test_the_shard_index_may_name_only_torchs_checkpoint_classes(tmp_path):
    """torch's `.metadata` is a pickle that megatron hands to pickle.load: fp4moe reads it first with an unpickler
    that knows torch's checkpoint metadata classes only, so a `.metadata` whose pickle calls os.system is refused,
    naming the global, and the call never runs."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ckpt.Damaged, match=r"\.metadata cannot be read: GLOBAL (posix|os)\.system is not allowed "
                                           r"\(fp4moe does not run code from a checkpoint\)"):
        ckpt.check_sharded_files(tmp_path)
    assert not marker.exists()
    from torch.distributed.checkpoint.metadata import Metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
    ckpt.check_sharded_files(tmp_path)


def test_a_layout_change_is_refused_for_per_rank_checkpoints_only():
    """parallel.* layout keys (world size, DP, EP, PP, micro-batch) may change for a sharded checkpoint; the global
    batch, the sequence length and any other parallel.* key may not; a per-rank checkpoint keeps its layout."""
    from fp4moe.config import ConfigError

    one, ep2 = _compose(), _compose(*EP2_DP2, "parallel.micro_batch=1")
    saved = {"step": 2, "world_size": 2, "fingerprint": ckpt.fingerprint(ep2)}
    here = ckpt.fingerprint(one)
    ckpt.check_compatible(Path("s"), {**saved, "format": ckpt.SHARDED}, world_size=1, fingerprint_=here)
    with pytest.raises(ConfigError, match=r"checkpoint p was written by 2 processes, this run has 1: a per-rank "
                                          r"checkpoint resumes only at its own parallel layout"):
        ckpt.check_compatible(Path("p"), saved, world_size=1, fingerprint_=here)
    with pytest.raises(ConfigError, match=r"belongs to a run with other parallel \(a per-rank checkpoint resumes "
                                          r"only at its own parallel layout\)"):
        ckpt.check_compatible(Path("p"), {**saved, "world_size": 1}, world_size=1, fingerprint_=here)
    other = _compose("parallel.global_batch=8")
    with pytest.raises(ConfigError, match=r"belongs to a run with other parallel: "):
        ckpt.check_compatible(Path("s"), {**saved, "format": ckpt.SHARDED}, world_size=1,
                              fingerprint_=ckpt.fingerprint(other))
    # with the settings in meta.json (since 2026-12-08) the error names the keys that differ, and both values; for a
    # sharded checkpoint not the layout's
    saved["settings"] = ckpt.fingerprinted(ep2)
    with pytest.raises(ConfigError, match=r"belongs to a run with other parallel \(parallel.global_batch: 4 in the "
                                          r"checkpoint, 8 here\): resume with the same config"):
        ckpt.check_compatible(Path("s"), {**saved, "format": ckpt.SHARDED}, world_size=1,
                              fingerprint_=ckpt.fingerprint(other), settings=ckpt.fingerprinted(other))


def test_other_gradient_buckets_resume_a_sharded_checkpoint_only():
    """optimizer.overlap_grad_reduce and optimizer.bucket_size set megatron DDP's gradient buckets: a sharded
    checkpoint (the optimizer state per parameter) resumes with other ones; a per-rank one (each rank's bucket
    shards) does not, and says which key differs. A sharded checkpoint from before the ``optimizer.trained`` entry
    compares the whole optimizer group, as it did when it was written."""
    from fp4moe.config import ConfigError

    buckets = _compose("optimizer=distributed", "optimizer.overlap_grad_reduce=true", "optimizer.bucket_size=100000")
    one = _compose("optimizer=distributed")
    fp, here, settings = ckpt.fingerprint(buckets), ckpt.fingerprint(one), ckpt.fingerprinted(one)
    assert fp["optimizer"] != here["optimizer"] and fp["optimizer.trained"] == here["optimizer.trained"]
    saved = {"step": 2, "world_size": 1, "fingerprint": fp, "settings": ckpt.fingerprinted(buckets)}
    ckpt.check_compatible(Path("s"), {**saved, "format": ckpt.SHARDED}, world_size=1, fingerprint_=here,
                          settings=settings)
    with pytest.raises(ConfigError, match=r"other optimizer \(optimizer.bucket_size: 100000 in the checkpoint, null "
                                          r"here; optimizer.overlap_grad_reduce: true in the checkpoint, false here\)"):
        ckpt.check_compatible(Path("p"), saved, world_size=1, fingerprint_=here, settings=settings)
    older = {k: v for k, v in fp.items() if k != "optimizer.trained"}
    with pytest.raises(ConfigError, match=r"other optimizer \(optimizer.bucket_size: 100000"):
        ckpt.check_compatible(Path("s"), {**saved, "fingerprint": older, "format": ckpt.SHARDED}, world_size=1,
                              fingerprint_=here, settings=settings)
    # what a sharded checkpoint may not change is named even beside a bucket change; no settings: the group only
    fp8 = _compose("optimizer=distributed", "precision=fp8")
    with pytest.raises(ConfigError, match=r"other precision \(precision.name: \"mxfp4\" in the checkpoint, \"fp8\" "
                                          r"here\): "):
        ckpt.check_compatible(Path("s"), {**saved, "format": ckpt.SHARDED}, world_size=1,
                              fingerprint_=ckpt.fingerprint(fp8), settings=ckpt.fingerprinted(fp8))
    with pytest.raises(ConfigError, match=r"other precision: resume"):
        ckpt.check_compatible(Path("s"), {**saved, "format": ckpt.SHARDED, "settings": None}, world_size=1,
                              fingerprint_=ckpt.fingerprint(fp8), settings=ckpt.fingerprinted(fp8))


def test_the_schemas_leave_checkpoint_fingerprints_as_they_were():
    """The nulls the config groups' schemas add for keys not given (fp4moe.settings.ABSENT_WHEN_NULL: the model's,
    precision's) are not part of a checkpoint's fingerprint, so checkpoints written before the schemas (1c177ea)
    resume; a value given (precision.save_fp4=false) is."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg, shared = compose("train"), compose("train", overrides=["precision=mxfp4_mlp_shared"])
        no_fp4_save = compose("train", overrides=["precision.save_fp4=false"])
    fp = ckpt.fingerprint(cfg)
    assert (fp["model"], fp["precision"], fp["recompute"]) == ("ab40599cfafc53c9", "fb8ca8cd925c9fae",
                                                               "be2ef5542c6939d5")
    assert ckpt.fingerprint(shared)["precision"] == "183cbfea88dc458d"
    assert ckpt.fingerprint(no_fp4_save)["precision"] != fp["precision"]
