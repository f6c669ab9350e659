"""fp4moe.train.attempt's records: ``attempt.json`` names the attempt holding the folder, ``attempts.jsonl`` keeps one
line per attempt with every rank's host (where each attempt of a requeued job ran)."""
from __future__ import annotations

import json

from fp4moe.train import attempt


def test_each_attempt_appends_its_rank_hosts_and_slurm_restart(tmp_path, monkeypatch):
    for var in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_CLUSTER_NAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[1-2]")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    with attempt.claim(tmp_path, hosts=["node1", "node2"]) as a:
        a.record("run-1", "sqlite:///x.db")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[2-3]")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with attempt.claim(tmp_path, hosts=["node2", "node3"]) as a:
        assert a.previous["rank_hosts"] == ["node1", "node2"] and a.previous["mlflow_run_id"] == "run-1"
    with open(tmp_path / attempt.HISTORY, "a") as f:
        f.write('{"started": 1')   # a line cut short is left out
    hist = attempt.history(tmp_path)
    assert [(h["rank_hosts"], h["slurm_job_id"], h["slurm_restart_count"], h["slurm_nodelist"]) for h in hist] == [
        (["node1", "node2"], "41", "0", "node[1-2]"), (["node2", "node3"], "41", "1", "node[2-3]")]
    rec = json.loads((tmp_path / attempt.RECORD).read_text())
    assert rec["rank_hosts"] == ["node2", "node3"] and rec["slurm_restart_count"] == "1"
    assert attempt.history(tmp_path / "absent") == []


def test_other_ranks_write_nothing_and_one_process_records_its_own_host(tmp_path, monkeypatch):
    import socket

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    attempt.claim(tmp_path, is_main=False, hosts=["a", "b"]).release()
    assert not (tmp_path / attempt.HISTORY).exists()
    with attempt.claim(tmp_path):
        pass
    (h,) = attempt.history(tmp_path)
    assert h["rank_hosts"] == [socket.gethostname()] and "slurm_job_id" not in h
