"""Atomic, resumable checkpoints: ``<run dir>/step_NNNNNNN/{meta.json, rank_RRRRR.pt}`` (:func:`run_dir`).

Each rank writes its own ``rank_RRRRR.pt`` (model state dict incl. the router expert-bias buffers, megatron's
optimizer state with this rank's FP32 main params and AdamW moments (fp4moe.train.optim.optimizer_state_dict),
megatron's scheduler, RNG states of python / numpy / torch / CUDA / megatron's tracker) into a
hidden temporary folder ``.step_NNNNNNN.tmp``; after a barrier rank 0 writes ``meta.json`` (step, consumed
samples, MLflow run id, the run's fingerprint, world size) and renames the folder into place. A folder without
``meta.json`` is never a checkpoint, so a run killed mid-save resumes from the previous one. The newest
``keep`` checkpoints are kept.

Resuming needs the same world size and the same fingerprint (:func:`fingerprint`: the config groups that
change what is trained, the optimizer group included); run length, intervals and logging may differ.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from fp4moe.atomic_write import writable_ancestor
from fp4moe.config import ConfigError
from fp4moe.train import optim
from fp4moe.train.dist import barrier

STEP_RE = re.compile(r"^step_(\d{7,})$")
# Config keys whose change makes a checkpoint belong to another run. train.* run length, intervals, measure and
# checkpointing knobs are left out on purpose (extending a run is a resume).
FINGERPRINT_KEYS = ("model", "precision", "recompute", "parallel", "data", "backend", "optimizer", "train.seed",
                    "train.params_dtype", "train.adamw", "train.schedule")


def fingerprint(cfg: Any) -> dict[str, str]:
    """sha256 (16 hex digits) of each FINGERPRINT_KEYS entry of the resolved config."""
    out = {}
    for key in FINGERPRINT_KEYS:
        node = OmegaConf.select(cfg, key)
        value = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        out[key] = hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return out


def run_dir(cfg: Any, multirun_cell: str | None = None, output_dir: str | Path | None = None) -> Path:
    """This run's checkpoint folder (the same after a Slurm requeue, one per sweep cell).

    A relative ``train.checkpoint_dir`` lives in the Hydra job's ``output_dir``, which is already one per run and
    per multirun cell (and is reused by a requeued job): ``<output_dir>/<checkpoint_dir>``; outside Hydra
    (``output_dir`` None) it is taken from the working directory as an absolute one. An absolute one is shared by
    runs: ``<checkpoint_dir>/<task_name>[/<cell>]``, where a cell is Hydra's ``override_dirname``, so that the cells
    of a sweep never resume from each other."""
    d = Path(str(cfg.train.checkpoint_dir)).expanduser()
    if not d.is_absolute():
        if output_dir is not None:
            return Path(output_dir) / d
        d = Path.cwd() / d
    d = d / str(cfg.get("task_name") or "train")
    return d / multirun_cell if multirun_cell else d


# bytes one checkpoint holds per parameter, at most: BF16 weights + FP32 main weights + two FP32 Adam moments
CHECKPOINT_BYTES_PER_PARAM = 2 + 4 + 4 + 4


def check_writable(root: Path, params_total: int | None = None) -> None:
    """Refuse (ConfigError) a checkpoint folder ``root`` that cannot be written, before anything trains: its nearest
    existing ancestor must be a writable folder and, given ``params_total``, hold the free space of one checkpoint
    (``CHECKPOINT_BYTES_PER_PARAM`` per parameter, an upper bound). Creates nothing."""
    existing, writable = writable_ancestor(root)
    fix = "point train.checkpoint_dir (or FP4MOE_CKPT_DIR) at a writable folder"
    if not writable:
        raise ConfigError(f"checkpoint folder {root} cannot be created: {existing} is not a writable folder; {fix}")
    if params_total:
        need = int(params_total) * CHECKPOINT_BYTES_PER_PARAM
        free = shutil.disk_usage(existing).free
        if free < need:
            raise ConfigError(f"checkpoint folder {root}: {free / 1e9:.2f} GB free on its file system, one checkpoint "
                              f"needs up to {need / 1e9:.2f} GB ({params_total} parameters x "
                              f"{CHECKPOINT_BYTES_PER_PARAM} B); free space there, or {fix} with room")


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:07d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = STEP_RE.match(d.name)
        if m and d.is_dir() and (d / "meta.json").is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def latest(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


# ---------------------------------------------------------------------------------------------- RNG

def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import random as mrandom

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
             "megatron_tracker": mrandom.get_cuda_rng_tracker().get_states()}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    mrandom.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


# ---------------------------------------------------------------------------------------------- save / load

def save(root: Path, *, step: int, consumed_samples: int, rank: int, world_size: int, model: torch.nn.Module,
         optimizer: Any, schedule: Any, mlflow_run_id: str | None, fingerprint_: dict[str, str],
         keep: int = 2, meter: Any = None) -> Path:
    """Write the checkpoint of ``step`` (collective: every rank calls it). Returns the final folder. ``model``: the
    megatron model (not its DDP wrapper); ``optimizer``: megatron's; ``schedule``: megatron's scheduler; ``meter``:
    the run's throughput / memory measurements so far (``fp4moe.train.metrics.Meter``), carried into a resumed
    run."""
    final = _step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    payload = {"model": model.state_dict(), "optimizer": optim.optimizer_state_dict(optimizer),
               "schedule": schedule.state_dict(),
               "rng": rng_state(), "step": step, "consumed_samples": consumed_samples, "rank": rank,
               "meter": None if meter is None else meter.state_dict()}
    path = tmp / f"rank_{rank:05d}.pt"
    with open(path, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    barrier()
    if rank == 0:
        meta = {"step": step, "consumed_samples": consumed_samples, "world_size": world_size,
                "mlflow_run_id": mlflow_run_id, "fingerprint": fingerprint_, "time": time.time()}
        with open(tmp / "meta.json", "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # the same step saved again (e.g. a signal right after a periodic save)
            trash = root / f".{final.name}.old"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        for _, old in complete_checkpoints(root)[:-max(1, keep)]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def read_meta(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "meta.json").read_text())


def check_compatible(folder: Path, meta: dict[str, Any], *, world_size: int, fingerprint_: dict[str, str]) -> None:
    """ConfigError naming what differs when the checkpoint in ``folder`` belongs to another run."""
    if int(meta["world_size"]) != world_size:
        raise ConfigError(f"checkpoint {folder} was written by {meta['world_size']} processes, this run has "
                          f"{world_size}: resume with the same parallel layout, or use another train.checkpoint_dir")
    saved = meta.get("fingerprint") or {}
    differs = [k for k in FINGERPRINT_KEYS if saved.get(k) != fingerprint_.get(k)]
    if differs:
        raise ConfigError(f"checkpoint {folder} belongs to a run with other {', '.join(differs)}: resume with the "
                          "same config, point train.checkpoint_dir elsewhere, or set train.resume=false with an "
                          "empty checkpoint folder")


def load(folder: Path, *, rank: int, model: torch.nn.Module, optimizer: Any, schedule: Any,
         meter: Any = None) -> dict[str, Any]:
    """Restore this rank's state from ``folder`` (and, given ``meter``, the measurements of the run's earlier
    processes, where the checkpoint has them); returns its ``meta.json`` (step, consumed samples, run id)."""
    meta = read_meta(folder)
    payload = torch.load(folder / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)
    # the optimizer first: megatron's offloading optimizer moves the weights while it loads (fp4moe.train.optim)
    optim.load_optimizer_state_dict(optimizer, payload["optimizer"])
    model.load_state_dict(payload["model"], strict=True)
    schedule.load_state_dict(payload["schedule"])
    set_rng_state(payload["rng"])
    if meter is not None and payload.get("meter") is not None:
        meter.load_state_dict(payload["meter"])
    if int(payload["step"]) != int(meta["step"]):
        raise RuntimeError(f"{folder}: rank file step {payload['step']} != meta step {meta['step']}")
    return meta


__all__ = ["fingerprint", "run_dir", "complete_checkpoints", "latest", "save", "load", "read_meta",
           "check_compatible", "rng_state", "set_rng_state", "FINGERPRINT_KEYS"]
