"""Fixtures shared by the megatron model tests."""
import pytest
import torch


@pytest.fixture(autouse=True)
def megatron_shims(request):
    """fp4moe's patches of megatron-core and torch (``fp4moe.model.cpu_shims.active()``: no TE, CPU / gloo) held for
    the test, every original back after it. A test module that enters and leaves them itself sets
    ``HOLDS_SHIMS_ITSELF = True`` (tests/model/test_cpu_shims.py)."""
    if getattr(request.module, "HOLDS_SHIMS_ITSELF", False):
        yield
        return
    pytest.importorskip("megatron.core")
    from fp4moe.model import cpu_shims

    with cpu_shims.active():
        yield


@pytest.fixture(scope="module")
def mp():
    """gloo process group of one rank on an in-process store + megatron model-parallel state (TP1 PP1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    # megatron/core/jit.py makes jit_fuser = torch.compile: on CPU the first forward would spend ~10-20 s in
    # inductor. TORCHDYNAMO_DISABLE=1 only works before torch is imported; the runtime switch always does.
    with torch._dynamo.config.patch(disable=True):
        yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
