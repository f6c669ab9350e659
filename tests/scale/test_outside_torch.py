"""fp4moe.scale.outside_torch: how the model carries the memory outside PyTorch to a configuration, with its own
inputs: the communicators a rank uses, DeepEP's buffer from DeepEP's own size hints, the allocator's gap scaled by
tokens x hidden. (The measured terms and their tool: tests/analysis/test_outside_torch_measured.py.)"""
import pytest
from omegaconf import OmegaConf

from fp4moe.scale import outside_torch as ot
from fp4moe.scale.memory import NOT_MEASURED, MemoryAssumptions, compose_cfg

MiB = 2**20


def test_the_model_measures_nothing_itself():
    """Without measured terms from its caller the model holds none: every term 0, and it says so."""
    a = MemoryAssumptions()
    assert (a.cuda_context_bytes, a.nccl_communicator_bytes, a.nccl_peer_bytes, a.allocator_gap_bytes) == (0, 0, 0, 0)
    assert a.outside_torch_source == NOT_MEASURED


def test_communicators_of_the_paper_layout():
    """PP32 EP8 DP8 on 256 GPUs (expert-DP 1: none): world, DP, EP, pipeline, model-parallel, each with one ring peer
    for its collectives; send / recv peers: NCCL's all-to-all EP - 1 (DeepEP's handshake none), the pipeline its
    neighbour stages (one on the first and the last stage)."""
    cfg = compose_cfg("dsv3_671b", "paper_671b", "none", "bf16")
    mid = {c.group: (c.size, c.peers, c.p2p_peers) for c in ot.communicators(cfg, pipeline_rank=5)}
    assert mid == {"world": (256, 1, 0), "data": (8, 1, 0), "expert": (8, 1, 7), "pipeline": (32, 1, 2),
                   "model": (32, 1, 0)}
    assert {c.group: c.p2p_peers for c in ot.communicators(cfg, False, 0)} == {
        "world": 0, "data": 0, "expert": 0, "pipeline": 1, "model": 0}
    assert ot.nccl_bytes(cfg, 100, 10, 1, pipeline_rank=31) == 5 * 100 + 5 * 10 + (7 + 1) * 1
    one = OmegaConf.create({"parallel": {"tensor": 1, "context": 1, "pipeline": 1, "expert": 1, "data": 1,
                                         "world_size": 1}})
    assert ot.communicators(one) == [] and ot.nccl_bytes(one, 100, 10, 1) == 0


def test_nccl_peer_bytes_from_its_source():
    """NCCL 2.28.9's connection over NVLink: the receiver's LL (lines x threads x steps x 16 B), LL128 (elements x
    threads x steps x 8 B) and SIMPLE (4 MiB) buffers and a 4 KiB header in one allocation, the sender's header
    alone, each rounded up to 2 MiB; a ring rank holds one of each per channel, a send / recv peer too."""
    steps, granule = 8, 2 * MiB
    ll, ll128, simple = 8 * 512 * steps * 16, 120 * 640 * steps * 8, 4 * MiB
    assert ot.NCCL_RECV_CONNECTION_BYTES == -(-(ll + ll128 + simple + 4096) // granule) * granule
    assert ot.NCCL_SEND_CONNECTION_BYTES == -(-4096 // granule) * granule
    assert ot.nccl_peer_bytes_from_source() == (24 * 12 * MiB, 32 * 12 * MiB)
    assert ot.nccl_peer_bytes_from_source(32) == (384 * MiB, 384 * MiB)   # the lab's NCCL_MIN_NCHANNELS=32


def test_deepep_buffer_from_its_size_hints():
    """DeepEP v1.2.1 at EP8 (intranode): 20 SMs -> 10 channels x 8 NVLink ranks x 256 chunked tokens of (hidden x 2
    + 8 B source meta + 128 top-k int64 + 128 weights + 128 scales), + 10 x 8 x 5 ints, 128-aligned, + 32 MiB
    workspace; beyond 8 ranks an RDMA buffer too; the hint grows with the hidden size."""
    per_token = 7168 * 2 + 8 + 128 * 8 + 128 * 4 + 128 * 4
    nvl = 10 * 8 * 5 * 4 + 10 * 8 * 256 * per_token
    assert ot.deepep_buffer_bytes(7168, 8) == -(-nvl // 128) * 128 + 32 * MiB
    assert ot.deepep_buffer_bytes(5120, 8) < ot.deepep_buffer_bytes(7168, 8) < ot.deepep_buffer_bytes(7168, 16)
    with pytest.raises(ValueError, match="no dispatch config for 12 ranks"):
        ot.deepep_buffer_bytes(7168, 12)


def test_allocator_gap_scales_with_tokens_times_hidden():
    assert ot.allocator_gap(1000, 2048 * 4096, 4096, 7168) == 3500
    assert ot.allocator_gap(1000, 0, 4096, 7168) == 1000   # no reference size: the gap as measured
