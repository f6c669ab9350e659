"""fp4moe.launch.slurm without Slurm: the preemption/stop flag (a real signal to this process) and the Hydra callback
(the faults the tests inject into runs: tests/faults.py, tested in tests/train/test_hooks.py). The same pieces in the
trainer on a real Slurm: tests/test_slurm.py."""
import os
import signal

import pytest

from fp4moe.launch import slurm


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


def test_a_signal_during_the_start_up_is_kept_for_the_run(monkeypatch):
    """catch_early (``python -m fp4moe.train``'s first call): the time-limit signal before the Preemption exists (a
    job still importing torch) neither kills the process nor is lost: the Preemption takes it over (the run
    checkpoints after its first step and, in a Slurm job, requeues); after the run the default action is back. A
    handler already there (submitit's) is left alone."""
    monkeypatch.setattr(slurm, "_early", [])
    before = signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    try:
        slurm.catch_early((signal.SIGUSR2,))
        os.kill(os.getpid(), signal.SIGUSR2)   # its default action would end this process
        with slurm.Preemption() as preempt:
            assert preempt.poll() == signal.SIGUSR2 and slurm._early == []
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
        with slurm.Preemption() as preempt:   # taken over once: the next run starts clean
            assert preempt.poll() == 0
        own = lambda signum, frame: None  # noqa: E731
        signal.signal(signal.SIGUSR2, own)
        slurm.catch_early((signal.SIGUSR2,))
        assert signal.getsignal(signal.SIGUSR2) is own
    finally:
        signal.signal(signal.SIGUSR2, before)


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


def test_a_stop_signal_leaves_every_threads_stack_in_the_stacks_file(tmp_path):
    """``stacks_file``: SIGTERM appends the Python stacks (this test's frame among them) before the handler runs;
    a run that got no signal leaves no file; the handlers are back as they were after the block."""
    before = signal.getsignal(signal.SIGTERM)
    quiet, stacks = tmp_path / "quiet.txt", tmp_path / "stacks.txt"
    with slurm.Preemption(stacks_file=quiet) as preempt:
        assert preempt.poll() == 0 and quiet.exists()
    assert not quiet.exists() and signal.getsignal(signal.SIGTERM) == before
    with slurm.Preemption(stacks_file=stacks) as preempt:
        os.kill(os.getpid(), signal.SIGTERM)
        assert preempt.poll() == signal.SIGTERM
    text = stacks.read_text()
    assert "most recent call first" in text and "test_a_stop_signal_leaves_every_threads_stack" in text, text
    assert signal.getsignal(signal.SIGTERM) == before


@pytest.mark.skipif(slurm._c_handler(signal.SIGTERM) is None, reason="sigaction cannot be read here (not Linux)")
def test_a_handler_replaced_by_a_library_is_put_back_with_a_warning(tmp_path, capfd):
    """Something replaces the stop handler after the run started, at Python's level (``signal.signal``) or at the
    C level (``sigaction`` from C code, invisible to ``signal.getsignal``): the next ``poll`` names it in one line
    and puts the handler back, so the signal still reaches the flag (a checkpoint) instead of ending the process."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    with slurm.Preemption(stacks_file=tmp_path / "stacks.txt") as preempt:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        libc.signal(signal.SIGUSR1, ctypes.c_void_p(1))  # SIG_IGN, installed by C code
        assert preempt.poll() == 0
        err = capfd.readouterr().err
        assert "the SIGTERM handler was replaced (now: Python handler <Handlers.SIG_DFL: 0>)" in err, err
        assert "the SIGUSR1 handler was replaced (now: C handler at 0x1)" in err, err
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert preempt.poll() == signal.SIGUSR1           # both reached the flag: the process is alive
        assert preempt.poll() == signal.SIGUSR1 and "replaced" not in capfd.readouterr().err  # said once
    # the stacks dump was put back with the handlers: one dump per signal (each names the thread it ran in as
    # "Current thread", then any other threads this test process has)
    assert (tmp_path / "stacks.txt").read_text().count("Current thread") == 2


def test_preempt_signal_follows_submitit_setting(monkeypatch):
    assert slurm.preempt_signal() == signal.SIGUSR2
    monkeypatch.setenv("SUBMITIT_PREEMPT_SIGNAL", "USR1")
    assert slurm.preempt_signal() == signal.SIGUSR1


def test_callback_fails_the_slurm_job_only_inside_slurm(monkeypatch):
    from hydra.core.utils import JobReturn, JobStatus

    ret = JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("boom"))
    slurm.SlurmCallback().on_job_end(config=None, job_return=ret)  # outside Slurm: Hydra's own behaviour
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    with pytest.raises(slurm.JobFailed, match="Slurm job 7: RuntimeError: boom"):
        slurm.SlurmCallback().on_job_end(config=None, job_return=ret)
    slurm.SlurmCallback().on_job_end(config=None, job_return=JobReturn(status=JobStatus.COMPLETED))


@pytest.mark.parametrize("case", ["default", "relative_sqlite", "http", "env"])
def test_launcher_and_trainer_name_the_same_store(case, monkeypatch, tmp_path):
    """SlurmCallback.on_multirun_start prepares the store the trainer's jobs log into: both take
    fp4moe.tracking.mlflow_store.config_uri (tracking.uri, which conf/train.yaml defaults to $MLFLOW_TRACKING_URI,
    else the default store <repo>/mlruns/mlflow.db), unchanged (a relative sqlite path stays relative)."""
    from hydra import compose, initialize_config_dir

    from fp4moe.paths import conf_dir
    from fp4moe.tracking import mlflow_store

    monkeypatch.setenv("FP4MOE_HOME", str(tmp_path))   # the default store: under tmp_path, not the checkout
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    overrides, expected = {
        "default": ([], f"sqlite:///{tmp_path.resolve() / 'mlruns' / 'mlflow.db'}"),
        "relative_sqlite": (["tracking.uri=sqlite:///runs/mlflow.db"], "sqlite:///runs/mlflow.db"),
        "http": (["tracking.uri=http://127.0.0.1:5999"], "http://127.0.0.1:5999"),
        "env": ([], "sqlite:///from/env.db"),
    }[case]
    if case == "env":
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///from/env.db")
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    prepared = []
    monkeypatch.setattr(slurm, "prepare_tracking", prepared.append)
    slurm.SlurmCallback().on_multirun_start(config=cfg)
    assert prepared == [expected] == [mlflow_store.config_uri(cfg)]
    if case == "env":   # an override of tracking.uri wins over the variable
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = compose("train", overrides=["tracking.uri=http://127.0.0.1:5999"])
        slurm.SlurmCallback().on_multirun_start(config=cfg)
        assert prepared[-1] == mlflow_store.config_uri(cfg) == "http://127.0.0.1:5999"
