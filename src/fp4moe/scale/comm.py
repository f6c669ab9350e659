"""Per-layer expert-parallel all-to-all bytes per GPU and micro-batch, per recipe (issue 6, P5).

FIRST, UNCALIBRATED VERSION: payload sizes from the wire formats, row counts from balanced uniform routing; P5
checks them against ``A2AStats`` of measured runs and measures the achieved bandwidth. No torch import.

Payload row bytes (``fp4moe_kernels.sizes.payload_row_bytes``, which ``fp4moe.ops.all_to_all`` uses too), H = hidden size:

    mxfp4  H/2 + H/32       (E2M1 codes + UE8M0 scales)        H = 7168: 3808 B
    fp8    H + 4 H/128      (E4M3 + FP32 1x128 scales)                   7392 B
    bf16   2 H                                                          14336 B

Four all-to-alls per MoE layer and micro-batch (docs/recipe.md): dispatch forward (``mxfp4`` when
``recipe.dispatch_fp4``, else bf16; plus routing metadata), combine forward (bf16), and in backward the gradient
of the combine and of the dispatch (``recipe.backward_a2a``: bf16 or fp8; gradients are never FP4).

Rows a GPU sends per all-to-all (T = micro_batch x seq_length / CP tokens):

* ``dispatcher: alltoall`` (megatron's MoEAlltoAllTokenDispatcher, fp4moe.moe.layer): one row per (token, expert)
  pair, R = T x topk, each with a 4 B fp32 routing probability beside it.
* ``dispatcher: flex`` (DeepEP): one row per (token, destination rank), T x D with D the expected number of
  distinct EP ranks among a token's top-k experts under uniform random routing,
  D = R_c (1 - C(n_c - n_r, k) / C(n_c, k)), n_r = E/EP experts per rank, R_c candidate ranks with n_c experts:
  all EP ranks, or, with group-limited routing (num_groups, group_topk) and EP a multiple of num_groups,
  group_topk x EP / num_groups ranks. Metadata per row: k x (8 B int64 index + 4 B fp32 weight), the DeepEP API's
  topk_idx / topk_weights (an assumption about what its kernels move). The expert side still sees T x topk rows.

``*_bytes`` count the whole payload handed to the collective (the rows a GPU keeps for itself included, as
``A2AStats.*_sent_bytes``); ``*_remote_bytes`` the (EP-1)/EP part that leaves the GPU (uniform routing). Full
recompute re-runs the forward all-to-alls in backward (``forward_repeats``); the selective scopes modelled here do
not (fp4moe's moe_expert recomputes the experts only).

Time: ``a2a_time_s(a2a, link_bandwidth_gb_s=...)`` = remote bytes / bandwidth (+ a per-call latency), for a
bandwidth the caller states (GB/s = 1e9 B/s per GPU, one direction, as achieved by the collective). There is no
default: which link the paper's EP group crossed (NVLink inside a node for EP8 under megatron's rank order, or
the network) and what it achieved are not known.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from ..recipe import Recipe
from fp4moe_kernels.sizes import CODECS, payload_row_bytes  # torch-free; the ops' all-to-all counts with it too

from .memory import _scope, recipe_of


def expected_distinct_ranks(num_experts: int, topk: int, ep: int, num_groups: int | None = None,
                            group_topk: int | None = None) -> float:
    """Expected number of distinct EP ranks among a token's top-k experts, uniform random routing (see the
    module docstring for the group-limited case)."""
    n_r = num_experts // ep
    ranks = ep
    if num_groups and group_topk and ep % num_groups == 0:
        ranks = group_topk * ep // num_groups
    n_c = ranks * n_r
    if topk > n_c:
        raise ValueError(f"topk={topk} > {n_c} candidate experts")
    return ranks * (1 - math.comb(n_c - n_r, topk) / math.comb(n_c, topk))


@dataclass
class LayerA2A:
    """All-to-all bytes of one MoE layer, one micro-batch, one GPU (bytes; payload incl. metadata)."""

    dispatcher: str
    rows: float                 # rows sent per all-to-all
    dispatch_codec: str
    backward_codec: str
    dispatch_fwd_bytes: float
    combine_fwd_bytes: float
    combine_bwd_bytes: float
    dispatch_bwd_bytes: float
    remote_fraction: float      # (EP-1)/EP
    forward_repeats: int        # 2 when the backward re-runs the forward all-to-alls (full recompute)

    @property
    def forward_bytes(self) -> float:
        return self.dispatch_fwd_bytes + self.combine_fwd_bytes

    @property
    def backward_bytes(self) -> float:
        return self.combine_bwd_bytes + self.dispatch_bwd_bytes

    @property
    def total_bytes(self) -> float:
        """Per training step of this layer and micro-batch, forward re-runs included."""
        return self.forward_repeats * self.forward_bytes + self.backward_bytes

    @property
    def total_remote_bytes(self) -> float:
        return self.total_bytes * self.remote_fraction

    def rows_table(self) -> list[tuple[str, str, float]]:
        return [("dispatch fwd", self.dispatch_codec, self.dispatch_fwd_bytes),
                ("combine fwd", "bf16", self.combine_fwd_bytes),
                ("combine bwd", self.backward_codec, self.combine_bwd_bytes),
                ("dispatch bwd", self.backward_codec, self.dispatch_bwd_bytes)]


def a2a_per_layer(cfg: Any, recipe: Recipe | None = None) -> LayerA2A:
    """All-to-all bytes per GPU of one MoE layer and micro-batch under the config's recipe (``recipe``: already
    parsed, else ``cfg.precision``'s, fp4moe.scale.memory.recipe_of) and dispatcher."""
    cfg = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    m, p = cfg.model, cfg.parallel
    recipe = recipe_of(cfg, recipe)
    h, k, e, ep = int(m.hidden_size), int(m.moe.router_topk), int(m.moe.num_experts), int(p.expert)
    t = int(p.micro_batch) * int(p.seq_length) // int(p.context)
    dispatcher = str(p.get("dispatcher") or "alltoall")
    if dispatcher == "flex":
        rows = t * expected_distinct_ranks(e, k, ep, m.moe.get("num_groups"), m.moe.get("group_topk"))
        meta = k * (8 + 4)
    else:
        rows, meta = float(t * k), 4
    d_codec = "mxfp4" if recipe.dispatch_fp4 else "bf16"
    b_codec = recipe.backward_a2a
    scope = _scope(cfg)
    return LayerA2A(
        dispatcher=dispatcher, rows=rows, dispatch_codec=d_codec, backward_codec=b_codec,
        dispatch_fwd_bytes=rows * (payload_row_bytes(h, d_codec) + meta),
        combine_fwd_bytes=rows * payload_row_bytes(h, "bf16"),
        combine_bwd_bytes=rows * payload_row_bytes(h, b_codec),
        dispatch_bwd_bytes=rows * payload_row_bytes(h, b_codec),
        remote_fraction=(ep - 1) / ep, forward_repeats=2 if scope == "full" else 1)


def a2a_time_s(a2a: LayerA2A, *, link_bandwidth_gb_s: float, latency_s: float = 0.0) -> dict[str, float]:
    """Seconds per all-to-all (and their sum per step of one layer and micro-batch) = remote bytes /
    (link_bandwidth_gb_s x 1e9) + latency_s. The bandwidth is the caller's statement, not the paper's network."""
    if link_bandwidth_gb_s <= 0:
        raise ValueError("link_bandwidth_gb_s must be > 0")
    bw = link_bandwidth_gb_s * 1e9
    out = {name: b * a2a.remote_fraction / bw + latency_s for name, _, b in a2a.rows_table()}
    out["total"] = (a2a.forward_repeats * (out["dispatch fwd"] + out["combine fwd"])
                    + out["combine bwd"] + out["dispatch bwd"])
    return out


__all__ = ["CODECS", "LayerA2A", "a2a_per_layer", "a2a_time_s", "expected_distinct_ranks", "payload_row_bytes"]
