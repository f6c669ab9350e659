"""OmegaConf resolvers the configs use, registered by ``import fp4moe`` so that they exist before any composition.

``${fp4moe.requeue_flags:<bool>}``: ``cluster.requeue`` as sbatch flags for a launcher profile's
``additional_parameters``: ``{requeue: true}`` (``#SBATCH --requeue``) or ``{no_requeue: true}`` (``--no-requeue``).
"""
from __future__ import annotations

from typing import Any


def requeue_flags(requeue: Any) -> dict[str, bool]:
    if not isinstance(requeue, bool):
        raise ValueError(f"cluster.requeue must be true or false, not {requeue!r}")
    return {"requeue": True} if requeue else {"no_requeue": True}


def register() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("fp4moe.requeue_flags"):
        OmegaConf.register_new_resolver("fp4moe.requeue_flags", requeue_flags)
