"""Two CPU processes with expert parallelism 2 over gloo, for the tests that compare the MoE layers at EP = 2.

``run_on_two_ranks(case, tmp_path)`` spawns two ranks; each sets up torch.distributed (gloo) and megatron's
parallel state with EP 2, holds ``fp4moe.model.cpu_shims.active()`` (a spawned process: the model tests' fixture
holds the shims in the parent only), calls ``case(rank)`` (a module-level function, so that it pickles) and saves
what it returns; the caller gets both ranks' results, rank 0 first.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as tmp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str, case: Callable[[int], Any]) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from fp4moe.model import cpu_shims

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    torch._dynamo.config.disable = True
    res: Any = None
    try:
        with cpu_shims.active():
            res = case(rank)
    finally:
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_on_two_ranks(case: Callable[[int], Any], tmp_path: Path) -> list[Any]:
    """[rank 0's ``case(0)``, rank 1's ``case(1)``], each computed in its own EP-2 process."""
    tmp.spawn(_worker, args=(free_port(), str(tmp_path), case), nprocs=2, join=True)
    return [torch.load(Path(tmp_path) / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
