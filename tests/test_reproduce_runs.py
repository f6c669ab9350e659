"""fp4moe.reproduce.train_runs: the scaled-down experiments of ``make reproduce-table`` run each cell once, as a real
``fp4moe.train`` subprocess (the tests' byte-level data stands in for the corpus: tests/train/cli.py), tag it in
MLflow, reuse it on the next call, run it again with ``rerun``, and report a failing cell with its log."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("mlflow")

from fp4moe.reproduce import train_runs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAINER = [sys.executable, str(ROOT / "tests" / "train" / "cli.py")]


def test_cpu_plan_is_the_t1_and_f5_shapes():
    cells = train_runs._cpu_plan()
    t1 = [c for c in cells if c.experiment == "reproduce_tiny_t1"]
    f5 = [c for c in cells if c.experiment == "reproduce_tiny_f5"]
    assert len(t1) == 9 and len(f5) == 3 and len({c.key for c in cells}) == 12
    assert {(o.split("=")[1]) for c in t1 for o in c.overrides if o.startswith("recompute=")} == set(train_runs.T1_SCOPES)
    assert all("experiment=tiny_t1_cpu" in c.overrides for c in t1)
    assert all("experiment=tiny_f5_cpu" in c.overrides for c in f5)


def test_a_cell_runs_once_is_reused_then_rerun(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cell = train_runs.Cell("T1 tiny mxfp4 attn_ln_mlp", "reproduce_test",
                           ("model=tiny_cpu", "parallel=cpu", "parallel.seq_length=64", "cluster=cpu",
                            "train=short_cpu", "train.steps=2",
                            "train.eval_interval=null", "train.checkpoint_interval=null", "train.progress_bar=false",
                            "task_name=reproduce_test", "precision=mxfp4", "recompute=attn_ln_mlp",
                            f"paths.log_dir={tmp_path / 'hydra'}", f"train.checkpoint_dir={tmp_path / 'ckpt'}"))
    logs = tmp_path / "logs"
    client = MlflowClient(tracking_uri=uri)
    # an earlier reproduce stopped with this cell (its process killed): its run is still RUNNING in the store
    stale = client.create_run(client.create_experiment("reproduce_test"), tags={train_runs.KEY_TAG: cell.key})
    assert train_runs.run([cell], uri, trainer=TRAINER, log_dir=logs, log=lambda s: None) == (1, 0, [])
    assert client.get_run(stale.info.run_id).info.status == "KILLED"
    # the trainer's output (stdout + stderr): none of megatron-core's known-harmless warnings (fp4moe.known_warnings;
    # this cell recomputes core_attn, so its warning is among them), no other warning, and a rounded final line
    from fp4moe.known_warnings import KNOWN

    output = (logs / f"{cell.key}.log").read_text()
    assert not [k.message for k in KNOWN if re.search(k.message, output)]
    assert "Warning" not in output and "WARNING" not in output, output
    (done,) = [ln for ln in output.splitlines() if "done: " in ln]
    assert re.search(r"done: step 2/2, loss \d+\.\d{4}, eval loss n/a, [\d,]+ tokens/GPU/s \(median\), "
                     r"peak memory n/a; "
                     rf"log {re.escape(str(tmp_path / 'hydra'))}/\S+; checkpoints none written; "
                     rf"MLflow {re.escape(uri)} run [0-9a-f]{{32}}$", done), done
    runs = [r for r in client.search_runs([client.get_experiment_by_name("reproduce_test").experiment_id])
            if r.info.run_id != stale.info.run_id]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    tags = runs[0].data.tags
    assert tags[train_runs.KEY_TAG] == cell.key and tags["recipe"] == "mxfp4" and tags["recompute"] == "attn_ln_mlp"
    assert train_runs.finished_keys(uri, {"reproduce_test"}) == {cell.key}
    assert train_runs.run([cell], uri, trainer=TRAINER, log_dir=logs, log=lambda s: None) == (0, 1, [])
    assert train_runs.run([cell], uri, trainer=TRAINER, log_dir=logs, rerun=True, log=lambda s: None) == (1, 0, [])


def test_a_failing_cell_is_reported_with_its_log(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    bad = train_runs.Cell("typo", "reproduce_test", ("model=tiny_cpu", "precision=fp16", f"paths.log_dir={tmp_path}"))
    ran, reused, failures = train_runs.run([bad], uri, trainer=TRAINER, log_dir=tmp_path / "logs", log=lambda s: None)
    assert (ran, reused, len(failures)) == (1, 0, 1)
    log = tmp_path / "logs" / f"{bad.key}.log"
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("fp4moe.train: ConfigError: ") and "precision" in last  # the trainer's one line
    # the failure line says why (the log's last line) beside where the rest is
    assert failures[0] == f"typo (exit 2: {last[:237] + '...' if len(last) > 240 else last}; {log})"


def test_a_run_loaded_from_an_archive_does_not_stand_in_for_this_machines(tmp_path):
    """results/train_proxy/ archives the runs make reproduce-table measured on an H200, their cell keys included;
    loaded into a store they are shown in the report but are not this machine's: its cells still run."""
    from mlflow import MlflowClient

    from fp4moe.runs import archive

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("reproduce_test")
    here = client.create_run(exp, tags={train_runs.KEY_TAG: "k_here"})
    client.set_terminated(here.info.run_id)
    archived = client.create_run(exp, tags={train_runs.KEY_TAG: "k_archived",
                                            archive.ARCHIVE_FILE: "proxy_t1_reproduce_h200.json"})
    client.set_terminated(archived.info.run_id)
    assert train_runs.finished_keys(uri, {"reproduce_test"}) == {"k_here"}
