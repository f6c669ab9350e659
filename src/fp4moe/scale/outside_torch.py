"""GPU memory a training process holds beyond PyTorch's allocated bytes (issue 27, part C), in bytes, no torch.

What nvidia-smi shows for a process is ``torch.cuda.max_memory_allocated`` (the memory model's peak) plus:

=============================  ======================================================================================
term (MemoryAssumptions field) what it is, and how the model carries it from the measurement to another configuration
=============================  ======================================================================================
``cuda_context_bytes``         The CUDA context with the libraries a training step loads (cuBLAS workspaces, cuDNN,
                               Triton / inductor kernels, the CUDA kernels' modules): a one-GPU proxy training
                               process's nvidia-smi peak minus its peak reserved bytes, less one 1-rank NCCL
                               communicator. One per process; independent of EP, hidden size and tokens (the same
                               kernels run at every size: our assumption).
``nccl_communicator_bytes``    One NCCL communicator without peers (a 1-rank group after its first collectives).
``nccl_peer_bytes``            What one more peer adds to a communicator (a 2-rank group after an all-reduce and an
                               all-to-all, less the 1-rank one), under the NCCL settings of the run (the lab's
                               ``NCCL_MIN_NCHANNELS=32`` raises it: measured both ways). The model counts, per rank,
                               the communicators a training step uses (:func:`communicators`) and their peers:
                               EP - 1 for an all-to-all NCCL runs itself, 1 for a ring or a pipeline neighbour.
                               Scales with EP (the all-to-all's peers) and the layout, not with hidden size or tokens.
``allocator_gap_bytes``        The caching allocator's reserved - allocated at the peak of a proxy training run
                               (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, the lab's setting), measured
                               at ``allocator_gap_ref_elements`` = tokens x hidden per micro-batch; carried in
                               proportion to tokens x hidden (our assumption: the blocks that leave gaps are the
                               activations' [T, H]-sized ones; the tool measures two micro-batches to check it).
DeepEP (``deepep_buffers``)    The lab's flex dispatcher pre-allocates DeepEP's NVLink buffer (and RDMA beyond 8
                               ranks) with cudaMalloc: :func:`deepep_buffer_bytes`, DeepEP v1.2.1's own size hints
                               (csrc/config.hpp, deep_ep/buffer.py, csrc/deep_ep.cpp). Scales with hidden size and EP;
                               independent of tokens. Not measured (DeepEP is not in fp4moe's stack); the sister
                               artifact's log names ACCL-EP 1.0.0.5, a DeepEP-compatible library whose buffers may
                               differ.
=============================  ======================================================================================

The measured values are ``MemoryAssumptions`` fields the caller gives (``fp4moe.analysis.outside_torch_measured`` derives
them from the measuring tool's results, ``tools/device/measure_outside_torch.py``); the model's defaults are 0 and
"not measured", never a number fitted to the paper.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MiB = 2**20


# ---------------------------------------------------------------------------------------------- NCCL

@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a rank uses in a training step: its group, size and the peers it connects to."""

    group: str
    size: int
    peers: int


def communicators(cfg: Any, nccl_all_to_all: bool = True, pipeline_rank: int = 1) -> list[Communicator]:
    """The NCCL communicators of one rank of a megatron-core step (our reading of what a step uses): the world
    group (init barrier), data-parallel (dense gradients; + CP), expert-parallel (the token all-to-all, or with
    DeepEP (``nccl_all_to_all=False``) only its buffer handshake), expert-data-parallel (expert gradients),
    pipeline (p2p with the neighbour stages of ``pipeline_rank``) and model-parallel (the gradient norm); groups
    of one rank are left out. Peers: EP - 1 for NCCL's all-to-all, the neighbour stages for the pipeline (1 on
    the first and the last stage), 1 for a ring."""
    p = cfg.parallel
    tp, cp, pp, ep = int(p.tensor), int(p.context), int(p.pipeline), int(p.expert)
    dp = int(p.data) * cp
    etp = int(p.get("expert_tensor") or tp)
    world = int(p.world_size)
    edp = world // (etp * ep * pp)
    neighbours = (pipeline_rank > 0) + (pipeline_rank < pp - 1)
    groups = [("world", world, 1), ("data", dp, 1), ("expert", ep, ep - 1 if nccl_all_to_all else 1),
              ("expert_data", edp, 1), ("pipeline", pp, neighbours), ("model", tp * pp, 1)]
    return [Communicator(g, n, k) for g, n, k in groups if n > 1]


