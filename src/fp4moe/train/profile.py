"""Optional ``torch.profiler`` window over some optimizer steps of a run (``train.profile``).

    python -m fp4moe.train ... train.profile.steps=[4,5]        # profile steps 4 and 5 (1-based, this process)

Writes, per rank, into ``<train.profile.dir or the Hydra job folder or .>/profile_rank<R>/``:

* ``ops_by_device_time.txt``: ``key_averages()`` sorted by self device time (CUDA kernels and the ops that launch
  them; on CPU: by self CPU time), ``train.profile.row_limit`` rows;
* ``ops_by_cpu_time.txt``: the same sorted by self CPU time (host overhead: Python, launches, synchronisations);
* ``trace.json``: the Chrome trace of the window (open in chrome://tracing or Perfetto).

The window records shapes (``record_shapes``) so that a kernel's cost can be tied to the tensor sizes. It adds its
own overhead: the profiled steps' tokens/s is not a measurement (leave them out with train.measure).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


def profile_window(steps) -> tuple[int, int] | None:
    """``train.profile.steps`` -> (first, last), 1-based; None when unset. ConfigError unless 1 <= first <= last
    (one step, ``[n]``, is ``[n, n]``)."""
    if not steps:
        return None
    if len(steps) not in (1, 2) or int(steps[0]) < 1 or int(steps[-1]) < int(steps[0]):
        from fp4moe.config import ConfigError

        raise ConfigError(f"train.profile.steps={list(steps)}: give [first, last] with 1 <= first <= last, or null")
    return int(steps[0]), int(steps[-1])


class StepProfiler:
    """Starts ``torch.profiler`` before step ``first`` and stops it after step ``last`` (1-based step numbers of
    this process's run); a no-op when ``train.profile.steps`` is null."""

    def __init__(self, cfg: Any, output_dir: str | Path | None, device, rank: int):
        prof = (cfg.train.get("profile") if hasattr(cfg.train, "get") else None) or {}
        self.first, self.last = profile_window(prof.get("steps")) or (None, None)
        base = prof.get("dir") or output_dir or "."
        self.folder = Path(base) / f"profile_rank{rank}"
        self.row_limit = int(prof.get("row_limit") or 60)
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self._prof = None

    @property
    def enabled(self) -> bool:
        return self.first is not None

    def before_step(self, step: int) -> None:
        """Call with the number of the step about to run."""
        if self.enabled and step == self.first and self._prof is None:
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts, record_shapes=True)
            self._prof.__enter__()

    def after_step(self, step: int) -> Path | None:
        """Call with the number of the step that just finished; returns the folder when the window closed."""
        if self._prof is None or step < self.last:
            return None
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        avg = prof.key_averages()
        by_device = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        (self.folder / "ops_by_device_time.txt").write_text(avg.table(sort_by=by_device, row_limit=self.row_limit))
        (self.folder / "ops_by_cpu_time.txt").write_text(avg.table(sort_by="self_cpu_time_total",
                                                                   row_limit=self.row_limit))
        prof.export_chrome_trace(str(self.folder / "trace.json"))
        return self.folder

    def close(self) -> None:
        """Stop a window still open (the run ended or failed inside it) without writing anything."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)


__all__ = ["StepProfiler", "profile_window"]
