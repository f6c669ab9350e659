"""The paper's benchmark experiments (F3 kernels, F4 MoE layer) as Hydra jobs of ``python -m fp4moe.train``.

An experiment with a ``bench`` node (conf/experiment/paper_f3.yaml, paper_f4.yaml) runs that benchmark instead of
training: ``bench.module``'s ``main(bench.args)`` in this process, once per GPU process. So the same launcher path
as training submits it (``hydra/launcher=slurm_h100``: one Slurm task per GPU, ``python -m fp4moe.launch dry-run``
prints its sbatch script, slurm/train.sbatch runs it with plain sbatch), and locally:

    python -m fp4moe.train experiment=paper_f3                                     # 1 GPU
    torchrun --nproc-per-node 2 -m fp4moe.train experiment=paper_f4 parallel=two_gpu_ep2 hydra.mode=RUN  # EP=2

A run of ``parallel.world_size`` > 1 needs its processes: torchrun's (``RANK``, ``WORLD_SIZE``, ...) or Slurm tasks,
whose rendezvous is exported with submitit's ``TorchDistributedEnvironment`` as in fp4moe.train.dist. The
benchmarks then read those variables themselves (fp4moe.bench.moe_layer initialises the process group). The config's
model, data and train groups are not used by a benchmark: :func:`command` and :func:`run` take the ``bench`` node
and the run's typed ``parallel`` settings (``Settings.from_config(cfg).parallel``, built once by the caller).
"""
from __future__ import annotations

import importlib
import os
import shlex
from typing import Any

from omegaconf import OmegaConf

from fp4moe.config import ConfigError
from fp4moe.settings import Parallel


def is_bench(cfg: Any) -> bool:
    """Whether the composed ``cfg`` is a benchmark job (it has ``bench.module``)."""
    return OmegaConf.select(cfg, "bench.module") is not None


def command(bench: Any, parallel: Parallel) -> str:
    """The benchmark ``bench`` (the config's ``bench`` node: ``module``, ``args``) as one would type it outside
    Hydra, for ``parallel.world_size`` processes (torchrun for more than one)."""
    b, world = bench, parallel.world_size
    launcher = ["python"] if world == 1 else ["torchrun", "--nproc-per-node", str(world)]
    return " ".join([*launcher, "-m", str(b.module), *(shlex.quote(str(a)) for a in b.args)])


def _export_slurm_rendezvous(world: int) -> None:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env):
        from submitit.helpers import TorchDistributedEnvironment

        env.setdefault("SUBMITIT_EXECUTOR", "slurm")
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        return
    if world > 1:
        raise ConfigError(f"parallel.world_size={world}: start {world} processes, e.g. torchrun --nproc-per-node "
                          f"{world} -m fp4moe.train hydra.mode=RUN <overrides>, or a Slurm launcher profile")


def run(bench: Any, parallel: Parallel) -> dict[str, Any]:
    """Run the benchmark ``bench`` (the config's ``bench`` node) in this process, one of ``parallel.world_size``;
    returns what the launcher gets back."""
    world = parallel.world_size
    _export_slurm_rendezvous(world)
    if int(os.environ.get("WORLD_SIZE", "1")) != world:
        raise ConfigError(f"{os.environ.get('WORLD_SIZE')} processes started but parallel.world_size={world}")
    args = [str(a) for a in bench.args]
    out = importlib.import_module(str(bench.module)).main(args)
    if isinstance(out, int) and out != 0:
        raise RuntimeError(f"{bench.module} exited with status {out}")
    return {"outcome": "done", "bench": str(bench.module), "args": args, "rank": int(os.environ.get("RANK", 0)),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID")}


__all__ = ["is_bench", "command", "run"]