def nccl_bytes(cfg: Any, communicator_bytes: int, peer_bytes: int, nccl_all_to_all: bool = True,
               pipeline_rank: int = 1) -> int:
    """Bytes of NCCL buffers on one rank: every communicator of ``communicators`` once plus its peers."""
    return sum(communicator_bytes + c.peers * peer_bytes
               for c in communicators(cfg, nccl_all_to_all, pipeline_rank))


# ---------------------------------------------------------------------------------------------- DeepEP

NUM_MAX_NVL_PEERS = 8             # DeepEP csrc/kernels/configs.cuh
NUM_WORKSPACE_BYTES = 32 * MiB    # csrc/kernels/configs.cuh: DeepEP's workspace, cudaMalloc'd per buffer
SOURCE_META_BYTES = 8             # csrc/kernels/internode.cu: sizeof(SourceMeta), two ints
DEEPEP_NUM_SMS = 20               # megatron-core's moe_deepep_num_sms default (= DeepEP's Buffer.num_sms)
# deep_ep/buffer.py get_dispatch_config / get_combine_config: ranks -> (nvl recv tokens, rdma send, rdma recv)
_DISPATCH = {2: (256, 6, 128), 4: (256, 6, 128), 8: (256, 6, 128), 16: (288, 20, 128), 24: (288, 32, 128),
             32: (288, 32, 128), 64: (288, 28, 128), 128: (560, 32, 128), 144: (720, 12, 128), 160: (720, 12, 128)}
_COMBINE = {2: (256, 6, 128), 4: (256, 6, 128), 8: (256, 6, 128), 16: (288, 12, 128), 24: (288, 8, 128),
            32: (288, 8, 128), 64: (288, 20, 128), 128: (560, 12, 128), 144: (720, 8, 128), 160: (720, 8, 128)}


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def deepep_buffer_bytes(hidden: int, ep: int, num_sms: int = DEEPEP_NUM_SMS) -> int:
    """Bytes DeepEP v1.2.1 cudaMallocs on each GPU for megatron-core's flex dispatcher over ``ep`` ranks at hidden
    size ``hidden``: the larger of the dispatch and combine configs' NVLink buffer size hints
    (``Config::get_nvl_buffer_size_hint`` with megatron's hidden bytes = hidden x 2, BF16 rows), the RDMA buffer
    beyond 8 ranks (``get_rdma_buffer_size_hint``; NVSHMEM's own heap not counted), and the 32 MiB workspace."""
    if ep not in _DISPATCH:
        raise ValueError(f"DeepEP has no dispatch config for {ep} ranks: one of {sorted(_DISPATCH)}")
    hidden_bytes = 2 * hidden
    nvl_ranks, rdma_ranks = min(ep, NUM_MAX_NVL_PEERS), max(ep // NUM_MAX_NVL_PEERS, 1)
    channels = num_sms // 2
    nvl = rdma = 0
    for table in (_DISPATCH, _COMBINE):
        recv, rdma_send, rdma_recv = table[ep]
        per_token = hidden_bytes + SOURCE_META_BYTES + 128 * 8 + 128 * 4 + 128 * 4   # + top-k idx, weights, scales
        n = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4 + channels * nvl_ranks * recv * per_token
        nvl = max(nvl, _align(n, 128))
        if ep > NUM_MAX_NVL_PEERS:
            rdma_recv = _align(rdma_recv, rdma_send)
            r = (channels * rdma_ranks * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
                 + channels * rdma_ranks * rdma_recv * (per_token + 16) * 2)   # + an int4 per token, both halves
            rdma = max(rdma, _align(r, 128))
    return nvl + rdma + NUM_WORKSPACE_BYTES


# ---------------------------------------------------------------------------------------------- the total

def allocator_gap(gap_bytes: int, ref_elements: int, tokens: int, hidden: int) -> int:
    """The measured reserved - allocated gap carried to ``tokens`` x ``hidden`` per micro-batch (module docstring);
    the gap itself when no reference size was measured."""
    if not ref_elements:
        return gap_bytes
    return round(gap_bytes * tokens * hidden / ref_elements)


__all__ = ["Communicator", "allocator_gap", "communicators", "deepep_buffer_bytes", "nccl_bytes"]
