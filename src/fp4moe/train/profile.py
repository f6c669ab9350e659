"""Optional ``torch.profiler`` window over some optimizer steps of a run (``train.profile``).

    python -m fp4moe.train ... train.profile.steps=[4,5]        # profile steps 4 and 5 (1-based, this process)

Writes, per rank, into ``<train.profile.dir or the Hydra job folder or .>/profile_rank<R>/``:

* ``ops_by_device_time.txt``: ``key_averages()`` sorted by self device time (CUDA kernels and the ops that launch
  them; on CPU: by self CPU time), ``train.profile.row_limit`` rows;
* ``ops_by_cpu_time.txt``: the same sorted by self CPU time (host overhead: Python, launches, synchronisations);
* ``trace.json``: the Chrome trace of the window (open in chrome://tracing or Perfetto);
* with ``train.profile.memory=true`` (CUDA only): ``memory_peak.txt`` / ``memory_peak.json``, what was live at the
  window's memory peak, and what was already live when it opened, by allocation site and trainer line
  (:mod:`fp4moe.tracking.memtrace`; the history is recorded from before the model is built), and
  ``memory_snapshot.pickle`` (open it at https://pytorch.org/memory_viz). ``train.profile.ops=false`` turns the
  torch.profiler part off (its own allocations then stay out of the memory trace).

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


MEMORY_MAX_EVENTS = 1_000_000  # allocator history entries kept (a proxy step makes ~6k; each holds its Python stack)


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
        self.ops = bool(prof.get("ops", True))
        self.memory = bool(prof.get("memory", False)) and self.cuda
        if bool(prof.get("memory", False)) and not self.cuda and self.first is not None:
            import logging

            logging.getLogger(__name__).warning("train.profile.memory needs a CUDA device: no memory trace on %s",
                                                device)
        self.device = device
        self._prof = None
        self._open = False
        self._recording = False
        self._baseline = 0
        self._start_event = 0

    @property
    def enabled(self) -> bool:
        return self.first is not None

    def start_memory_history(self) -> None:
        """With ``train.profile.memory``: record the allocator's history from now on (call it before the model is
        built), so that what is live when the window opens (weights, gradients, optimizer state, anything an
        earlier step left) is attributed to its allocation sites too. A no-op otherwise."""
        if not (self.enabled and self.memory) or self._recording:
            return
        import torch

        torch.cuda.synchronize(self.device)
        self._baseline = torch.cuda.memory_allocated(self.device)
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                                 max_entries=MEMORY_MAX_EVENTS)
        self._recording = True

    def _trace(self, snapshot: dict) -> list:
        import torch

        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        traces = snapshot.get("device_traces") or []
        return traces[index] if index < len(traces) else []

    def before_step(self, step: int) -> None:
        """Call with the number of the step about to run."""
        if self.enabled and step == self.first and not self._open:
            import torch

            self._open = True
            if self.memory:
                if self._recording:  # the window starts at the history's current end
                    torch.cuda.synchronize(self.device)
                    self._start_event = len(self._trace(torch.cuda.memory._snapshot()))
                else:
                    self.start_memory_history()
            if self.ops:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if self.cuda:
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                self._prof = torch.profiler.profile(activities=acts, record_shapes=True)
                self._prof.__enter__()

    def after_step(self, step: int) -> Path | None:
        """Call with the number of the step that just finished; returns the folder when the window closed."""
        if not self._open or step < self.last:
            return None
        self._open = False
        prof, self._prof = self._prof, None
        snapshot = None
        if self.memory:
            import torch

            torch.cuda.synchronize(self.device)
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False
        if prof is not None:
            prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        if prof is not None:
            avg = prof.key_averages()
            by_device = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
            (self.folder / "ops_by_device_time.txt").write_text(avg.table(sort_by=by_device,
                                                                          row_limit=self.row_limit))
            (self.folder / "ops_by_cpu_time.txt").write_text(avg.table(sort_by="self_cpu_time_total",
                                                                       row_limit=self.row_limit))
            prof.export_chrome_trace(str(self.folder / "trace.json"))
        if snapshot is not None:
            self._write_memory(snapshot)
        return self.folder

    def _write_memory(self, snapshot: dict) -> None:
        import json
        import pickle

        import torch

        from fp4moe.tracking.memtrace import format_breakdown, peak_breakdown

        trace = self._trace(snapshot)
        if len(trace) >= MEMORY_MAX_EVENTS:
            import logging

            logging.getLogger(__name__).warning(
                "the allocator history reached %d events and dropped its oldest: memory_peak.* is incomplete "
                "(profile fewer or earlier steps)", MEMORY_MAX_EVENTS)
        b = peak_breakdown(trace, self._baseline, start_event=self._start_event)
        b["max_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
        b["steps"] = [self.first, self.last]
        (self.folder / "memory_peak.json").write_text(json.dumps(b, indent=1))
        (self.folder / "memory_peak.txt").write_text(format_breakdown(b))
        with open(self.folder / "memory_snapshot.pickle", "wb") as f:
            pickle.dump(snapshot, f)

    def close(self) -> None:
        """Stop a window still open (the run ended or failed inside it) without writing anything."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
        if self._recording:
            import torch

            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False
        self._open = False


__all__ = ["StepProfiler", "profile_window"]
