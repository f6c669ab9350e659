"""The trainer process's environment from ``cluster.env`` (conf/cluster/*.yaml), applied before torch starts.

A Slurm job gets ``cluster.env`` from the launcher's setup lines; a local run (plain ``python -m fp4moe.train``,
torchrun) gets it here: ``fp4moe.train.__main__`` calls :func:`apply_cluster_env` before it imports torch, so that
the allocator (``PYTORCH_CUDA_ALLOC_CONF``), OpenMP (``OMP_NUM_THREADS``) and inductor
(``TORCHINDUCTOR_COMPILE_THREADS``) read it as if it had been exported. A variable already set wins (the user's
setting, torchrun's ``OMP_NUM_THREADS=1`` for several processes per node).

The thread settings of the GPU clusters (``OMP_NUM_THREADS=4``, ``TORCHINDUCTOR_COMPILE_THREADS=1``) come from an
A/B on one H200 (results/train_proxy/README.md section 18): with torch's defaults on a 16-core host, fp8 cells had
slow steps (over 1.2x the median) and window jitter while inductor's compile workers ran beside the trainer; with
both settings the A/B's fp8 cells had neither (two rounds), and of the session's other fp8 cells with them one had a
single slow step. Where torch was imported before (an API caller of ``fp4moe.train.loop.train``),
the two thread settings are applied through torch's own knobs instead (``torch.set_num_threads``,
``torch._inductor.config.compile_threads``).

No torch import here.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from omegaconf import OmegaConf

from fp4moe.config import ConfigError

# variables whose value must be a positive integer (a thread count)
THREAD_COUNTS = ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")


def cluster_env(cfg: Any) -> dict[str, str]:
    """``cluster.env`` resolved to strings (None values dropped); ConfigError for a thread count that is not a
    positive integer."""
    env = OmegaConf.select(cfg, "cluster.env", default=None) or {}
    out = {str(k): str(v) for k, v in env.items() if v is not None}
    for key in THREAD_COUNTS:
        if key in out and not (out[key].isdigit() and int(out[key]) > 0):
            raise ConfigError(f"cluster.env.{key}={out[key]!r}: use a positive integer (threads per process)")
    return out


def apply_cluster_env(cfg: Any) -> dict[str, str]:
    """``cluster.env`` into this process's environment where a variable is not set yet. Returns what was set.

    If torch is already imported, the thread counts set here are also applied to it (OpenMP and inductor read
    their variables once, when they load)."""
    done = {}
    for key, value in cluster_env(cfg).items():
        if key not in os.environ:
            os.environ[key] = done[key] = value
    if "torch" in sys.modules:
        _apply_to_torch(done)
    return done


def _apply_to_torch(done: dict[str, str]) -> None:
    import torch

    if "OMP_NUM_THREADS" in done:
        torch.set_num_threads(int(done["OMP_NUM_THREADS"]))
    if "TORCHINDUCTOR_COMPILE_THREADS" in done:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = int(done["TORCHINDUCTOR_COMPILE_THREADS"])
