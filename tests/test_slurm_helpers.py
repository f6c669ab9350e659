"""fp4moe.slurm without Slurm: checkpoints, the preemption flag (a real signal to this process), the resumed MLflow
run, the test faults and the Hydra callback. The same pieces on a real Slurm: tests/test_slurm.py."""
import os
import signal

import pytest

from fp4moe import slurm


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_PROCID", "SUBMITIT_FOLDER", "SUBMITIT_PREEMPT_SIGNAL"):
        monkeypatch.delenv(var, raising=False)


def test_checkpoints_latest_keep_and_atomic_names(tmp_path):
    ckpts = slurm.Checkpoints(tmp_path / "ckpt", keep=2)
    assert ckpts.latest() is None and ckpts.run_id is None
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".tmp_step_000000009").write_text("half-written")  # a save cut short
    for step in (3, 6, 9):
        path = ckpts.save(step, lambda p, s=step: p.write_text(str(s)))
        assert path.name == f"step_{step:09d}"
    assert ckpts.latest() == (9, tmp_path / "ckpt" / "step_000000009")
    assert ckpts.latest().path.read_text() == "9"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000000006", "step_000000009"]
    ckpts.save(9, lambda p: (p.mkdir(), (p / "shard0").write_text("again")))  # a folder replaces a file
    assert (ckpts.latest().path / "shard0").read_text() == "again"
    ckpts.run_id = "abc123"
    assert slurm.Checkpoints(tmp_path / "ckpt").run_id == "abc123"


def test_checkpoint_dir_relative_to_the_working_directory_outside_hydra(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert slurm.checkpoint_dir("checkpoints") == tmp_path / "checkpoints"
    assert slurm.checkpoint_dir(tmp_path / "abs") == tmp_path / "abs"


def test_preemption_flag_from_a_real_signal_and_requeue_outside_slurm():
    before = signal.getsignal(signal.SIGUSR2)
    with slurm.Preemption() as preempt:
        assert not preempt.requested()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert preempt.requested()
        with pytest.raises(slurm.Requeued, match="preempted outside Slurm"):
            preempt.requeue()
    assert signal.getsignal(signal.SIGUSR2) == before


def test_preempt_signal_follows_submitit_setting(monkeypatch):
    assert slurm.preempt_signal() == signal.SIGUSR2
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    assert slurm.preempt_signal() == signal.SIGUSR1


def test_mlflow_run_is_continued_after_a_requeue(tmp_path, monkeypatch):
    import mlflow

    uri = slurm.prepare_tracking(f"sqlite:///{tmp_path / 'mlflow.db'}")
    ckpts = slurm.Checkpoints(tmp_path / "ckpt")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with pytest.raises(slurm.Requeued):
        with slurm.mlflow_run(ckpts, "resume", "cell", {"precision": "mxfp4"}, uri=uri) as run:
            mlflow.log_metric("loss", 1.0, step=0)
            raise slurm.Requeued(0)
    first = run.info.run_id
    client = mlflow.MlflowClient(uri)
    assert client.get_run(first).info.status == "KILLED" and ckpts.run_id == first
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with slurm.mlflow_run(ckpts, "resume", "cell", uri=uri) as run:
        mlflow.log_metric("loss", 0.5, step=1)
    got = client.get_run(first)
    assert run.info.run_id == first and got.info.status == "FINISHED"
    assert got.data.tags["slurm_job_id"] == "42" and got.data.tags["slurm_restart_count"] == "1"
    assert got.data.params == {"precision": "mxfp4"}
    assert [m.step for m in client.get_metric_history(first, "loss")] == [0, 1]
    with pytest.raises(ZeroDivisionError):
        with slurm.mlflow_run(slurm.Checkpoints(tmp_path / "other"), "resume", uri=uri) as run:
            1 / 0
    assert client.get_run(run.info.run_id).info.status == "FAILED"


def test_inject_faults(monkeypatch):
    from omegaconf import OmegaConf

    slurm.inject_faults(OmegaConf.create({}), 3)  # no fault node: nothing
    cfg = OmegaConf.create({"fault": {"fail_at_step": 2, "sleep_s": 0.2}})
    slurm.inject_faults(cfg, 1)
    with pytest.raises(RuntimeError, match="fault.fail_at_step=2"):
        slurm.inject_faults(cfg, 2)
    import time

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the requeued attempt runs at full speed
    t0 = time.perf_counter()
    slurm.inject_faults(cfg, 5)
    assert time.perf_counter() - t0 < 0.1


def test_callback_fails_the_slurm_job_only_inside_slurm(monkeypatch):
    from hydra.core.utils import JobReturn, JobStatus

    ret = JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("boom"))
    slurm.SlurmCallback().on_job_end(config=None, job_return=ret)  # outside Slurm: Hydra's own behaviour
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    with pytest.raises(slurm.JobFailed, match="Slurm job 7: RuntimeError: boom"):
        slurm.SlurmCallback().on_job_end(config=None, job_return=ret)
    slurm.SlurmCallback().on_job_end(config=None, job_return=JobReturn(status=JobStatus.COMPLETED))
