"""torch.distributed and megatron-core parallel state for the trainer.

Three ways a process learns its rank, tried in this order:

1. torchrun (or any launcher exporting ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): ``env://``.
2. Slurm (``SLURM_PROCID``, ``SLURM_NTASKS`` and a job step id set: a task started by srun, e.g. by submitit):
   ``submitit.helpers.TorchDistributedEnvironment().export()`` writes the ``env://`` variables (master = the first
   node of the job, port = ``MASTER_PORT`` or one derived from the job id), then as 1. A batch script's own
   process (no step id) counts as a single process.
3. Neither: a single process (world size 1).

A process alone in its world (a single process, a Slurm step of one task, torchrun with one process) keeps its group
on an in-process store (``HashStore``): no port to pick, so none can be taken by another process between picking
and binding (an H200 GPU test failed with EADDRINUSE that way, 2026-11-30, and a one-task Slurm array job in CI,
2026-12-05).

Backend: nccl when CUDA is present (device ``cuda:LOCAL_RANK``), gloo otherwise (device ``cpu``).
The process count must equal ``parallel.world_size``. The trainer supports data, expert and pipeline parallelism
(the paper's layouts have TP1; PP runs megatron-core's non-interleaved 1F1B schedule, with an even split of the
layers or the uneven stages of ``parallel.pipeline_layout``); TP, CP, expert-TP > 1 and a virtual (interleaved)
pipeline raise a ConfigError saying so.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fp4moe.config import ConfigError
from fp4moe.settings import Parallel
from fp4moe.tracking.mlflow_store import MAX_TAG_CHARS


@dataclass
class DistInfo:
    """Where this process sits: global rank / world size, local rank, device, backend, who launched it, and
    whether this module created the process group (then :func:`teardown` destroys it); ``hosts``: every rank's host
    name (``socket.gethostname()``), in rank order."""
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    launcher: str            # 'torchrun' | 'slurm' | 'single'
    owns_group: bool
    owns_model_parallel: bool = False
    hosts: list[str] = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def check_supported(p: Parallel) -> None:
    """Refuse parallel layouts (``p``, the run's ``Settings.parallel``) the trainer does not run yet, with the reason
    (ConfigError)."""
    unsupported = [(k, getattr(p, k)) for k in ("tensor", "context") if getattr(p, k) > 1]
    if (p.expert_tensor or 1) > 1:
        unsupported.append(("expert_tensor", p.expert_tensor))
    if unsupported:
        what = ", ".join(f"parallel.{k}={v}" for k, v in unsupported)
        raise ConfigError(
            f"{what}: not supported by fp4moe.train yet (it runs data, expert and pipeline parallelism: tensor, "
            "context and expert_tensor must be 1). Such layouts can be checked with "
            "`python -m fp4moe.launch dry-run` but not trained yet")
    if (p.virtual_pipeline or 1) > 1:
        raise ConfigError(
            f"parallel.virtual_pipeline={p.virtual_pipeline}: the interleaved (virtual) pipeline schedule is not "
            "supported by fp4moe.train yet (it runs megatron-core's 1F1B): set parallel.virtual_pipeline=null, "
            "with one parallel.pipeline_layout stage per pipeline rank")


def init_distributed(p: Parallel) -> DistInfo:
    """Initialise the default process group (see the module docstring) and check its size against
    ``p.world_size`` (``p``: the run's ``Settings.parallel``). Reuses a group that already exists (and then leaves it
    alone at teardown)."""
    env = os.environ
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    owns = not dist.is_initialized()
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        launcher = "slurm"
        from submitit.helpers import TorchDistributedEnvironment

        # submitit's JobEnvironment recognises Slurm by SUBMITIT_EXECUTOR, which a plain `srun` task lacks.
        env.setdefault("SUBMITIT_EXECUTOR", "slurm")
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    else:
        launcher = "single"
    local_rank = int(env.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    if owns:
        # one process has nobody to meet: no TCP store, so no port that another process may hold (a one-task Slurm
        # step's port, derived from its job id by submitit, was found taken in a CI run, EADDRINUSE); WORLD_SIZE is
        # torchrun's or submitit's export above
        if launcher == "single" or int(env["WORLD_SIZE"]) == 1:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend, init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    info = DistInfo(rank=rank, world_size=world, local_rank=local_rank,
                    device=torch.device("cuda", local_rank) if cuda else torch.device("cpu"),
                    backend=dist.get_backend(), launcher=launcher, owns_group=owns, hosts=rank_hosts(world))
    want = p.world_size
    if world != want:
        if owns:
            dist.destroy_process_group()
        raise ConfigError(
            f"{world} process(es) started ({launcher}) but parallel.world_size={want}: start {want} processes "
            f"(torchrun --nproc-per-node {want}, or the Slurm launcher profile), or pick a parallel layout for "
            f"{world} (parallel.world_size, parallel.data and cluster.gpus_per_node together)")
    return info


def gather_object(obj: Any, world_size: int) -> list[Any]:
    """``obj`` of every rank, in rank order: one ``all_gather_object`` over the default group (collective: call it
    on every rank); ``[obj]`` alone or without a process group."""
    if world_size > 1 and dist.is_initialized():
        out: list[Any] = [None] * world_size
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def rank_hosts(world_size: int) -> list[str]:
    """Every rank's host name in rank order (:func:`gather_object`, collective). A multi-node job's tasks each report
    their own host, so the list shows where the ranks ran."""
    return [str(h) for h in gather_object(socket.gethostname(), world_size)]


def host_tags(hosts: list[str]) -> dict[str, str]:
    """``hosts``: the distinct host names in the order of their first rank (comma-separated, cut to MLflow's tag
    limit), ``num_hosts``: how many."""
    distinct = list(dict.fromkeys(hosts))
    return {"hosts": ",".join(distinct)[:MAX_TAG_CHARS], "num_hosts": str(len(distinct))}


def init_model_parallel(p: Parallel, info: DistInfo) -> None:
    """megatron-core ``parallel_state.initialize_model_parallel`` for the TP/PP/CP/EP/ETP of ``p`` (the run's
    ``Settings.parallel``; DP is what is left of the world). Megatron also builds gloo copies of the data-parallel
    groups."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        context_parallel_size=p.context,
        expert_model_parallel_size=p.expert,
        expert_tensor_parallel_size=p.etp,
    )
    info.owns_model_parallel = True


