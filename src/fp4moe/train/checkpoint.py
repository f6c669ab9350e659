"""Atomic, resumable checkpoints: ``<run dir>/step_NNNNNNN/`` (:func:`run_dir`), in one of two formats
(``train.checkpoint_format``), both read back.

**sharded** (the default): megatron-core's ``dist_checkpointing`` with its torch_dist backend (torch.distributed.
checkpoint files ``__R_K.distcp``, their index ``.metadata``, megatron's ``common.pt`` and ``metadata.json``). The
model's ``sharded_state_dict()`` names every tensor globally (layers by global number, routed experts by global
index, each with its offsets in the global tensor) and the optimizer's ``sharded_state_dict`` puts the FP32 main
params and AdamW moments beside it in the same model space (megatron's ``fully_reshardable`` form for the
distributed optimizer, :data:`OPTIMIZER_METADATA`), so a checkpoint resumes at any world size and DP / EP / PP
layout: each process reads the parts of the global tensors it holds now. The trainer's own state is in the common
state (``common.pt``, key ``fp4moe``): step, consumed samples (the data order: the sampler is a function of them),
megatron's scheduler, and each rank's RNG states, measurements and coordinates. At the same layout every rank gets
its own RNG states back; at another, a rank takes those of a saved rank with its pipeline / tensor / expert /
expert-tensor coordinates (the data-parallel replicas are seeded alike), and where the checkpoint has none (a rank
the old layout did not have, e.g. expert rank 1 after EP1) the CPU generators of saved rank 0 and its own freshly
seeded CUDA and megatron tracker states, with a warning (:func:`_restore_rng`). The throughput measurements carry
over at the same world size only. Nothing of it runs code from the file: common.pt and the byte entries of the
shards load with ``weights_only=True`` (:func:`_weights_only_loads`), and torch's ``.metadata`` pickle is read by an
unpickler that knows torch's checkpoint classes only before megatron opens it (:func:`check_sharded_files`).
megatron-core without TE / apex needs two workarounds here (fp4moe.train.optim, workaround 6;
fp4moe.model.cpu_shims 0d), on CPU two more (cpu_shims 10, 11).

**per_rank**: each rank writes ``rank_RRRRR.pt`` (model state dict incl. the router expert-bias buffers, megatron's
optimizer state with this rank's FP32 main params and AdamW moments (fp4moe.train.optim.optimizer_state_dict),
megatron's scheduler, RNG states of python / numpy / torch / CUDA / megatron's tracker), resumed at the same world
size and layout only. Rank files are read with ``torch.load(weights_only=True)``: tensors, containers, numbers and
strings, plus the classes of :data:`SAFE_GLOBALS`.

Both are written into a hidden temporary folder ``.step_NNNNNNN.tmp``; after a barrier rank 0 writes ``meta.json``
(step, consumed samples, MLflow run id, the run's fingerprint and the settings behind it, world size, format, each
file's size in bytes: the commit marker, written last) and renames the folder into place. A run killed mid-save
leaves only the hidden folder, so it resumes from the previous checkpoint (the next save removes the hidden folder).
The newest ``keep`` whole checkpoints are kept, damaged folders older than those removed. A save that cannot be
written (a full disk) removes its unfinished folder and stops the run with one line (:class:`Unwritable`).

A ``step_NNNNNNN`` folder that is damaged (no ``meta.json``, a ``meta.json`` that does not parse, a file missing or
shorter than ``meta.json`` says, a rank file that is not a whole torch.save archive, or a file that torch cannot
read) is skipped with a warning naming it, and the run resumes from the newest complete one (:func:`scan`,
:func:`read_payload`, :func:`load_sharded`); with none left, a ConfigError names the folder and the fix.

Resuming needs the same fingerprint (:func:`fingerprint`: the config groups that change what is trained, the
optimizer group included); run length, intervals and logging may differ, and for a sharded checkpoint the parallel
layout (:data:`LAYOUT_KEYS`: world size, TP / PP / CP / EP / DP sizes, micro-batch) and DDP's gradient buckets
(:data:`SCHEDULING_KEYS`) too. A refusal names the keys that differ, with both values.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import queue
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
from torch.distributed.checkpoint.api import CheckpointException

from fp4moe.atomic_write import writable_ancestor
from fp4moe.config import ConfigError
from fp4moe.settings import drop_absent
from fp4moe.train import optim
from fp4moe.train.dist import barrier, gather_object

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
# parallel.* keys that say how the work is spread over the processes, not what is trained: a sharded checkpoint
# resumes when only these differ (global_batch, seq_length, dispatcher and any other parallel.* key must match).
LAYOUT_KEYS = ("world_size", "tensor", "pipeline", "virtual_pipeline", "pipeline_layout", "context", "expert",
               "expert_tensor", "data", "sequence_parallel", "micro_batch")
# Per group, the keys a sharded checkpoint may resume with changed: the layout, and megatron DDP's gradient buckets
# (overlap_grad_reduce and bucket_size set them: without overlap megatron makes one bucket). A sharded checkpoint
# holds the optimizer state per parameter (fully_reshardable), whatever the buckets; a per-rank one holds each
# rank's bucket shards as they are (dp_reshardable), so it needs the same buckets. Either changes the order of some
# fp32 sums only, as another layout does. Fingerprint entry ``<group>.trained``: the group without these keys.
SCHEDULING_KEYS: dict[str, tuple[str, ...]] = {"parallel": LAYOUT_KEYS,
                                               "optimizer": ("overlap_grad_reduce", "bucket_size")}
# keys of a FINGERPRINT_KEYS group that change neither what is trained nor what a checkpoint holds (the same bits
# either way): a run resumes with them changed, and checkpoints written before they existed still match
NOT_FINGERPRINTED = {"optimizer": ("overlap_param_gather",)}
FORMATS = ("sharded", "per_rank")  # train.checkpoint_format; the first is the default
SHARDED = "torch_dist"  # meta.json's "format" of a sharded checkpoint (per-rank checkpoints have no "format")


def fingerprinted(cfg: Any) -> dict[str, Any]:
    """The values behind :func:`fingerprint`: each FINGERPRINT_KEYS entry of the resolved config as plain JSON data,
    without the nulls of fp4moe.settings.ABSENT_WHEN_NULL and the keys of NOT_FINGERPRINTED. A checkpoint keeps
    them (meta.json ``"settings"``) so that a refused resume can name the keys that differ."""
    out = {}
    for key in FINGERPRINT_KEYS:
        node = OmegaConf.select(cfg, key)
        # a null the groups' schemas add for a key not given is left out: checkpoints from before them still match
        value = drop_absent(key, OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node)
        if isinstance(value, dict) and key in NOT_FINGERPRINTED:
            value = {k: v for k, v in value.items() if k not in NOT_FINGERPRINTED[key]}
        out[key] = value
    return json.loads(json.dumps(out, default=str))


def fingerprint(cfg: Any) -> dict[str, str]:
    """sha256 (16 hex digits) of each entry of :func:`fingerprinted`, and (``<group>.trained``) of each group of
    SCHEDULING_KEYS without those keys."""
    def digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]

    values = fingerprinted(cfg)
    out = {key: digest(value) for key, value in values.items()}
    for group, keys in SCHEDULING_KEYS.items():
        whole = values[group]
        if group == "parallel":  # as checkpoints have had it from the start: the resolved group, nulls included
            node = OmegaConf.select(cfg, group)
            whole = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})
        out[f"{group}.trained"] = digest({k: v for k, v in whole.items() if k not in keys})
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
    (``CHECKPOINT_BYTES_PER_PARAM`` per parameter, an upper bound). Leaves nothing behind."""
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
    if meta.get("format") == SHARDED and not (isinstance(meta.get("files"), dict) and meta["files"]):
        raise Damaged(f"{folder / 'meta.json'} lists no files: not a sharded checkpoint's meta.json")
    for name, size in sizes.items():
        f = folder / name
        if not f.is_file():
            raise Damaged(f"{f} is missing")
        if size is not None and f.stat().st_size != int(size):
            raise Damaged(f"{f} has {f.stat().st_size} bytes, {size} were written: truncated or overwritten")
        if name.endswith(".pt") and not zipfile.is_zipfile(f):
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
    return next((e for e in gather_object(err, world_size) if e), None)


