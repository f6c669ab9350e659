"""Stop-and-checkpoint on signals, at the next step boundary.

SIGTERM (Slurm preemption / ``scancel``, ``kill``), SIGUSR1 (e.g. ``sbatch --signal=USR1@120``) and SIGUSR2
(submitit's time-out signal, ``--signal=USR2@<cluster.signal_delay_s>``) only set a flag in the handler. The loop
polls it after every optimizer step (all ranks agree through an all-reduce MAX, so they stop at the same step),
writes a checkpoint and stops. For SIGUSR2, the handler that was installed before ours (submitit's
``checkpoint_and_try_requeue``) is then called, so that submitit requeues the job as usual.
"""
from __future__ import annotations

import signal
import threading
from typing import Any

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class StopOnSignal:
    """Context manager installing the handlers (main thread only); ``poll()`` returns the agreed signal number
    or 0."""

    def __init__(self) -> None:
        self.received = 0
        self.previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if not self.received:
            self.received = signum

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self.previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self.previous.items():  # kept in self.previous for hand_over()
            signal.signal(s, h)

    def poll(self, device: Any) -> int:
        """The signal every rank has agreed to stop on (the largest number any rank received), or 0."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            t = torch.tensor([self.received], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return int(t.item())
        return self.received

    def hand_over(self, signum: int) -> None:
        """After the checkpoint: give SIGUSR2 to the handler installed before ours (submitit requeues)."""
        prev = self.previous.get(signum)
        if signum == signal.SIGUSR2 and callable(prev):
            prev(signum, None)


__all__ = ["StopOnSignal", "SIGNALS"]
