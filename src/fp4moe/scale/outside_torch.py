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
``nccl_peer_bytes``            What one more peer adds to a communicator's collectives (a 2-rank group after a
                               small and a 64 MiB all-reduce, less the 1-rank one): the ring's connections to its
                               neighbours, one per channel, each with NCCL's three protocol buffers, under the NCCL
                               settings of the run (the lab's ``NCCL_MIN_NCHANNELS=32`` raises the channels:
                               measured both ways). Every communicator a step uses runs at least one collective
                               (:func:`communicators`), so it counts one such peer.
``nccl_p2p_peer_bytes``        What one send / recv peer adds (the same 2-rank group's all-to-all after the
                               all-reduces): NCCL connects each peer of a send / recv on first use, on its own
                               channels (32 per peer on an 8-GPU Hopper node). The model counts EP - 1 of them for
                               an all-to-all NCCL runs itself and the neighbour stages for the pipeline's p2p.
                               Both peer terms scale with EP (the all-to-all's peers) and the layout, not with
                               hidden size or tokens. Neither is measured yet (no two GPUs have been lent since
                               the tool was written): :func:`nccl_peer_bytes_from_source` gives what NCCL's source
                               implies, for the sensitivity table only.
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
    """One NCCL communicator a rank uses in a training step: its group, size, the peers its collectives connect to
    (``peers``: a ring's neighbours count as one) and the peers it sends to / receives from (``p2p_peers``)."""

    group: str
    size: int
    peers: int
    p2p_peers: int = 0


def communicators(cfg: Any, nccl_all_to_all: bool = True, pipeline_rank: int = 1) -> list[Communicator]:
    """The NCCL communicators of one rank of a megatron-core step (our reading of what a step uses): the world
    group (init barrier), data-parallel (dense gradients; + CP), expert-parallel (the token counts' all-gather and the
    token all-to-all, or with DeepEP (``nccl_all_to_all=False``) only its buffer handshake), expert-data-parallel
    (expert gradients), pipeline (p2p with the neighbour stages of ``pipeline_rank``; fp4moe's trainer also
    all-reduces once on it at start-up, megatron's own code may not: then one ring peer too many) and model-parallel
    (the gradient norm); groups of one rank are left out. Each runs a collective (one ring peer); send / recv peers:
    EP - 1 for NCCL's all-to-all, the neighbour stages for the pipeline (1 on the first and the last stage)."""
    p = cfg.parallel
    tp, cp, pp, ep = int(p.tensor), int(p.context), int(p.pipeline), int(p.expert)
    dp = int(p.data) * cp
    etp = int(p.get("expert_tensor") or tp)
    world = int(p.world_size)
    edp = world // (etp * ep * pp)
    neighbours = (pipeline_rank > 0) + (pipeline_rank < pp - 1)
    groups = [("world", world, 0), ("data", dp, 0), ("expert", ep, ep - 1 if nccl_all_to_all else 0),
              ("expert_data", edp, 0), ("pipeline", pp, neighbours), ("model", tp * pp, 0)]
    return [Communicator(g, n, 1, k) for g, n, k in groups if n > 1]


def nccl_bytes(cfg: Any, communicator_bytes: int, peer_bytes: int, p2p_peer_bytes: int = 0,
               nccl_all_to_all: bool = True, pipeline_rank: int = 1) -> int:
    """Bytes of NCCL buffers on one rank: every communicator of ``communicators`` once plus its peers."""
    return sum(communicator_bytes + c.peers * peer_bytes + c.p2p_peers * p2p_peer_bytes
               for c in communicators(cfg, nccl_all_to_all, pipeline_rank))


# NCCL 2.28.9's source (github.com/NVIDIA/nccl, tag v2.28.9-1; src/ paths), not a measurement. Each connection (one
# direction, one channel) over NVLink (the P2P transport) keeps, on the receiving GPU, the buffers of all three
# protocols and a 4 KiB header in one allocation (transport/p2p.cc p2pRecvSetup): LL 8 x 512 x 8 x 16 B = 0.5 MiB,
# LL128 120 x 640 x 8 x 8 B = 4.6875 MiB, SIMPLE 4 MiB (init.cc DEFAULT_LL_BUFFSIZE / DEFAULT_LL128_BUFFSIZE /
# DEFAULT_BUFFSIZE, NCCL_STEPS = 8 in include/device.h), and on the sending GPU its 4 KiB header (p2pSendSetup; P2P
# read, which would move SIMPLE to the sender, is for compute capability 8.0 only: graph/paths.cc
# ncclTopoCheckP2p); both are aligned to CUDA_IPC_MIN = 2 MiB (include/comm.h), the cuMem granularity: 10 + 2 MiB.
NCCL_RECV_CONNECTION_BYTES = 10 * MiB
NCCL_SEND_CONNECTION_BYTES = 2 * MiB
NCCL_RING_CHANNELS = 24        # an 8 x H100 NVSwitch node (graph/search.cc, connect.cc ncclTopoPostset); public logs
NCCL_P2P_CHANNELS_PER_PEER = 32   # pow2Up of the ring channels (graph/paths.cc ncclTopoComputeP2pChannels)


def nccl_peer_bytes_from_source(ring_channels: int = NCCL_RING_CHANNELS,
                                p2p_channels: int = NCCL_P2P_CHANNELS_PER_PEER) -> tuple[int, int]:
    """(``nccl_peer_bytes``, ``nccl_p2p_peer_bytes``) as NCCL 2.28.9's source implies them on a Hopper NVSwitch node,
    not measured: a ring rank receives from one neighbour and sends to the other on every channel (``ring_channels``:
    24 by default, 32 under the lab's ``NCCL_MIN_NCHANNELS=32``), a send / recv peer both ways on its
    ``p2p_channels`` (32 either way); each channel 10 + 2 MiB (the constants above). Left out: the NVLS buffer of a
    large all-reduce (16 channels x 2 x 1 MiB x GPUs of the node, transport/nvls.cc), a tree's extra connections, and
    that NCCL's network transport holds 10 MiB on both GPUs of a connection while its send / recv share one pool per
    GPU (32 x 16 x 128 KiB each way, transport/net.cc)."""
    per_channel = NCCL_RECV_CONNECTION_BYTES + NCCL_SEND_CONNECTION_BYTES
    return ring_channels * per_channel, p2p_channels * per_channel


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


__all__ = ["Communicator", "allocator_gap", "communicators", "deepep_buffer_bytes", "nccl_bytes",
           "nccl_peer_bytes_from_source"]
