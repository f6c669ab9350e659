"""The run folder of ``python -m fp4moe.train``, stable for a config: the same command finds a stopped run again.

conf/train.yaml sets ``hydra.run.dir: ${paths.log_dir}/${task_name}/runs/${fp4moe.run_name:}``; the resolver
(fp4moe.resolvers) gives :func:`name`, ``<model>-<precision>-<recompute>-<12 hex digits>``, e.g.
``logs/train/runs/tiny_cpu-mxfp4-none-0123456789ab``. The digits are the sha256 of :func:`identity`: the composed
config, resolved, without the keys of :data:`EXCLUDED` (where and how a run is recorded, not what it trains). So

- one config spelled two ways (``precision=mxfp4`` or nothing, ``train.seed=1234`` or nothing) is one folder, and an
  environment variable the config reads (``FP4MOE_CORPUS`` into ``data.path``) counts by its value;
- an excluded override (``train.progress_bar=false``, ``train.checkpoint_interval=5``) lands in the same folder;
- every other key is part of the run: ``precision``, ``train.seed``, ``train.steps`` / ``train.tokens`` (the run's
  length sets its LR schedule and its figures: a longer run is another run; to extend a finished run on purpose,
  pass its folder, ``hydra.run.dir=<folder>``, which the checkpoint's fingerprint allows), ``train.eval_interval``,
  ``train.measure``, ``train.profile`` (a rerun with a profile window profiles instead of finding the run finished).

The kernel switches are part of it (``kernels.*``, each defaulting to its ``FP4MOE_*`` variable, which therefore
counts by its value): an A/B of a switch is two runs in two folders. An explicit ``hydra.run.dir=...`` wins over the
default. Multirun cells keep their own folders (``hydra.sweep``).

No torch, no Hydra; OmegaConf (and fp4moe.settings' key list) only.
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Any

# drop_absent: the keys the config groups' schemas add with a null that means "not given" (ABSENT_WHEN_NULL) left
# out while null, as a checkpoint's fingerprint leaves them out; WHOLE_WHEN_INTEGRAL: counts the schemas type as
# float (a token budget may be 3.0e11), written as the integer they equal. Both so that a config spelled before the
# schemas existed keeps its folder.
from fp4moe.settings import WHOLE_WHEN_INTEGRAL, drop_absent

# The keys of the composed config that do not change what a run trains or reports, each with why: the run folder's
# identity leaves them out, so changing one continues the same run. Everything else is part of the identity.
EXCLUDED: dict[str, str] = {
    "hydra": "Hydra's own settings: output folders, launcher, sweeper, logging",
    "task_name": "already the folder's parent (<log_dir>/<task_name>/runs/)",
    "paths": "where the logs go",
    "tracking": "which MLflow store, experiment name and extra tags record the run (a resumed run continues the MLflow "
                "run its checkpoint names)",
    "cluster": "the machine and the job: Slurm resources and time limit, host threads and environment (the layout "
               "is parallel.*, which fp4moe.config.check ties to cluster.nodes x cluster.gpus_per_node)",
    "data.dir": "where the prepared tokens are kept (a build is found by the hash of its inputs, fp4moe.data)",
    "data.cache_dir": "where the downloaded corpus is kept",
    "train.progress_bar": "the console only",
    "train.hooks": "after-step hooks of your own (fp4moe.train.hooks): they see the loop between steps, not the "
                   "model, data or optimizer, so they watch, checkpoint or stop a run, not change what it trains; a "
                   "run a hook failed or slowed resumes with the same command, with the hook or without it",
    "train.log_interval": "how often MLflow gets the step metrics, not their values",
    "train.checkpoint_interval": "when checkpoints are written (a resume continues bit for bit from any of them)",
    "train.keep_checkpoints": "how many checkpoints are kept",
    "train.checkpoint_format": "how checkpoints are stored (both formats are read back)",
    "train.checkpoint_dir": "where checkpoints are written",
    "train.resume": "whether an existing run may continue: train.resume=false must find the run it refuses to "
                    "overwrite",
}
# Switches added after their group, each with its default: left out of the identity while at that default, so the
# folders of runs composed before the switch existed stay where they were (a non-default value is part of it). A
# default that changed later (kernels.gather_sum: torch until 2026-12-06; train.wgrad_accumulation_fusion: false
# until 2026-12-06) moves with it: a folder names a config, the code that ran it is the run's commit tag.
ABSENT_WHEN_DEFAULT: dict[str, Any] = {"kernels.bf16_moe": "megatron", "train.wgrad_accumulation_fusion": True,
                                       "kernels.wgrad_gemm": "triton", "kernels.fp8_row_col": "0",
                                       "kernels.fused_swiglu_fp8": "0", "kernels.gather_sum": "triton",
                                       "optimizer.overlap_param_gather": False}
HASH_DIGITS = 12


def _kernels_as_run(node: Any) -> Any:
    """The ``kernels`` node with each switch as it runs (``fp4moe_kernels.switches.Switches``' normal form: a 0 / 1
    switch given as true / false, a choice in capitals), so that one setting spelled two ways is one run; a node with
    a value no switch takes is left as written (the config check refuses it)."""
    from fp4moe_kernels.switches import Switches, SwitchError

    if not isinstance(node, dict):
        return node
    try:
        norm = Switches.from_config(node)
    except SwitchError:
        return node
    return {k: getattr(norm, k) for k in node}


def identity(cfg: Any) -> dict[str, Any]:
    """The composed config ``cfg`` (the task's, or the root with ``hydra``), resolved, without :data:`EXCLUDED`;
    the kernel switches in their normal form (:func:`_kernels_as_run`)."""
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}
    for key in cfg:
        if key in EXCLUDED:
            continue
        node = cfg[key]
        value = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        out[str(key)] = drop_absent(str(key), _kernels_as_run(value) if key == "kernels" else value)
    for dotted in EXCLUDED:
        holder, leaf = _holder(out, dotted)
        if holder is not None and holder is not out:
            holder.pop(leaf, None)
    for dotted, default in ABSENT_WHEN_DEFAULT.items():
        holder, leaf = _holder(out, dotted)
        if holder is not None and holder.get(leaf, default) == default:
            holder.pop(leaf, None)
    for dotted in WHOLE_WHEN_INTEGRAL:
        holder, leaf = _holder(out, dotted)
        v = holder.get(leaf) if holder is not None else None
        if isinstance(v, float) and v.is_integer():
            holder[leaf] = int(v)
    return out


def _holder(out: dict, dotted: str) -> tuple[dict | None, str]:
    """(the dict of ``out`` that holds the last key of ``dotted``, that key); None where a parent is missing."""
    *parents, leaf = dotted.split(".")
    holder: Any = out
    for p in parents:
        holder = holder.get(p) if isinstance(holder, dict) else None
    return (holder if isinstance(holder, dict) else None), leaf


def digest(cfg: Any) -> str:
    """:data:`HASH_DIGITS` hex digits of the sha256 of :func:`identity` (keys sorted)."""
    text = json.dumps(identity(cfg), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_DIGITS]


def name(cfg: Any) -> str:
    """``<model>-<precision>-<recompute>-<digest>``: the run folder's name (a group's name left out when absent)."""
    from omegaconf import OmegaConf

    parts = [OmegaConf.select(cfg, f"{g}.name", default=None) for g in ("model", "precision", "recompute")]
    readable = [re.sub(r"[^A-Za-z0-9_.+]", "_", str(p)) for p in parts if p is not None]
    return "-".join([*readable, digest(cfg)])


def resolver(*, _root_: Any) -> str:
    """``${fp4moe.run_name:}``: :func:`name` of the whole composed config."""
    return name(_root_)


__all__ = ["EXCLUDED", "ABSENT_WHEN_DEFAULT", "identity", "digest", "name", "resolver"]