def save(root: Path, *, step: int, consumed_samples: int, rank: int, world_size: int, model: torch.nn.Module,
         optimizer: Any, schedule: Any, mlflow_run_id: str | None, fingerprint_: dict[str, str],
         keep: int = 2, meter: Any = None, format_: str = FORMATS[0], settings: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint of ``step`` (collective: every rank calls it). Returns the final folder. ``model``: the
    megatron model (not its DDP wrapper); ``optimizer``: megatron's; ``schedule``: megatron's scheduler; ``meter``:
    the run's throughput / memory measurements so far (``fp4moe.train.metrics.Meter``), carried into a resumed run;
    ``format_``: ``sharded`` (megatron-core dist_checkpointing, any layout resumes) or ``per_rank`` (one torch.save
    file per rank, the same layout resumes); ``settings``: the run's :func:`fingerprinted` values, kept in meta.json
    for the error of a resume that does not match. A write that fails on any rank (disk full, folder gone) raises
    :class:`Unwritable` on every rank, after rank 0 removed the unfinished folder; the checkpoints before stay."""
    _check_format(format_)
    final = _step_dir(root, step)
    tmp = root / f".{final.name}.tmp"

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

    err = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            err = _why(e)
    failed(err)  # collective: the folder exists before any rank writes into it
    if format_ == "per_rank":
        payload = {"model": model.state_dict(), "optimizer": optim.optimizer_state_dict(optimizer),
                   "schedule": schedule.state_dict(),
                   "rng": rng_state(), "step": step, "consumed_samples": consumed_samples, "rank": rank,
                   "meter": None if meter is None else meter.state_dict()}
        err = _write_rank_file(tmp / f"rank_{rank:05d}.pt", payload)
        del payload
    else:
        err = _write_sharded(tmp, step=step, consumed_samples=consumed_samples, world_size=world_size, model=model,
                             optimizer=optimizer, schedule=schedule, meter=meter)
    failed(err)
    trash = root / f".{final.name}.old"
    if rank == 0:
        try:
            if format_ == "per_rank":
                files = {f"rank_{r:05d}.pt": (tmp / f"rank_{r:05d}.pt").stat().st_size for r in range(world_size)}
            else:
                files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file()}
            meta = {"step": step, "consumed_samples": consumed_samples, "world_size": world_size,
                    "mlflow_run_id": mlflow_run_id, "fingerprint": fingerprint_, "time": time.time(), "files": files}
            if format_ == "sharded":
                meta["format"] = SHARDED
            if settings is not None:
                meta["settings"] = settings
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
            err = _why(e)
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
            # hidden first (one rename), then removed: a kill meanwhile leaves no half-removed step folder
            hidden = root / f".{old.name}.old"
            shutil.rmtree(hidden, ignore_errors=True)
            try:
                os.replace(old, hidden)
            except OSError:
                continue
            shutil.rmtree(hidden, ignore_errors=True)
        for unfinished in root.glob(".step_*"):
            shutil.rmtree(unfinished, ignore_errors=True)
    barrier()
    return final


def _check_format(fmt: str) -> str:
    """``fmt`` if it is one of :data:`FORMATS`, else a ConfigError naming them."""
    if fmt not in FORMATS:
        raise ConfigError(f"train.checkpoint_format={fmt!r}: pick one of {', '.join(FORMATS)}")
    return fmt


def format_of(cfg: Any) -> str:
    """The config's ``train.checkpoint_format`` (absent: ``FORMATS[0]``), checked (ConfigError naming the choices)."""
    return _check_format(str(OmegaConf.select(cfg, "train.checkpoint_format", default=FORMATS[0])))


def _why(e: BaseException) -> str:
    """One line of the OSError behind ``e`` (or of ``e``): ``OSError: [Errno 28] ...``."""
    c = _cause(e)
    return f"{type(c).__name__}: {' '.join(str(c).split())[:300]}"


def _write_rank_file(path: Path, payload: dict[str, Any]) -> str | None:
    """torch.save ``payload`` to ``path`` and fsync it; the error line of a failed write (None: written)."""
    try:
        with open(path, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch.save: a failed write is a RuntimeError with the OSError behind it
        if not isinstance(_cause(e), OSError):
            raise
        return _why(e)
    return None


# ---------------------------------------------------------------------------------------------- sharded format

# megatron's DistributedOptimizer state as 'fully_reshardable': each DP group's whole state gathered on every rank for
# the save and read whole on every rank for the load (host memory: the state of the parameters a DP group holds), keyed
# by the model parameters' global names, so it resumes at any DP / EP / PP layout. The two other forms do not serve:
# 'fully_sharded_model_space' (each rank's own flat range, no gather) raises "ShardedTensor.flattened_range is not
# supported" in megatron-core 0.16.1, and 'dp_reshardable' (megatron's buckets as they are) reshards over DP only.
# The optimizers that are not distributed (gpu_fp32) save their main params and moments in model space whatever this
# says.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
COMMON_KEY = "fp4moe"  # the trainer's own state in the checkpoint's common state (common.pt)
# What the pickle of torch.distributed.checkpoint's `.metadata` may name besides its own classes: checked before
# megatron hands the file to pickle.load (no code from a checkpoint runs, as with weights_only for the rest).
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


def _layout() -> dict[str, int]:
    """This process's megatron coordinates: pipeline, tensor, expert, expert-tensor and data-parallel rank."""
    from megatron.core import parallel_state as ps

    return {"pp": ps.get_pipeline_model_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank(),
            "ep": ps.get_expert_model_parallel_rank(), "etp": ps.get_expert_tensor_parallel_rank(),
            "dp": ps.get_data_parallel_rank()}


def _sharded_state_dict(model: torch.nn.Module, optimizer: Any, *, is_loading: bool) -> dict[str, Any]:
    """megatron's sharded state dict of the model (global names; experts by global index; layers by global number)
    and of the optimizer over it (OPTIMIZER_METADATA). The model's metadata names its data-parallel group, as
    megatron-lm's checkpointing passes it: megatron-core 0.16.1's ``GPTModel.sharded_state_dict`` reads
    ``metadata['dp_cp_group']`` itself on a stage with the MTP block but not the embedding, where None fails."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    model_sd = model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
    return {"model": model_sd, "optimizer": optim.sharded_optimizer_state_dict(
        optimizer, model_sd, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))}


def _tensors_only(x: Any) -> Any:
    """The sharded tensors (megatron ``ShardedBase``) of state dict ``x`` in nested dicts keyed as in ``x`` (a
    list's positions as int keys); every other value left out. Only these are stored: what else megatron's state
    dicts hold depends on the layout (one chained optimizer at EP1, two at EP > 1; param-group indices; local layer
    names) and is the resuming run's own (AdamW's step count is the checkpoint's step, fp4moe.train.optim)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(x, ShardedBase):
        return x
    out = {}
    for k, v in (x.items() if isinstance(x, dict) else enumerate(x)):
        if isinstance(v, (dict, list, ShardedBase)):
            t = _tensors_only(v)
            if isinstance(t, ShardedBase) or t:
                out[k] = t
    return out


def _put_back(x: Any, loaded: dict[Any, Any]) -> None:
    """Replace the sharded tensors of state dict ``x`` by what ``dist_checkpointing.load`` read for
    :func:`_tensors_only` of it (``loaded``) and unwrap its LocalNonpersistentObjects, in place."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    def put(into: Any, got: dict[Any, Any]) -> None:
        for k, v in got.items():
            if isinstance(into[k], ShardedBase):
                into[k] = v
            else:
                put(into[k], v)

    put(x, loaded)
    # what megatron marks as this run's own (e.g. the param groups' parameter indices), as its load unwraps it
    dict_list_map_inplace(lambda v: v.unwrap() if isinstance(v, LocalNonpersistentObject) else v, x)


def _write_sharded(tmp: Path, *, step: int, consumed_samples: int, world_size: int, model: torch.nn.Module,
                   optimizer: Any, schedule: Any, meter: Any) -> str | None:
    """megatron-core ``dist_checkpointing.save`` (torch_dist backend) of the model, the optimizer and, in the common
    state, the trainer's own (step, consumed samples, scheduler, every rank's RNG states, measurements and
    coordinates); the error line of a failed write (None: written). Collective."""
    from megatron.core import dist_checkpointing

    ranks = gather_object({"rng": rng_state(), "meter": None if meter is None else meter.state_dict(),
                     "layout": _layout()}, world_size)
    sd = _tensors_only(_sharded_state_dict(model, optimizer, is_loading=False))
    sd[COMMON_KEY] = {"step": step, "consumed_samples": consumed_samples, "world_size": world_size,
                      "schedule": schedule.state_dict(), "ranks": ranks}
    try:
        with _sync_writer():
            dist_checkpointing.save(sd, str(tmp), sharded_strategy=("torch_dist", 1))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - torch's writer: each failed rank's error
        if isinstance(_cause(e), OSError):
            return _why(e)
        m = re.search(r"\[Errno \d+\][^\n']*", str(e))
        if not m:
            raise
        return f"OSError: {' '.join(m.group(0).split())}"[:300]
    return None


class _OSErrorQueue:
    """A writer process's results queue that passes on the OSError behind a failed write (torch.save reports a
    failed write as a RuntimeError, whose context the queue's pickle drops)."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def put(self, item: Any) -> None:
        idx, result = item
        if isinstance(result, BaseException) and isinstance(_cause(result), OSError):
            c = _cause(result)
            result = OSError(c.errno, c.strerror) if c.errno is not None else OSError(str(c))
        self.queue.put((idx, result))


@contextlib.contextmanager
def _sync_writer():
    """megatron-core's torch_dist writer (``FileSystemWriterAsync``, which forks a process per file) as the trainer's
    synchronous save uses it: (1) its results queue is an in-process ``queue.Queue`` (megatron's default, made on
    first use, is a ``multiprocessing`` Manager queue: a server process that outlives a ``kill -9`` of the trainer,
    holding its stdout); (2) a failed write reaches the caller as ``[Errno N] ...`` (a full disk: ``[Errno 28] No
    space left on device``) instead of torch's ``unexpected pos`` message."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if filesystem_async._results_queue is None:  # read and written by this process only in a synchronous save
        filesystem_async._results_queue = queue.Queue()
    upstream = FileSystemWriterAsync.__dict__["write_preloaded_data"]
    write = upstream.__func__

    def write_preloaded_data(*args: Any, results_queue: Any = None, **kwargs: Any) -> Any:
        return write(*args, results_queue=_OSErrorQueue(results_queue), **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)  # type: ignore[method-assign]
    try:
        yield
    finally:
        FileSystemWriterAsync.write_preloaded_data = upstream  # type: ignore[method-assign]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module.startswith("torch.distributed.checkpoint.") or (module, name) in _METADATA_GLOBALS
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed")


def check_sharded_files(folder: Path) -> None:
    """:class:`Damaged` naming the file when ``folder``'s ``.metadata`` (torch's index of the shards, a pickle) names
    anything but torch's checkpoint metadata classes, or does not unpickle."""
    path = folder / ".metadata"
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise Damaged(f"{path} cannot be read: {e} (fp4moe does not run code from a checkpoint)") from None
    except Exception as e:  # noqa: BLE001 - a truncated or corrupt pickle: EOFError, ValueError, ...
        raise Damaged(f"{path} cannot be read: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None


class _WeightsOnlyTorch:
    """torch, whose ``load`` reads with ``weights_only=True`` and :data:`SAFE_GLOBALS` whatever its caller asks."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def load(f: Any, *args: Any, weights_only: Any = None, **kwargs: Any) -> Any:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(f, *args, weights_only=True, **kwargs)


@contextlib.contextmanager
def _weights_only_loads():
    """While megatron-core loads a sharded checkpoint, every torch.load of its files is ``weights_only=True``:
    common.pt (megatron's common strategy) and the byte entries in the shards (torch's DefaultLoadPlanner reads them
    with ``weights_only=False``; megatron saves an ``_extra_state`` of each linear layer there)."""
    from megatron.core.dist_checkpointing.strategies import common
    from torch.distributed.checkpoint import default_planner

    saved = common.torch, default_planner.torch
    common.torch = default_planner.torch = _WeightsOnlyTorch()  # type: ignore[assignment]
    try:
        yield
    finally:
        common.torch, default_planner.torch = saved


def _restore_rng(ranks: list[dict[str, Any]], rank: int) -> str | None:
    """Set this process's RNG states from the checkpoint's per-rank ones (``ranks``); returns what could not be
    restored (None: everything). The saved rank with this process's coordinates (the same rank at the same
    layout; at another layout the first with the same pipeline, tensor, expert and expert-tensor rank: megatron seeds
    the data-parallel replicas alike) gives all of its states; with none such (e.g. expert rank 1 of EP2 after EP1)
    the python / numpy / torch CPU generators come from saved rank 0 (the trainer seeds them alike on every rank and
    draws nothing from them per rank) and the CUDA and megatron tracker states stay as seeded."""
    me = _layout()
    if rank < len(ranks) and ranks[rank].get("layout") == me:
        set_rng_state(ranks[rank]["rng"])
        return None
    coords = ("pp", "tp", "ep", "etp")
    same = [r for r in ranks if all((r.get("layout") or {}).get(k) == me[k] for k in coords)]
    if same:
        set_rng_state(same[0]["rng"])
        return None
    state = dict(ranks[0]["rng"])
    state["cuda"] = None
    from megatron.core.tensor_parallel import random as mrandom

    state["megatron_tracker"] = mrandom.get_cuda_rng_tracker().get_states()
    set_rng_state(state)
    return (f"no saved rank at pipeline / tensor / expert / expert-tensor rank "
            f"{me['pp']} / {me['tp']} / {me['ep']} / {me['etp']}: its CUDA and megatron tracker RNG states start "
            "from the seed")


def load_sharded(folder: Path, *, rank: int, world_size: int, model: torch.nn.Module, optimizer: Any, schedule: Any,
                 meter: Any = None) -> dict[str, Any]:
    """Restore a sharded checkpoint (collective) at this run's layout, whatever the layout that wrote it: model and
    optimizer through megatron-core ``dist_checkpointing.load``, the scheduler, the RNG states (:func:`_restore_rng`)
    and, at the same world size, the measurements. Returns ``meta.json``. :class:`Damaged` when a file cannot be
    read (on every rank: torch's loader reports each rank's failure to all)."""
    from megatron.core import dist_checkpointing

    meta = read_meta(folder)
    check_sharded_files(folder)
    sd = _sharded_state_dict(model, optimizer, is_loading=True)
    try:
        with _weights_only_loads():
            state = dist_checkpointing.load(_tensors_only(sd), str(folder))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a file that cannot be read, on any rank
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        raise Damaged(f"{folder} cannot be read: {type(e).__name__}: {(lines[0] if lines else '')[:300]}") from None
    common = state.pop(COMMON_KEY)
    if int(common["step"]) != int(meta["step"]):
        raise Damaged(f"{folder}: common state step {common['step']} != meta step {meta['step']}")
    _put_back(sd, state)
    # the optimizer first: megatron's offloading optimizer moves the weights while it loads (fp4moe.train.optim)
    optim.load_sharded_optimizer_state_dict(optimizer, sd["optimizer"], step=int(common["step"]))
    model.load_state_dict(sd["model"], strict=True)
    schedule.load_state_dict(common["schedule"])
    ranks = common["ranks"]
    missing = _restore_rng(ranks, rank)
    if missing:
        log.warning("rank %d resumes %s at another layout: %s", rank, folder, missing)
    if meter is not None and len(ranks) == world_size and ranks[rank].get("meter") is not None:
        meter.load_state_dict(ranks[rank]["meter"])
    return meta


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


def check_compatible(folder: Path, meta: dict[str, Any], *, world_size: int, fingerprint_: dict[str, str],
                     settings: dict[str, Any] | None = None) -> None:
    """ConfigError naming what differs when the checkpoint in ``folder`` belongs to another run. A sharded checkpoint
    resumes at any world size and parallel layout and with other DDP buckets (SCHEDULING_KEYS); a per-rank one only
    at its own. ``settings``: this run's :func:`fingerprinted` values; where the checkpoint has its own (meta.json
    ``"settings"``, written since 2026-12-08), the error names each key that differs and both values."""
    sharded = meta.get("format") == SHARDED
    if not sharded and int(meta["world_size"]) != world_size:
        raise ConfigError(f"checkpoint {folder} was written by {meta['world_size']} processes, this run has "
                          f"{world_size}: a per-rank checkpoint resumes only at its own parallel layout; resume with "
                          "it, or use another train.checkpoint_dir")
    saved = meta.get("fingerprint") or {}
    keys = list(FINGERPRINT_KEYS)
    if sharded:  # <group>.trained instead of the group, where the checkpoint has it (optimizer.trained: 2026-12-08)
        keys = [f"{k}.trained" if k in SCHEDULING_KEYS and f"{k}.trained" in saved else k for k in keys]
    differs = [k for k in keys if saved.get(k) != fingerprint_.get(k)]
    if not differs:
        return
    groups = [k.removesuffix(".trained") for k in differs]
    layout = "" if sharded or "parallel" not in groups else (
        " (a per-rank checkpoint resumes only at its own parallel layout)")
    skip = {g: SCHEDULING_KEYS[g] for g, k in zip(groups, differs) if k != g}  # compared as <group>.trained
    said = _differences(meta.get("settings"), settings, groups, skip=skip)
    raise ConfigError(f"checkpoint {folder} belongs to a run with other {', '.join(groups)}{layout}{said}: resume "
                      "with the same config, point train.checkpoint_dir elsewhere, or set train.resume=false with an "
                      "empty checkpoint folder")


def _differences(saved: Any, now: dict[str, Any] | None, groups: list[str], *, skip: dict[str, tuple[str, ...]],
                 most: int = 6) -> str:
    """`` (key: <value> in the checkpoint, <value> here; ...)`` for the keys of ``groups`` whose values differ
    between a checkpoint's settings and this run's (not those of ``skip[group]``), values as JSON; '' where either is
    unknown."""
    from fp4moe.train.metrics import flatten

    if not isinstance(saved, dict) or not now:
        return ""
    lines = []
    for group in groups:
        a, b = (flatten(side.get(group, {}), f"{group}.", json.dumps) for side in (saved, now))
        for key in sorted(set(a) | set(b)):
            if key[len(group) + 1:].split(".")[0] in skip.get(group, ()):
                continue
            was, is_ = a.get(key, "absent"), b.get(key, "absent")
            if was != is_:
                lines.append(f"{key}: {was} in the checkpoint, {is_} here")
    if not lines:
        return ""
    more = f"; and {len(lines) - most} more" if len(lines) > most else ""
    return " (" + "; ".join(lines[:most]) + more + ")"


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


__all__ = ["fingerprint", "fingerprinted", "run_dir", "save", "load", "read_meta",
           "read_payload", "verify", "scan", "step_folders", "none_usable", "Damaged", "check_compatible",
           "rng_state", "set_rng_state", "FINGERPRINT_KEYS", "SAFE_GLOBALS", "Unwritable", "load_sharded",
           "check_sharded_files", "LAYOUT_KEYS", "SCHEDULING_KEYS", "FORMATS", "format_of", "SHARDED",
           "OPTIMIZER_METADATA"]
