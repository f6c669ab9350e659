"""Damaged checkpoints, finished runs and safe loading (fp4moe.train.checkpoint): a truncated rank file, a corrupt or
missing meta.json (the commit marker) or an unreadable rank file make the trainer warn with the folder and resume
from the newest whole checkpoint, to the same losses; with none whole, one ConfigError naming the folder and the
fix. A run whose checkpoint is at its last step says so and trains nothing. Rank files load with
``weights_only=True``: a pickled call in one is refused, not run."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from fp4moe.config import ConfigError
from fp4moe.train import checkpoint as ckpt

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
CONF = HERE.parents[1] / "conf"


def _fake_checkpoint(root: Path, step: int, *, sizes: bool = True) -> Path:
    """A step folder as ckpt.save writes it, one rank, a small payload (meta.json with or without the sizes)."""
    d = root / f"step_{step:07d}"
    d.mkdir(parents=True)
    torch.save({"step": step, "w": torch.arange(1000.0)}, d / "rank_00000.pt")
    meta = {"step": step, "consumed_samples": 4 * step, "world_size": 1, "fingerprint": {}}
    if sizes:
        meta["files"] = {"rank_00000.pt": (d / "rank_00000.pt").stat().st_size}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_scan_tells_whole_from_damaged_checkpoints(tmp_path):
    root = tmp_path / "run"
    for step in (1, 2, 3, 4, 5, 6):
        _fake_checkpoint(root, step, sizes=step != 6)
    _truncate(root / "step_0000003" / "rank_00000.pt")           # shorter than meta.json says
    (root / "step_0000004" / "meta.json").write_text('{"step": 4, ')   # cut mid-write
    (root / "step_0000005" / "meta.json").unlink()               # no commit marker
    _truncate(root / "step_0000006" / "rank_00000.pt")           # an older meta.json without sizes: zip check
    (root / ".step_0000007.tmp").mkdir()                         # a save in progress: not a step folder
    whole, damaged = ckpt.scan(root)
    assert [f.name for f, _ in whole] == ["step_0000002", "step_0000001"] and whole[0][1]["step"] == 2
    why = dict((f.name, w) for f, w in damaged)
    assert list(why) == ["step_0000006", "step_0000005", "step_0000004", "step_0000003"]
    assert why["step_0000006"] == f"{root}/step_0000006/rank_00000.pt is not a whole torch.save archive (truncated?)"
    assert why["step_0000005"].startswith(f"{root}/step_0000005 has no meta.json (the commit marker")
    assert why["step_0000004"].startswith(f"{root}/step_0000004/meta.json cannot be read as JSON (")
    assert why["step_0000003"].startswith(f"{root}/step_0000003/rank_00000.pt has ")
    assert why["step_0000003"].endswith("were written: truncated or overwritten")
    # read_meta names the file (before: a bare JSONDecodeError)
    with pytest.raises(ConfigError, match=r"step_0000004/meta.json cannot be read as JSON \(Expecting"):
        ckpt.read_meta(root / "step_0000004")
    err = ckpt.none_usable(root, damaged)
    assert str(err).startswith(f"no usable checkpoint in {root} (4 damaged: ")
    assert "move its step_* folders elsewhere (or delete them) to start again from step 0" in str(err)


def test_rank_files_load_without_running_their_code(tmp_path):
    """weights_only=True: a rank file whose pickle calls os.system is refused, naming the global, and the call never
    runs; the classes of SAFE_GLOBALS (megatron's HybridDeviceOptimizer keeps torch's AdamW class in its
    param_groups) and an older checkpoint's numpy RNG key still load; an unreadable file is Damaged."""
    import numpy as np

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    d = tmp_path / "step_0000001"
    d.mkdir()
    torch.save({"step": 1, "x": Payload()}, d / "rank_00000.pt")
    with pytest.raises(ckpt.Damaged, match=r"rank_00000.pt cannot be read: .*GLOBAL (posix|os).system.* "
                                           r"\(weights_only: fp4moe does not run code"):
        ckpt.read_payload(d, 0)
    assert not marker.exists()
    torch.save({"step": 1, "param_groups": [{"cpu_optimizer_cls": torch.optim.AdamW}],
                "rng": {"numpy": np.random.get_state()}}, d / "rank_00000.pt")
    p = ckpt.read_payload(d, 0)
    assert p["param_groups"][0]["cpu_optimizer_cls"] is torch.optim.AdamW
    assert (p["rng"]["numpy"][1] == np.random.get_state()[1]).all()
    data = bytearray((d / "rank_00000.pt").read_bytes())
    data[:64] = b"\0" * 64  # same size, the first record's header gone
    (d / "rank_00000.pt").write_bytes(bytes(data))
    with pytest.raises(ckpt.Damaged, match=r"rank_00000.pt cannot be read: "):
        ckpt.read_payload(d, 0)


def test_save_records_sizes_keeps_whole_checkpoints_and_loads_safely(tmp_path):
    """ckpt.save (one process, the per-rank format): meta.json records the rank file's size; pruning keeps the newest ``keep`` whole
    checkpoints (a damaged newer folder does not count, damaged older ones go); the rank file reads back with
    weights_only=True, numpy's RNG state included."""
    import numpy as np

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    root = tmp_path / "run"
    for step in (1, 9):  # damaged: no commit marker
        (root / f"step_{step:07d}").mkdir(parents=True)
    for step in (2, 3, 4):
        d = ckpt.save(root, step=step, consumed_samples=4 * step, rank=0, world_size=1, model=model, optimizer=opt,
                      schedule=sched, mlflow_run_id="r", fingerprint_={}, keep=2, format_="per_rank")
    assert sorted(p.name for p in root.iterdir()) == ["step_0000003", "step_0000004", "step_0000009"]
    meta = ckpt.read_meta(d)
    assert meta["files"] == {"rank_00000.pt": (d / "rank_00000.pt").stat().st_size}
    key = np.random.get_state()[1].copy()
    np.random.rand(3)
    ckpt.set_rng_state(ckpt.read_payload(d, 0)["rng"])
    assert (np.random.get_state()[1] == key).all()


