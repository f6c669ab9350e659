"""Faults the tests inject into real training runs, as after-step hooks of the trainer's ``train.hooks``
(fp4moe.train.hooks; docs/training.md, "Hooks of your own"): the product code carries no test knobs.

A run loads them by name, on the command line of a subprocess, a torchrun or a Slurm job::

    '+train.hooks.fail={factory: faults:fail_at_step, step: 3}'                    # RuntimeError after step 3
    '+train.hooks.slow={factory: faults:sleep_after_step, seconds: 3, attempts: 3}' # 3 s after each step, attempts 0-2

``faults`` is this file: tests/conftest.py puts tests/ on ``PYTHONPATH``, so the test process, its subprocesses,
torchrun's workers and Slurm jobs (sbatch and submitit's jobs inherit the environment they are submitted from) all
import it. ``train.hooks`` is not part of the run folder's identity, so a run a fault stopped resumes with the same
command, with the fault or without it.
"""
from __future__ import annotations

import os
import time
from typing import Any

FAIL = "faults.fail_at_step"  # the start of fail_at_step's message, which tests look for in a run's output


# What NCCL 2.28.9 raised, through torch, in three runs sharing one 80 GB H100 (results/train_proxy/README.md
# section 43): the GPU's memory ran out inside the optimizer's all-reduce
NCCL_ALLOC = ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, unhandled cuda error (run with "
              "NCCL_DEBUG=INFO for details), NCCL version 2.28.9\nncclUnhandledCudaError: Call to CUDA function "
              "failed.\nLast error:\nFailed to CUDA calloc async 608 bytes")


def fail_at_step(cfg: Any, step: int, error: str = "runtime"):
    """A hook that raises after step ``step`` (1-based; after the hooks before it, e.g. MLflow's log of the step, and
    before that step's periodic checkpoint). ``error``: ``runtime``, RuntimeError ``faults.fail_at_step:
    step=<step>``; ``nccl_alloc``, torch's DistBackendError with NCCL's words for a failed GPU allocation
    (``NCCL_ALLOC``)."""
    step = int(step)
    if step < 1:
        raise ValueError(f"step={step}: a step of the run, >= 1")
    if error not in ("runtime", "nccl_alloc"):
        raise ValueError(f"error={error!r}: runtime or nccl_alloc")

    def hook(s: Any) -> None:
        if s.step == step:
            if error == "nccl_alloc":
                import torch.distributed

                raise torch.distributed.DistBackendError(NCCL_ALLOC)
            raise RuntimeError(f"{FAIL}: step={step}")
    return hook


def sleep_after_step(cfg: Any, seconds: float, attempts: int = 1):
    """A hook that sleeps ``seconds`` after each step on the job's attempts below ``attempts`` (Slurm's
    ``SLURM_RESTART_COUNT``, 0 outside Slurm; default 1: the first attempt only, a requeued one runs at full speed),
    so that a job runs past its time limit or a test can act between two steps."""
    seconds, attempts = float(seconds), int(attempts)
    if seconds < 0:
        raise ValueError(f"seconds={seconds}: a duration >= 0")

    def hook(s: Any) -> None:
        if int(os.environ.get("SLURM_RESTART_COUNT", "0")) < attempts:
            time.sleep(seconds)
    return hook
