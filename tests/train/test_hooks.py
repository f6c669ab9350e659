"""The trainer's after-step hooks (fp4moe.train.hooks) driven the way the loop drives them, without a model: which
steps evaluate, log and checkpoint, and how a stop signal ends the loop with one checkpoint at its step."""
from __future__ import annotations

import os
import signal
from pathlib import Path

from fp4moe.launch import slurm
from fp4moe.train import hooks


class Recorder:
    """Stands in for the tracker's log (a list of (step, metric names)) and for the checkpoint writer."""

    def __init__(self) -> None:
        self.logged: list[tuple[int, list[str]]] = []
        self.saved: list[int] = []

    def log(self, step: int, metrics: dict) -> None:
        self.logged.append((step, sorted(metrics)))


def _drive(total: int, after: list, state: hooks.LoopState) -> None:
    """The loop's order: set the step and its metrics, call every hook, stop when one says so."""
    for step in range(state.step + 1, total + 1):
        state.step, state.metrics, state.seconds = step, {"loss": 1.0 / step, "lr": 0.1}, 0.01
        for hook in after:
            hook(state)
        if state.stopped_by:
            break


def _state(rec: Recorder, total: int, start: int = 0) -> hooks.LoopState:
    def save() -> Path:
        rec.saved.append(state.step)
        return Path(f"step_{state.step:07d}")
    state = hooks.LoopState(step=start, total_steps=total, save=save)
    return state


def test_eval_log_and_checkpoint_cadence_and_the_last_step():
    rec = Recorder()
    state = _state(rec, total=7)
    evals = iter(range(100))
    after = [hooks.evaluation(3, lambda: float(next(evals))), hooks.mlflow_log(rec, 2),
             hooks.periodic_checkpoint(4)]
    _drive(7, after, state)
    # evaluation every 3 steps and at the last; logging every 2, at every evaluation and at the last
    assert state.eval_losses == {3: 0.0, 6: 1.0, 7: 2.0} and state.last_eval == 7
    assert [s for s, _ in rec.logged] == [2, 3, 4, 6, 7]
    assert dict(rec.logged)[3] == ["eval_loss", "loss", "lr"] and dict(rec.logged)[2] == ["loss", "lr"]
    # checkpoints every 4 steps and at the last; the state names the newest
    assert rec.saved == [4, 7] and state.last_saved == 7 and state.checkpoint == Path("step_0000007")


def test_a_stop_signal_checkpoints_once_at_its_step_and_ends_the_loop():
    rec = Recorder()
    state = _state(rec, total=10)
    with slurm.Preemption() as stop:
        def send_at_5(s: hooks.LoopState) -> None:
            if s.step == 5:
                os.kill(os.getpid(), signal.SIGUSR1)
        after = [hooks.periodic_checkpoint(5), send_at_5,
                 hooks.stop_signals(stop, device=None, resume_hint="rerun")]
        _drive(10, after, state)
    # the periodic checkpoint of step 5 is the stop's: not written twice
    assert state.stopped_by == signal.SIGUSR1 and state.step == 5 and rec.saved == [5]


def test_the_fault_knob_fails_at_its_step_through_the_hook():
    from omegaconf import OmegaConf

    rec = Recorder()
    state = _state(rec, total=5)
    cfg = OmegaConf.create({"fault": {"fail_at_step": 3}})
    try:
        _drive(5, [hooks.faults(cfg), hooks.periodic_checkpoint(1)], state)
    except RuntimeError as e:
        assert "fault.fail_at_step=3" in str(e)
    else:
        raise AssertionError("fault.fail_at_step=3 did not fail")
    assert rec.saved == [1, 2] and state.step == 3
