"""Fixtures shared by the megatron model tests."""
import socket

import pytest
import torch


@pytest.fixture(scope="module")
def mp():
    """gloo process group of one rank on 127.0.0.1 + megatron model-parallel state (TP1 PP1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    # megatron/core/jit.py makes jit_fuser = torch.compile: on CPU the first forward would spend ~10-20 s in
    # inductor. TORCHDYNAMO_DISABLE=1 only works before torch is imported; the runtime switch always does.
    with torch._dynamo.config.patch(disable=True):
        yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
