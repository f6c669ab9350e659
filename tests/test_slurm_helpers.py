"""fp4moe.slurm without Slurm: the preemption/stop flag (a real signal to this process), the test faults and the
Hydra callback. The same pieces in the trainer on a real Slurm: tests/test_slurm.py."""
import os
import signal

import pytest

from fp4moe import slurm


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_PROCID", "SUBMITIT_FOLDER", "SUBMITIT_PREEMPT_SIGNAL"):
        monkeypatch.delenv(var, raising=False)


def test_preemption_flag_from_a_real_signal_and_requeue_outside_slurm():
    before = signal.getsignal(signal.SIGUSR2)
    with slurm.Preemption() as preempt:
        assert not preempt.requested() and preempt.poll() == 0
        os.kill(os.getpid(), signal.SIGUSR2)
        assert preempt.requested() and preempt.poll() == signal.SIGUSR2
        assert not preempt.will_requeue(signal.SIGUSR2)   # outside Slurm: leave() returns, the trainer exits 140
        preempt.leave(signal.SIGUSR2)
        with pytest.raises(slurm.Requeued, match="preempted outside Slurm"):
            preempt.requeue()
    assert signal.getsignal(signal.SIGUSR2) == before


def test_stop_signals_stop_and_only_the_preemption_signal_requeues_in_slurm(monkeypatch):
    before, before_usr2 = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGUSR2)
    try:
        with slurm.Preemption() as preempt:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR1)          # the first signal wins
            assert preempt.poll() == signal.SIGTERM
            monkeypatch.setenv("SLURM_JOB_ID", "42")
            assert not preempt.will_requeue(signal.SIGTERM) and not preempt.will_requeue(signal.SIGUSR1)
            assert preempt.will_requeue(signal.SIGUSR2)
            preempt.leave(signal.SIGTERM)                 # no requeue: returns
        assert signal.getsignal(signal.SIGTERM) == before
        # in a Slurm job a late time-limit signal is ignored: it must not kill a finished job
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, before_usr2)


def test_ctrl_c_stops_after_a_checkpoint_and_a_second_one_aborts():
    """SIGINT is a stop signal (checkpoint, then stop; never a requeue); the second SIGINT raises KeyboardInterrupt
    at once, and the default handler (KeyboardInterrupt) is back after the loop."""
    before = signal.getsignal(signal.SIGINT)
    with slurm.Preemption() as preempt:
        os.kill(os.getpid(), signal.SIGINT)
        assert preempt.poll() == signal.SIGINT and not preempt.will_requeue(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == before


def test_preempt_signal_follows_submitit_setting(monkeypatch):
    assert slurm.preempt_signal() == signal.SIGUSR2
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    assert slurm.preempt_signal() == signal.SIGUSR1


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
