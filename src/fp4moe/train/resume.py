"""Where a run starts: the claim on its checkpoint folder, the checkpoint to resume from, and loading it.

Rank 0 looks at the folder and every rank gets its answer (a broadcast), so that all ranks take the same decision
and raise the same error. In the trainer's order: :func:`claim` (one process per folder, fp4moe.train.attempt),
:func:`candidates` (the whole-looking checkpoints, newest first; before the model is built, so that a finished run
stops before anything expensive), then, with the model, optimizer, scheduler and meter built, :func:`load_newest`
(the newest checkpoint every rank can read; a damaged one is skipped with a warning).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4moe.config import ConfigError
from fp4moe.train.dist import gather_object

log = logging.getLogger("fp4moe.train")


@dataclass
class Start:
    """Where training starts: ``step`` (optimizer updates done), ``consumed`` samples, the MLflow ``run_id`` the
    checkpoint names (None: a new run), the checkpoint ``folder`` (None: from scratch)."""
    step: int = 0
    consumed: int = 0
    run_id: str | None = None
    folder: Path | None = None


def from_rank0(values: list[Any], info: Any) -> list[Any]:
    """Rank 0's ``values`` on every rank (``broadcast_object_list``; collective), as they are alone."""
    if info.world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(values, src=0)
    return values


def claim(root: Path, info: Any) -> Any:
    """fp4moe.train.attempt.claim on rank 0, its outcome shared with every rank (collective): all go on, or all
    raise the same Busy (another process trains ``root``)."""
    from fp4moe.train import attempt

    held, why = None, None
    try:
        held = attempt.claim(root, info.rank == 0, hosts=info.hosts)
    except attempt.Busy as e:
        why = str(e)
    (why,) = from_rank0([why], info)
    if why is not None:
        if held is not None:
            held.release()
        raise attempt.Busy(why)
    return held


def candidates(root: Path, info: Any, *, resume: bool) -> list[tuple[Path, dict[str, Any]]]:
    """The whole-looking checkpoints of ``root`` (``fp4moe.train.checkpoint.scan``), newest first, the same on
    every rank (rank 0 looks; collective): the damaged ones newer than the first are warned about, and a folder
    with step folders but none whole is a ConfigError. ``resume`` false: ConfigError when any step folder exists."""
    from fp4moe.train import checkpoint as ckpt

    found: list[Any] = [None, None]
    if info.rank == 0:
        try:
            whole, damaged = ckpt.scan(root)
            if (whole or damaged) and not resume:
                names = ", ".join(f.name for f, _ in (whole + damaged)[:3])
                raise ConfigError(f"train.resume=false but {root} holds checkpoints ({names}): remove them, set "
                                  "train.checkpoint_dir elsewhere, or resume")
            if damaged and not whole:
                raise ckpt.none_usable(root, damaged)
            newest = whole[0][1]["step"] if whole else -1
            for folder, why in damaged:
                if int(folder.name[len("step_"):]) > newest:
                    log.warning("checkpoint %s is damaged (%s); falling back to the newest complete one", folder, why)
            found = [whole, None]
        except ConfigError as e:
            found = [None, str(e)]
    found = from_rank0(found, info)
    if found[1] is not None:
        raise ConfigError(found[1])
    return found[0]


def load_newest(root: Path, found: list[tuple[Path, dict[str, Any]]], info: Any, parts: Any,
                fingerprint: dict[str, str], settings: dict[str, Any] | None = None) -> Start:
    """Load the newest of ``found`` (from :func:`candidates`) whose files every rank can read into ``parts``
    (fp4moe.train.components.Components: model, optimizer, scheduler, meter); a damaged one is warned about and
    the previous one tried. Collective. No candidates: :class:`Start` at step 0. Every candidate damaged: the
    ConfigError of ``checkpoint.none_usable``."""
    from fp4moe.train import checkpoint as ckpt

    unreadable: list[tuple[Path, str]] = []
    for folder, meta in found:
        ckpt.check_compatible(folder, meta, world_size=info.world_size, fingerprint_=fingerprint, settings=settings)
        sharded = meta.get("format") == ckpt.SHARDED
        payload = why = None
        if sharded:  # collective: torch's loader reports a rank's failure to every rank
            try:
                meta = ckpt.load_sharded(folder, rank=info.rank, world_size=info.world_size, model=parts.model,
                                         optimizer=parts.opt, schedule=parts.sched, meter=parts.meter)
            except ckpt.Damaged as e:
                why = str(e)
        else:
            try:
                payload = ckpt.read_payload(folder, info.rank)
            except ckpt.Damaged as e:
                why = str(e)
        whys = gather_object(why, info.world_size)  # every rank resumes from the same one
        bad = [w for w in whys if w]
        if bad:
            if info.is_main:
                log.warning("checkpoint %s is damaged (%s); falling back to the previous one", folder, bad[0])
            unreadable.append((folder, bad[0]))
            continue
        if not sharded:
            meta = ckpt.load(folder, rank=info.rank, model=parts.model, optimizer=parts.opt, schedule=parts.sched,
                             meter=parts.meter, payload=payload)
            del payload
        start = Start(step=int(meta["step"]), consumed=int(meta["consumed_samples"]),
                      run_id=meta.get("mlflow_run_id"), folder=folder)
        if info.is_main:
            log.info("resumed from %s (step %d, %d samples consumed)", folder, start.step, start.consumed)
        return start
    if found:  # every complete-looking one failed to load
        raise ckpt.none_usable(root, unreadable)
    return Start()


__all__ = ["Start", "candidates", "claim", "from_rank0", "load_newest"]
