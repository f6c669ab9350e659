"""What runs after each optimizer step, in this order: evaluation, MLflow, the progress bar, the profiler window,
the caller's ``after_step``, the ``fault`` test knobs, the periodic checkpoint, and the stop signals.

Each hook is a callable taking the :class:`LoopState`; the trainer builds the list once (:func:`after_step_hooks`)
and calls every hook on every rank after every step. A hook may add metrics before the MLflow hook logs them
(evaluation adds ``eval_loss``), save a checkpoint (``state.save()``), or end the loop (``state.stopped_by``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fp4moe.launch import slurm

log = logging.getLogger("fp4moe.train")

Hook = Callable[["LoopState"], None]


@dataclass
class LoopState:
    """The loop between steps: ``step`` (updates done), ``total_steps``, ``metrics`` of the step just done,
    ``last_saved`` / ``last_eval`` (the step of the newest checkpoint / evaluation of this process, -1: none),
    ``stopped_by`` (the stop signal's number, 0: none), ``save`` (writes a checkpoint at ``step``, returns its
    folder), ``checkpoint`` (the newest this process wrote), ``eval_losses`` (step -> held-out loss) and
    ``seconds`` (the step's wall time)."""
    step: int
    total_steps: int
    save: Callable[[], Path]
    metrics: dict[str, float | None] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    last_saved: int = -1
    last_eval: int = -1
    stopped_by: int = 0
    checkpoint: Path | None = None
    seconds: float = 0.0

    def checkpoint_now(self) -> None:
        """A checkpoint at ``step`` unless this process wrote one there already."""
        if self.last_saved != self.step:
            self.checkpoint = self.save()
            self.last_saved = self.step


def evaluation(every: int | None, evaluate: Callable[[], float]) -> Hook:
    """Held-out loss every ``every`` steps and at the last (None: never), as ``eval_loss`` in the step's metrics."""
    def hook(s: LoopState) -> None:
        if every and (s.step % int(every) == 0 or s.step == s.total_steps):
            s.metrics["eval_loss"] = s.eval_losses[s.step] = evaluate()
            s.last_eval = s.step
    return hook


def mlflow_log(tracker: Any, every: int) -> Hook:
    """The step's metrics to MLflow every ``every`` steps, at an evaluation and at the last step."""
    def hook(s: LoopState) -> None:
        if s.step % every == 0 or "eval_loss" in s.metrics or s.step == s.total_steps:
            tracker.log(s.step, s.metrics)
    return hook


def progress_bar(bar: Any, tokens_per_step: int) -> Hook:
    """tqdm's bar (rank 0): loss, lr, this step's tokens/s and the measured tokens/GPU/s."""
    def hook(s: LoopState) -> None:
        m = s.metrics
        tgs = m.get("tokens_per_gpu_per_s")
        bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}", tok_s=f"{tokens_per_step / s.seconds:.0f}",
                        tgs="warm-up" if tgs is None else f"{tgs:.0f}", refresh=False)
        bar.update(1)
    return hook


def profiler_window(profiler: Any, tracker: Any, is_main: bool) -> Hook:
    """Closes the torch.profiler window at its last step; rank 0 tags the run with where it went."""
    def hook(s: LoopState) -> None:
        folder = profiler.after_step(s.step)
        if folder is not None and is_main:
            tracker.set_tags({"profile_dir": str(folder.resolve()), "profile_steps": f"{profiler.first}-{s.step}"})
    return hook


def caller(after_step: Callable[[int, dict[str, float]], None]) -> Hook:
    """The caller's ``after_step(step, metrics)`` (tests send signals from it)."""
    return lambda s: after_step(s.step, s.metrics)


def faults(cfg: Any) -> Hook:
    """The ``+fault.*`` test knobs (fp4moe.launch.slurm.inject_faults: fail at a step, sleep after each step); the Slurm
    tests set them on the command line of a job, where no Python hook can reach."""
    return lambda s: slurm.inject_faults(cfg, s.step)


def periodic_checkpoint(every: int | None) -> Hook:
    """A checkpoint every ``every`` steps and at the last (None: only at stops and the end of a resumed run)."""
    def hook(s: LoopState) -> None:
        if every and (s.step % int(every) == 0 or s.step == s.total_steps):
            s.checkpoint = s.save()
            s.last_saved = s.step
    return hook


def stop_signals(stop: slurm.Preemption, device: Any, resume_hint: str) -> Hook:
    """A stop signal since the last step (SIGTERM, SIGINT, SIGUSR1, Slurm's SIGUSR2; ``stop.poll`` agrees on it
    across ranks): checkpoint now, say where and how to go on, end the loop."""
    def hook(s: LoopState) -> None:
        sig = stop.poll(device)
        if sig:
            s.checkpoint_now()
            s.stopped_by = sig
            log.warning("stopped by signal %d at step %d; checkpoint %s; %s", sig, s.step, s.checkpoint,
                        "requeued: the job resumes from it" if stop.will_requeue(sig) else resume_hint)
    return hook


__all__ = ["Hook", "LoopState", "caller", "evaluation", "faults", "mlflow_log", "periodic_checkpoint",
           "profiler_window", "progress_bar", "stop_signals"]
