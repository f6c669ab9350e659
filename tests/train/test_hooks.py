"""The trainer's after-step hooks (fp4moe.train.hooks) driven the way the loop drives them, without a model: which
steps evaluate, log and checkpoint, and how a stop signal ends the loop with one checkpoint at its step; the hooks
of ``train.hooks`` (tests/faults.py's, as the fault-injection tests load them) and the one-line errors of a hook that
cannot be loaded."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

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


def _cfg(hooks_: object):
    from omegaconf import OmegaConf

    return OmegaConf.create({"train": {"hooks": hooks_}})


def test_train_hooks_fail_at_their_step_before_its_checkpoint():
    """tests/faults.py's fail_at_step loaded the way the trainer loads train.hooks (name -> factory and keywords):
    steps 1 and 2 checkpoint, step 3 raises before its checkpoint; a null entry is no hook."""
    rec = Recorder()
    state = _state(rec, total=5)
    cfg = _cfg({"off": None, "fail": {"factory": "faults:fail_at_step", "step": 3}})
    assert [f.key for f in hooks.configured(cfg)] == ["train.hooks.fail"]
    with pytest.raises(RuntimeError, match="^faults.fail_at_step: step=3$"):
        _drive(5, [*hooks.from_config(cfg), hooks.periodic_checkpoint(1)], state)
    assert rec.saved == [1, 2] and state.step == 3


def test_sleep_after_step_slows_the_first_attempts_only(monkeypatch):
    """sleep_after_step sleeps after every step of the attempts below ``attempts`` (Slurm's SLURM_RESTART_COUNT, 0
    outside Slurm), so that a job outlives its time limit, and not on the requeued attempt after them."""
    (hook,) = hooks.from_config(_cfg({"slow": {"factory": "faults:sleep_after_step", "seconds": 0.2, "attempts": 2}}))
    state = _state(Recorder(), total=3)
    for attempt, slowed in (("0", True), ("1", True), ("2", False)):
        monkeypatch.setenv("SLURM_RESTART_COUNT", attempt)
        t0 = time.perf_counter()
        hook(state)
        assert (time.perf_counter() - t0 >= 0.2) == slowed, attempt
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    (hook,) = hooks.from_config(_cfg({"slow": {"factory": "faults:sleep_after_step", "seconds": 0.2}}))
    t0 = time.perf_counter()
    hook(state)
    assert time.perf_counter() - t0 >= 0.2  # outside Slurm: attempt 0


@pytest.mark.parametrize("entries, message", [
    ({"x": "faults:fail_at_stp"}, "train.hooks.x='faults:fail_at_stp': faults has no attribute 'fail_at_stp' (did you "
                                  "mean faults:fail_at_step?)"),
    ({"x": "no_such_hooks_module:f"}, "train.hooks.x='no_such_hooks_module:f': no module named "
                                      "'no_such_hooks_module' here: install it, or put the folder that holds it on "
                                      "PYTHONPATH"),
    ({"x": "faults.fail_at_step"}, "train.hooks.x='faults.fail_at_step': name the factory as "
                                   "'package.module:factory'"),
    ({"x": {"factory": "faults:fail_at_step"}}, "train.hooks.x='faults:fail_at_step': fail_at_step(cfg, step, "
                                                "error='runtime') "
                                                "cannot be called as fail_at_step(cfg) (missing a "
                                                "required argument: 'step'): a hook factory takes the composed "
                                                "config, then the entry's other keys as keyword arguments"),
    ({"x": {"factory": "faults:fail_at_step", "stepp": 3}}, "cannot be called as fail_at_step(cfg, stepp=3)"),
    ({"x": {"step": 3}}, "train.hooks.x={'step': 3} names no factory: use 'package.module:factory' or {factory: "),
    ({"x": 3}, "train.hooks.x=3: use 'package.module:factory' or {factory: 'package.module:factory', <keyword>: "
               "<value>, ...}"),
    ({"x": "faults:FAIL"}, "train.hooks.x='faults:FAIL' is a str, not a factory"),
    ({"x": {"factory": "faults:fail_at_step", "step": 0}}, "train.hooks.x: faults:fail_at_step refused its "
                                                          "arguments: ValueError: step=0: a step of the run, >= 1"),
    ({"x": "broken_hooks_module:f"}, "train.hooks.x='broken_hooks_module:f': importing broken_hooks_module failed: "
                                     "ModuleNotFoundError: No module named 'a_dependency_it_lacks'"),
    (["faults:fail_at_step"], "train.hooks=['faults:fail_at_step']: use a mapping of names to hook factories"),
])
def test_a_hook_that_cannot_be_loaded_is_one_config_error_naming_its_key(entries, message, tmp_path, monkeypatch):
    """Every mistake in train.hooks is one line (fp4moe.config.ConfigError): the key, the value, the fix; found
    before the model is built (configured: imported and checked, nothing called; a factory's own ValueError when
    from_config calls it)."""
    from fp4moe.config import ConfigError

    (tmp_path / "broken_hooks_module.py").write_text("import a_dependency_it_lacks\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        hooks.from_config(_cfg(entries))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert str(e.value).startswith("train.hooks"), str(e.value)


def test_a_factory_that_returns_no_hook_is_refused():
    from fp4moe.config import ConfigError

    with pytest.raises(ConfigError, match=r"^train.hooks.x: builtins:repr returned str, not a hook: a factory returns "
                                          r"a callable taking the trainer's LoopState"):
        hooks.from_config(_cfg({"x": "builtins:repr"}))
