"""Atomic, resumable checkpoints: ``<run dir>/step_NNNNNNN/{meta.json, rank_RRRRR.pt}`` (:func:`run_dir`).

Each rank writes its own ``rank_RRRRR.pt`` (model state dict incl. the router expert-bias buffers, megatron's
optimizer state with this rank's FP32 main params and AdamW moments (fp4moe.train.optim.optimizer_state_dict),
megatron's scheduler, RNG states of python / numpy / torch / CUDA / megatron's tracker) into a
hidden temporary folder ``.step_NNNNNNN.tmp``; after a barrier rank 0 writes ``meta.json`` (step, consumed
samples, MLflow run id, the run's fingerprint, world size, each rank file's size in bytes: the commit marker,
written last) and renames the folder into place. A run killed mid-save leaves only the hidden folder, so it
resumes from the previous checkpoint (the next save removes the hidden folder). The newest ``keep`` whole
checkpoints are kept, damaged folders older than those removed. A save that cannot be written (a full disk) removes
its unfinished folder and stops the run with one line (:class:`Unwritable`).

A ``step_NNNNNNN`` folder that is damaged (no ``meta.json``, a ``meta.json`` that does not parse, a rank file
missing, shorter than ``meta.json`` says or not a whole torch.save archive, or one that torch cannot read) is
skipped with a warning naming it, and the run resumes from the newest complete one (:func:`scan`,
:func:`read_payload`); with none left, a ConfigError names the folder and the fix.

Rank files are read with ``torch.load(weights_only=True)``: tensors, containers, numbers and strings, plus the
classes of :data:`SAFE_GLOBALS` (no code from the file runs). Everything this module saves is of those types.

Resuming needs the same world size and the same fingerprint (:func:`fingerprint`: the config groups that
change what is trained, the optimizer group included); run length, intervals and logging may differ.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from fp4moe.atomic_write import writable_ancestor
from fp4moe.config import ConfigError
from fp4moe.train import optim
from fp4moe.train.dist import barrier

log = logging.getLogger("fp4moe.train")

STEP_RE = re.compile(r"^step_(\d{7,})$")
# What torch.load(weights_only=True) may build besides tensors, containers, numbers and strings, each data only:
# - megatron's HybridDeviceOptimizer (optimizer=offload / distributed_bf16_grads) keeps its inner optimizers'
#   classes in its param_groups ('cpu_optimizer_cls', 'gpu_optimizer_cls': torch's AdamW without TE / apex);
# - numpy's RNG key as an array, in checkpoints written before rng_state() stored it as a list of ints.
SAFE_GLOBALS = [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD,
                (getattr(np, "_core", None) or np.core).multiarray._reconstruct, np.ndarray, np.dtype,
                np.dtypes.UInt32DType]
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


class Damaged(ConfigError):
    """A step folder that cannot be resumed from; the message names the file and what is wrong with it."""


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step_NNNNNNN`` folder under ``root``, complete or not, oldest first (the hidden
    ``.step_NNNNNNN.tmp`` folders of unfinished saves are not among them)."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), d) for d in root.iterdir() if (m := STEP_RE.match(d.name)) and d.is_dir())


def verify(folder: Path) -> dict[str, Any]:
    """``folder``'s meta.json, after checking without reading the tensors that the checkpoint is whole: the commit
    marker parses and matches the folder, every rank file is there with the size meta.json records (checkpoints
    written before it recorded sizes: a whole zip archive, torch.save's format). Raises :class:`Damaged`."""
    meta = read_meta(folder)
    m = STEP_RE.match(folder.name)
    for key in ("step", "consumed_samples", "world_size"):
        if isinstance(meta.get(key), bool) or not isinstance(meta.get(key), int):
            raise Damaged(f"{folder / 'meta.json'} has no whole-number {key!r}: not a checkpoint's meta.json")
    step, world = meta["step"], meta["world_size"]
    if m and int(m.group(1)) != step:
        raise Damaged(f"{folder / 'meta.json'} says step {step}, not the folder's")
    sizes = meta.get("files") or {f"rank_{r:05d}.pt": None for r in range(world)}
    for name, size in sizes.items():
        f = folder / name
        if not f.is_file():
            raise Damaged(f"{f} is missing")
        if size is not None and f.stat().st_size != int(size):
            raise Damaged(f"{f} has {f.stat().st_size} bytes, {size} were written: truncated or overwritten")
        if not zipfile.is_zipfile(f):
            raise Damaged(f"{f} is not a whole torch.save archive (truncated?)")
    return meta


def scan(root: Path) -> tuple[list[tuple[Path, dict[str, Any]]], list[tuple[Path, str]]]:
    """Every step folder under ``root`` checked with :func:`verify`: (the whole ones with their meta.json, newest
    first; the damaged ones with what is wrong, newest first)."""
    whole, damaged = [], []
    for _, folder in reversed(step_folders(root)):
        try:
            whole.append((folder, verify(folder)))
        except Damaged as e:
            damaged.append((folder, str(e)))
    return whole, damaged


def none_usable(root: Path, damaged: list[tuple[Path, str]]) -> ConfigError:
    """The error of a checkpoint folder whose step folders are all damaged."""
    why = "; ".join(w for _, w in damaged[:3]) + ("; ..." if len(damaged) > 3 else "")
    return ConfigError(f"no usable checkpoint in {root} ({len(damaged)} damaged: {why}): move its step_* folders "
                       "elsewhere (or delete them) to start again from step 0, or point train.checkpoint_dir "
                       "(or FP4MOE_CKPT_DIR) at another folder")


# ---------------------------------------------------------------------------------------------- RNG

def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel import random as mrandom

    name, key, pos, has_gauss, gauss = np.random.get_state()
    # numpy's key as python ints: the rank file then loads with weights_only=True and no numpy types
    state = {"python": random.getstate(), "numpy": (name, key.tolist(), pos, has_gauss, gauss),
             "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
             "megatron_tracker": mrandom.get_cuda_rng_tracker().get_states()}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    random.setstate(state["python"])
    name, key, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    mrandom.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


# ---------------------------------------------------------------------------------------------- save / load

class Unwritable(ConfigError):
    """A checkpoint could not be written (a full disk, a folder gone); the message names the folder, the cause, the
    newest complete checkpoint and the fix. The unfinished folder is removed."""


def _cause(e: BaseException) -> BaseException:
    """The OSError behind ``e`` (torch.save reports a failed write as a RuntimeError whose context is the OSError)."""
    seen = e
    while seen is not None and not isinstance(seen, OSError):
        seen = seen.__cause__ or seen.__context__
    return seen or e


def _agree(err: str | None, world_size: int) -> str | None:
    """The first rank's error of every rank's ``err`` (collective: every rank calls it)."""
    if world_size > 1 and torch.distributed.is_initialized():
        errs: list[str | None] = [None] * world_size
        torch.distributed.all_gather_object(errs, err)
        err = next((e for e in errs if e), None)
    return err


def save(root: Path, *, step: int, consumed_samples: int, rank: int, world_size: int, model: torch.nn.Module,
         optimizer: Any, schedule: Any, mlflow_run_id: str | None, fingerprint_: dict[str, str],
         keep: int = 2, meter: Any = None) -> Path:
    """Write the checkpoint of ``step`` (collective: every rank calls it). Returns the final folder. ``model``: the
    megatron model (not its DDP wrapper); ``optimizer``: megatron's; ``schedule``: megatron's scheduler; ``meter``:
    the run's throughput / memory measurements so far (``fp4moe.train.metrics.Meter``), carried into a resumed
    run. A write that fails on any rank (disk full, folder gone) raises :class:`Unwritable` on every rank, after rank
    0 removed the unfinished folder; the checkpoints before stay."""
    final = _step_dir(root, step)
    tmp = root / f".{final.name}.tmp"
    payload = {"model": model.state_dict(), "optimizer": optim.optimizer_state_dict(optimizer),
               "schedule": schedule.state_dict(),
               "rng": rng_state(), "step": step, "consumed_samples": consumed_samples, "rank": rank,
               "meter": None if meter is None else meter.state_dict()}

    def failed(err: str | None) -> None:
        if not _agree(err, world_size):
            return
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a half-written checkpoint holds space a full disk needs
        whole = scan(root)[0] if root.is_dir() else []
        newest = f"newest complete checkpoint: {whole[0][0]}" if whole else "no complete checkpoint yet"
        raise Unwritable(f"checkpoint of step {step} could not be written to {root} ({err}); {newest}; free space "
                         "there, or point train.checkpoint_dir (or FP4MOE_CKPT_DIR) at a folder with room, and rerun "
                         "the same command to resume")

    def why(e: BaseException) -> str:
        c = _cause(e)
        return f"{type(c).__name__}: {' '.join(str(c).split())[:300]}"

    err = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            err = why(e)
    failed(err)  # collective: the folder exists before any rank writes into it
    try:
        with open(tmp / f"rank_{rank:05d}.pt", "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch.save: a failed write is a RuntimeError with the OSError behind it
        if not isinstance(_cause(e), OSError):
            raise
        err = why(e)
    del payload
    failed(err)
    trash = root / f".{final.name}.old"
    if rank == 0:
        try:
            files = {f"rank_{r:05d}.pt": (tmp / f"rank_{r:05d}.pt").stat().st_size for r in range(world_size)}
            meta = {"step": step, "consumed_samples": consumed_samples, "world_size": world_size,
                    "mlflow_run_id": mlflow_run_id, "fingerprint": fingerprint_, "time": time.time(), "files": files}
            with open(tmp / "meta.json", "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            if final.exists():  # the same step saved again (e.g. a signal right after a periodic save)
                shutil.rmtree(trash, ignore_errors=True)
                os.replace(final, trash)
                os.replace(tmp, final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(tmp, final)
        except OSError as e:
            err = why(e)
            if trash.exists() and not final.exists():  # the same step's earlier checkpoint goes back in place
                os.replace(trash, final)
    failed(err)
    if rank == 0:
        # the newest `keep` whole ones stay (a damaged folder does not count), damaged ones older than those go, and
        # so do the hidden folders of saves that a kill cut short (the run's only save in progress was this one)
        whole, damaged = scan(root)
        kept = whole[:max(1, keep)]
        oldest = int(kept[-1][1]["step"]) if kept else -1
        for old, _ in whole[len(kept):] + [(d, w) for d, w in damaged if int(d.name[len("step_"):]) < oldest]:
            shutil.rmtree(old, ignore_errors=True)
        for unfinished in root.glob(".step_*"):
            shutil.rmtree(unfinished, ignore_errors=True)
    barrier()
    return final


def read_meta(folder: Path) -> dict[str, Any]:
    """``folder/meta.json``; :class:`Damaged` naming the file when it is missing or not a JSON object."""
    path = folder / "meta.json"
    if not path.is_file():
        raise Damaged(f"{folder} has no meta.json (the commit marker a save writes last): an unfinished save, or "
                      "a damaged folder")
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Damaged(f"{path} cannot be read as JSON ({e})") from None
    if not isinstance(meta, dict):
        raise Damaged(f"{path} holds {type(meta).__name__}, not a checkpoint's JSON object")
    return meta


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


def read_payload(folder: Path, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s file of ``folder``, read with ``weights_only=True`` (:data:`SAFE_GLOBALS`) onto the CPU;
    :class:`Damaged` naming the file when torch cannot read it (truncated, corrupt, or a type outside the
    allowlist: code that loading would run)."""
    path = folder / f"rank_{rank:05d}.pt"
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to read is the file's: RuntimeError, UnpicklingError, EOF
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        advice = ("Weights only load failed", "In PyTorch 2.6", "(1)", "(2)", "Please file an issue", "Check the doc")
        lines = [ln for ln in lines if not ln.startswith(advice)] or lines  # torch's advice to trust the file: no
        refused = [ln for ln in lines if "GLOBAL" in ln]  # weights_only's refusal names the global
        why = (f"{refused[0][:200]} (weights_only: fp4moe does not run code from a checkpoint)" if refused else
               (lines[0] if lines else type(e).__name__)[:300])
        raise Damaged(f"{path} cannot be read: {why}") from None
    if not isinstance(payload, dict) or "step" not in payload:
        raise Damaged(f"{path} is not a rank file of fp4moe's trainer")
    return payload


def load(folder: Path, *, rank: int, model: torch.nn.Module, optimizer: Any, schedule: Any,
         meter: Any = None, payload: dict[str, Any] | None = None) -> dict[str, Any]:
    """Restore this rank's state from ``folder`` (``payload``: its rank file already read by :func:`read_payload`)
    and, given ``meter``, the measurements of the run's earlier processes, where the checkpoint has them; returns
    its ``meta.json`` (step, consumed samples, run id)."""
    meta = read_meta(folder)
    if payload is None:
        payload = read_payload(folder, rank)
    if int(payload["step"]) != int(meta["step"]):
        raise Damaged(f"{folder}: rank file step {payload['step']} != meta step {meta['step']}")
    # the optimizer first: megatron's offloading optimizer moves the weights while it loads (fp4moe.train.optim)
    optim.load_optimizer_state_dict(optimizer, payload["optimizer"])
    model.load_state_dict(payload["model"], strict=True)
    schedule.load_state_dict(payload["schedule"])
    set_rng_state(payload["rng"])
    if meter is not None and payload.get("meter") is not None:
        meter.load_state_dict(payload["meter"])
    return meta


__all__ = ["fingerprint", "run_dir", "save", "load", "read_meta",
           "read_payload", "verify", "scan", "step_folders", "none_usable", "Damaged", "check_compatible",
           "rng_state", "set_rng_state", "FINGERPRINT_KEYS", "SAFE_GLOBALS", "Unwritable"]