# megatron-core's groups that fp4moe.train and megatron's MoE loss tracker communicate over (parallel_state getters)
_GROUPS = ("get_tensor_model_parallel_group", "get_pipeline_model_parallel_group", "get_data_parallel_group",
           "get_expert_model_parallel_group", "get_expert_data_parallel_group", "get_embedding_group",
           "get_tensor_and_context_parallel_group", "get_expert_tensor_parallel_group")


def warm_up_communicators(info: DistInfo) -> int:
    """Create the communicators of the world and of megatron's groups now, with one 1-element all-reduce each
    (every rank walks the same list, so the collectives match). NCCL creates a communicator at its first collective
    and allocates its buffers with ``cudaMalloc``, outside torch's caching allocator: created lazily after the first
    step (the MoE loss tracker's first all-reduce), they found a GPU the allocator had filled and failed with
    ``ncclUnhandledCudaError`` instead of the run failing as out of memory in the step itself. gloo runs the same
    all-reduces (cheap), so the CPU tests walk the same path. Returns the number of all-reduces run."""
    from megatron.core import parallel_state

    groups = [None]
    for name in _GROUPS:
        try:
            groups.append(getattr(parallel_state, name)())
        except (AssertionError, AttributeError, RuntimeError):  # a group this layout does not build
            continue
    t = torch.zeros(1, device=info.device)
    for g in groups:
        dist.all_reduce(t, group=g)
    if info.device.type == "cuda":
        torch.cuda.synchronize(info.device)
    return len(groups)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def teardown(info: DistInfo | None) -> None:
    """Undo what :func:`init_distributed` / :func:`init_model_parallel` set up (only what they created)."""
    if info is None:
        return
    if info.owns_model_parallel:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["DistInfo", "check_supported", "gather_object", "host_tags", "init_distributed", "rank_hosts", "init_model_parallel", "warm_up_communicators", "barrier",
           "teardown"]
