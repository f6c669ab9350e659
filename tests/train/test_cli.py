"""``python -m fp4moe.train`` as a command: config typos and an unreachable MLflow server are one clear message
and a non-zero exit (no traceback); a run stopped with SIGTERM exits 143 after a checkpoint, and the same command
resumes it into the same MLflow run."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _run(args, tmp_path, env=None, timeout=120):
    e = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", **(env or {})}
    return subprocess.run([sys.executable, *args, f"hydra.run.dir={tmp_path / 'out'}"], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("override, message", [
    ("train.stpes=3", "Key 'stpes' is not in struct"),
    ("precision=mxfp5", "Could not find 'precision/mxfp5'"),
    ("parallel.micro_batch=3", "parallel.global_batch=4 is not a multiple of micro_batch x data = 3 x 1 = 3"),
    ("recompute=attn_ln_experts", "fp4moe_modules ['layernorm', 'moe_expert']"),
])
def test_config_typos_are_one_message(tmp_path, override, message):
    r = _run(["-m", "fp4moe.train", override], tmp_path)
    assert r.returncode != 0
    assert message in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_unreachable_mlflow_server(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _run(["-m", "fp4moe.train"], tmp_path, env={"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"})
    assert r.returncode == 2
    assert f"MLflow tracking server http://127.0.0.1:{port} is not reachable" in r.stderr
    assert "Traceback" not in r.stderr and "step" not in r.stderr  # nothing trained


def test_sigterm_checkpoints_and_the_same_command_resumes(tmp_path):
    from mlflow import MlflowClient

    args = [str(HERE / "cli.py"), "train=short_cpu", "train.steps=12", "train.checkpoint_interval=2",
            "train.eval_interval=null", f"train.checkpoint_dir={tmp_path / 'ckpt'}"]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    cmd = [sys.executable, *args, f"hydra.run.dir={tmp_path / 'out'}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = tmp_path / "ckpt" / "train" / "step_0000002"
    deadline = time.monotonic() + 90
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by signal 15" in out + err
    stopped = max(int(p.name.split("_")[1]) for p in (tmp_path / "ckpt" / "train").glob("step_*"))
    assert 2 <= stopped < 12

    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"resumed from {tmp_path / 'ckpt' / 'train' / f'step_{stopped:07d}'}" in r.stdout + r.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["step"] == 12 and summary["stopped_by"] == 0
    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs(client.get_experiment_by_name("train").experiment_id)
    assert len(runs) == 1 and runs[0].info.run_id == summary["run_id"] and runs[0].info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(summary["run_id"], "loss"))
    assert steps == list(range(1, 13))
