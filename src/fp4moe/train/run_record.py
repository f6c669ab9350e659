"""What the trainer's MLflow run records about itself before the first step: its name, params and tags.

:func:`describe` is pure (no store, no collective): params are the resolved config flattened (``hydra`` left out),
the derived quantities as ``derived.*``, the recipe's tag, the commit and the data's facts; tags are the hardware,
the cell's identity (recipe, recompute, model, optimizer), the checkpoint folder, the hosts, the Slurm job and the
caller's own ``tracking.tags``. The trainer hands them to ``fp4moe.train.metrics.Tracker.start``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from fp4moe.launch import slurm
from fp4moe.tracking import mlflow_store
from fp4moe.train.dist import host_tags


@dataclass
class RunRecord:
    """``name`` ``<task>/<model>/<recipe>/<recompute>``, ``params`` and ``tags`` (str -> str), ``recipe`` (the
    preset's name or a variant's label, e.g. mxfp4_mlp_shared), ``store`` (the tracking URI without
    credentials)."""
    name: str
    params: dict[str, str]
    tags: dict[str, str]
    recipe: str
    store: str


def describe(cfg: Any, derived: dict[str, Any], info: Any, settings: Any, dinfo: dict[str, Any],
             root: Path) -> RunRecord:
    """The run's record for ``cfg`` (``settings``: its fp4moe.settings.Settings, whose recipe, recompute scope,
    model and optimizer it names) trained on ``info``'s ranks, on data ``dinfo``, checkpointing into ``root``."""
    from fp4moe.train.metrics import flatten, hardware_tags

    store = mlflow_store.without_credentials(mlflow_store.config_uri(cfg))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    params = flatten({k: v for k, v in resolved.items() if k != "hydra"})
    params["tracking.uri"] = store
    params.update({f"derived.{k}": str(v) for k, v in derived.items()})
    recipe = settings.precision.tag
    params.update({"recipe": recipe, "git_commit": mlflow_store.environment_tags()["mlflow.source.git.commit"],
                   "data.vocab_size_tokenizer": str(dinfo.get("vocab_size")),
                   "data.train_tokens": str(dinfo.get("train_tokens")),
                   "data.valid_tokens": str(dinfo.get("valid_tokens")),
                   "data.tokenizer_path": str(dinfo.get("tokenizer_path")),
                   "data.dataset_prefix": str(dinfo.get("dataset_prefix"))})
    tags = hardware_tags(info.device, info.world_size, info.launcher)
    tags.update({"recipe": recipe, "recompute": settings.recompute.name, "model": settings.model.name,
                 "optimizer": settings.optimizer.name, "checkpoint_dir": str(root), **host_tags(info.hosts),
                 **slurm.job_tags()})
    extra = OmegaConf.select(cfg, "tracking.tags", default=None) or {}  # the caller's own (fp4moe.reproduce.train_runs)
    tags.update({str(k): str(v) for k, v in extra.items()})
    name = f"{cfg.get('task_name', 'train')}/{settings.model.name}/{recipe}/{settings.recompute.name}"
    return RunRecord(name=name, params=params, tags=tags, recipe=recipe, store=store)


__all__ = ["RunRecord", "describe"]