def _compose(tmp_path, *overrides):
    base = ["train=short_cpu", "precision=bf16", "parallel.global_batch=2", "parallel.seq_length=64",
            "train.progress_bar=false", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
            "train.eval_interval=null", "train.checkpoint_interval=1", "train.keep_checkpoints=3"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=base + list(overrides))


def test_damaged_newest_checkpoints_fall_back_and_a_finished_run_trains_nothing(tmp_path, store, caplog):
    """The per-rank format (train.checkpoint_format=per_rank; the sharded one: test_checkpoint_layout.py). A run of 2
    steps with a checkpoint at each. The same run again: already finished (nothing trained, nothing
    logged to MLflow; before, it reopened the run and logged its old throughput as a new summary). Then a step-3
    folder whose rank file is truncated and step 2's rank file unreadable at its full size, and train.steps=3:
    the trainer warns about each and resumes from step 1 to the same loss, bit for bit. Every step folder
    damaged: one ConfigError naming the folder and the fix."""
    import shutil

    from mlflow import MlflowClient

    from fp4moe.train.loop import train

    a = train(_compose(tmp_path, "train.steps=2", "train.checkpoint_format=per_rank"))
    root = tmp_path / "ckpt" / "train"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_0000001", "step_0000002"]
    client = MlflowClient(tracking_uri=store)
    before = client.get_run(a.run_id).data.metrics

    caplog.set_level(logging.INFO, logger="fp4moe.train")
    again = train(_compose(tmp_path, "train.steps=2", "train.checkpoint_format=per_rank"))
    assert again.already_finished and again.start_step == again.step == 2 and not again.losses
    assert again.run_id == a.run_id and again.checkpoint == root / "step_0000002" and not again.summary
    assert f"already finished at step 2/2 (checkpoint {root / 'step_0000002'}); nothing to train" in caplog.text
    run = client.get_run(a.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics == before and "resume.count" not in run.data.tags

    step3 = root / "step_0000003"  # as a save of step 3 would have left it, its rank file then cut short
    shutil.copytree(root / "step_0000002", step3)
    meta = json.loads((step3 / "meta.json").read_text())
    (step3 / "meta.json").write_text(json.dumps({**meta, "step": 3}))
    _truncate(step3 / "rank_00000.pt")
    cut = (step3 / "rank_00000.pt").stat().st_size
    data = bytearray((root / "step_0000002" / "rank_00000.pt").read_bytes())
    data[:64] = b"\0" * 64  # passes the size and zip checks; torch cannot read it
    (root / "step_0000002" / "rank_00000.pt").write_bytes(bytes(data))
    caplog.clear()
    b = train(_compose(tmp_path, "train.steps=3", "train.checkpoint_format=per_rank"))
    # step 2's loss comes from the weights after update 1, whose lr (warm-up) does not depend on train.steps
    assert b.start_step == 1 and b.run_id == a.run_id and sorted(b.losses) == [2, 3] and b.losses[2] == a.losses[2]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "fp4moe.train"]
    assert warned == [
        f"checkpoint {step3} is damaged ({step3}/rank_00000.pt has {cut} "
        f"bytes, {meta['files']['rank_00000.pt']} were written: truncated or overwritten); falling back to the "
        "newest complete one",
        f"checkpoint {root / 'step_0000002'} is damaged ({root / 'step_0000002'}/rank_00000.pt cannot be read: "
        "Unsupported operand 0); falling back to the previous one"]
    assert ckpt.scan(root)[1] == []  # steps 2 and 3 written again

    for step in (1, 2, 3):
        (root / f"step_{step:07d}" / "meta.json").unlink()
    with pytest.raises(ConfigError, match=rf"no usable checkpoint in {root} \(3 damaged: {step3} has no meta.json "
                                          r".*move its step_\* folders elsewhere"):
        train(_compose(tmp_path, "train.checkpoint_format=per_rank"))


def test_the_command_says_a_finished_run_is_finished(tmp_path):
    """``python -m fp4moe.train`` on a finished run's checkpoint folder: one line saying so, exit 0, and no "done:"
    line with the old tokens/GPU/s and "loss None" as if measured now."""
    root = tmp_path / "ckpt" / "train"
    d = _fake_checkpoint(root, 3)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["train=short_cpu", "train.steps=3"])
    meta = json.loads((d / "meta.json").read_text())
    meta["fingerprint"] = ckpt.fingerprint(cfg)
    (d / "meta.json").write_text(json.dumps(meta))
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    r = subprocess.run([sys.executable, str(HERE / "cli.py"), "train=short_cpu", "train.steps=3",
                        f"train.checkpoint_dir={tmp_path / 'ckpt'}", f"hydra.run.dir={tmp_path / 'out'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"already finished at step 3/3 (checkpoint {d}); nothing to train" in r.stdout + r.stderr
    assert "done:" not in r.stdout + r.stderr and "Traceback" not in r.stderr
