"""The bytes megatron-core 0.16.1's DDP and optimizer hold on one rank, exactly, from the config (no torch).

What the trainer builds (fp4moe.train.optim) for the ``optimizer`` group (:class:`fp4moe.config.OptimizerSetting`):

- Parameters: :func:`stage_parameters` lists one pipeline stage's parameters in megatron's registration order
  (``GPTModel.named_parameters()``), each with its element count, whether it is a routed expert held under
  expert parallelism (megatron's ``allreduce = False``, EP > 1: reduced and sharded over the expert-data-parallel
  group, the others over the data-parallel group) and whether megatron marks it ``shared_embedding`` (the word
  embedding copies of first and last stage under pipeline parallelism with tied weights or MTP).
- DDP buffers (``_ParamAndGradBuffer``, :func:`buffer_layout`): one per parameter group (dense, expert), filled in
  reverse registration order. With the distributed optimizer every parameter starts at a multiple of 64 elements,
  every bucket ends at a multiple of lcm(shard group size, 128), and a ``shared_embedding`` parameter gets a bucket of
  its own; buckets close once they reach the bucket size (none unless ``overlap_grad_reduce`` or ``bucket_size``;
  megatron's default max(4e7, 1e6 x DP) elements; no bucketing on pipeline stages after the first). The gradient
  buffer holds every padded element (FP32 or BF16 main grads); with the distributed optimizer the parameters live in
  a parameter buffer of the same layout.
- Optimizer state: without the distributed optimizer, FP32 main params + Adam m, v of every parameter (12 B, 8 B for
  FP32 parameters, which are their own main params). With it, rank r owns the r-th 1/d of every bucket and keeps the
  state of the parameter elements in it (padding excluded). BF16 main grads (megatron's precision-aware optimizer,
  built without Transformer Engine as its HybridDeviceOptimizer) add the FP32 gradient copy that optimizer keeps from
  one step to the next: 16 B per owned element, in host memory for the offloaded share.

Checked against the trainer on CPU processes (tests/train/test_optimizer.py): every optimizer setting, DP / EP /
PP layouts, the bytes ``fp4moe.train.optim.state_bytes`` counts in the optimizer's tensors, equal.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from ..config import OptimizerSetting, parse_pipeline_layout

BF16, FP32 = 2, 4
PARAM_ALIGN = 64           # elements: megatron pads each parameter's start with the distributed optimizer
BUCKET_ALIGN = 128         # elements: buckets end at a multiple of lcm(shard group size, 128)
DEFAULT_BUCKET = 40_000_000  # elements: megatron DDP's bucket size when overlapping, max(4e7, 1e6 x DP)


@dataclass(frozen=True)
class Param:
    """One parameter of a pipeline stage: megatron's name (local to the stage), elements, shard group, marks."""

    name: str
    numel: int
    expert: bool = False              # routed expert under EP > 1 (expert-data-parallel buffer)
    shared_embedding: bool = False    # megatron's shared_embedding (a bucket of its own, distributed optimizer)


@dataclass(frozen=True)
class Layout:
    """One DDP buffer: each parameter's ``(start, end)`` element range (in the buffer's parameter order) and each
    bucket's ``(start, end)`` (padded) range; ``numel`` is the buffer's size with padding."""

    params: tuple[Param, ...]
    ranges: tuple[tuple[int, int], ...]
    buckets: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0

    def owned(self, shards: int, rank: int) -> int:
        """Parameter elements (padding excluded) in rank ``rank``'s 1/``shards`` of every bucket."""
        n = 0
        for b0, b1 in self.buckets:
            per = (b1 - b0) // shards
            lo, hi = b0 + rank * per, b0 + (rank + 1) * per
            n += sum(max(0, min(hi, e) - max(lo, s)) for s, e in self.ranges if s < b1 and e > b0)
        return n


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def buffer_layout(params: list[Param], *, shards: int, distributed: bool, bucket_size: int | None) -> Layout:
    """megatron-core 0.16.1 ``_ParamAndGradBuffer``'s layout of ``params`` (registration order), sharded over
    ``shards`` ranks with the distributed optimizer (module docstring)."""
    order = list(reversed(params))
    ranges: list[tuple[int, int]] = []
    buckets: list[tuple[int, int]] = []
    bucket_end_align = math.lcm(shards, BUCKET_ALIGN) if distributed else 1
    start = bucket_start = 0
    open_bucket = False
    end = 0

    def close(at: int) -> int:
        nonlocal bucket_start, open_bucket
        b_end = _pad(at, bucket_end_align)
        buckets.append((bucket_start, b_end))
        bucket_start, open_bucket = b_end, False
        return b_end

    for p in order:
        if distributed:
            start = _pad(start, PARAM_ALIGN)
        own = p.shared_embedding and distributed
        if own and open_bucket:
            start = close(start)
        end = start + p.numel
        ranges.append((start, end))
        open_bucket = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own:
            start = close(end)
        else:
            start = end
    if open_bucket:
        close(end)
    return Layout(tuple(order), tuple(ranges), tuple(buckets))


# ---------------------------------------------------------------------------------------------- parameters

def _as_cfg(cfg: Any) -> DictConfig:
    return cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)


def stages(cfg: Any) -> list[str]:
    """The layout letters of every pipeline stage (``parallel.pipeline_layout``, or an even split of the layers with
    the embedding first and MTP + loss last), as megatron-core builds them."""
    cfg = _as_cfg(cfg)
    p, m = cfg.parallel, cfg.model
    pp, vpp = int(p.pipeline), int(p.get("virtual_pipeline") or 1)
    if p.get("pipeline_layout"):
        return parse_pipeline_layout(str(p.pipeline_layout))
    n = int(m.num_layers) // (pp * vpp)
    out = ["t" * n for _ in range(pp * vpp)]
    out[0] = "E" + out[0]
    out[-1] = out[-1] + "m" * int(m.get("mtp_num_layers", 0) or 0) + "L"
    return out


def _layer(prefix: str, cfg: DictConfig, moe: bool, expert_parallel: bool) -> list[Param]:
    m, p = cfg.model, cfg.parallel
    h, n = int(m.hidden_size), int(m.num_attention_heads)
    a = m.mla
    nope, rope, v, kv = int(a.qk_head_dim), int(a.qk_pos_emb_head_dim), int(a.v_head_dim), int(a.kv_lora_rank)
    q = a.get("q_lora_rank")
    out = [Param(f"{prefix}.input_layernorm.weight", h),
           Param(f"{prefix}.self_attention.linear_proj.weight", h * n * v)]
    if q:
        out += [Param(f"{prefix}.self_attention.linear_q_down_proj.weight", int(q) * h),
                Param(f"{prefix}.self_attention.linear_q_up_proj.weight", n * (nope + rope) * int(q))]
    else:
        out.append(Param(f"{prefix}.self_attention.linear_q_proj.weight", n * (nope + rope) * h))
    out += [Param(f"{prefix}.self_attention.linear_kv_down_proj.weight", (kv + rope) * h),
            Param(f"{prefix}.self_attention.linear_kv_up_proj.weight", n * (nope + v) * kv)]
    if q:
        out.append(Param(f"{prefix}.self_attention.q_layernorm.weight", int(q)))
    out += [Param(f"{prefix}.self_attention.kv_layernorm.weight", kv),
            Param(f"{prefix}.pre_mlp_layernorm.weight", h)]
    if not moe:
        f = int(m.ffn_hidden_size)
        return out + [Param(f"{prefix}.mlp.linear_fc1.weight", 2 * f * h), Param(f"{prefix}.mlp.linear_fc2.weight", h * f)]
    e, f = int(m.moe.num_experts), int(m.moe.ffn_hidden_size)
    local = e // int(p.expert)
    out.append(Param(f"{prefix}.mlp.router.weight", e * h))
    for i in range(local):
        x = f"{prefix}.mlp.experts.local_experts.{i}"
        out += [Param(f"{x}.linear_fc1.weight", 2 * f * h, expert_parallel),
                Param(f"{x}.linear_fc2.weight", h * f, expert_parallel)]
    fs = f * int(m.moe.get("shared_experts", 0) or 0)
    if fs:
        out += [Param(f"{prefix}.mlp.shared_experts.linear_fc1.weight", 2 * fs * h),
                Param(f"{prefix}.mlp.shared_experts.linear_fc2.weight", h * fs)]
    return out


def stage_parameters(cfg: Any, stage: int) -> list[Param]:
    """Pipeline stage ``stage``'s trainable parameters in megatron-core's registration order, as fp4moe builds its
    ``GPTModel`` (TP = 1)."""
    cfg = _as_cfg(cfg)
    m, p = cfg.model, cfg.parallel
    if int(p.tensor) != 1 or int(p.get("expert_tensor") or 1) != 1:
        raise ValueError("stage_parameters models TP = ETP = 1 (what fp4moe.train runs)")
    letters = stages(cfg)
    pp = len(letters)
    first = sum(s.count("t") for s in letters[:stage])
    mine = letters[stage]
    h, vocab = int(m.hidden_size), int(m.vocab_size)
    tied, mtp = bool(m.get("tie_embeddings", False)), "m" in mine
    pre, post = "E" in mine, "L" in mine
    ep_on = int(p.expert) > 1
    # megatron's shared_embedding marks (language_module.setup_embeddings_and_output_layer), PP > 1 only
    shares = pp > 1 and (tied or int(m.get("mtp_num_layers", 0) or 0) > 0)
    out: list[Param] = []
    if pre or mtp:
        marked = shares and ((pre and not post) or (not pre and mtp))
        out.append(Param("embedding.word_embeddings.weight", vocab * h, shared_embedding=marked))
    dense_k = int(m.moe.first_k_dense)
    for i in range(mine.count("t")):
        out += _layer(f"decoder.layers.{i}", cfg, first + i >= dense_k, ep_on)
    if post:
        out.append(Param("decoder.final_layernorm.weight", h))
    if mtp:
        x = "mtp.layers.0"
        out += [Param(f"{x}.enorm.weight", h), Param(f"{x}.hnorm.weight", h), Param(f"{x}.eh_proj.weight", 2 * h * h)]
        out += _layer(f"{x}.transformer_layer", cfg, True, ep_on)
        out.append(Param(f"{x}.final_layernorm.weight", h))
    # tied: the output layer computes with the stage's embedding where it has one (the first stage's, or the MTP
    # block's: fp4moe.model.gpt_model.drop_unused_output_weight)
    if post and not (tied and (pre or mtp)):
        marked = shares and tied and not pre
        out.append(Param("output_layer.weight", vocab * h, shared_embedding=marked))
    return out


# ---------------------------------------------------------------------------------------------- bytes

@dataclass(frozen=True)
class RankBytes:
    """What megatron's DDP and optimizer hold on one rank, in bytes: parameters (with the distributed optimizer:
    its padded parameter buffer), the gradient buffer, optimizer state on the GPU and in host memory."""

    params: int
    grads: int
    state_device: int
    state_host: int


def _groups(cfg: DictConfig, stage: int) -> tuple[list[Param], list[Param]]:
    ps = stage_parameters(cfg, stage)
    return [x for x in ps if not x.expert], [x for x in ps if x.expert]


def shard_sizes(cfg: Any) -> tuple[int, int]:
    """(data-parallel x context, expert-data-parallel) group sizes: what the dense and expert buffers shard over."""
    cfg = _as_cfg(cfg)
    p = cfg.parallel
    etp = int(p.get("expert_tensor") or p.tensor)
    return int(p.data) * int(p.context), int(p.world_size) // (etp * int(p.expert) * int(p.pipeline))


def rank_bytes(cfg: Any, stage: int, dp_rank: int = 0, edp_rank: int = 0, *, params_bytes: int = BF16) -> RankBytes:
    """The bytes one rank of pipeline stage ``stage`` holds (module docstring), at data-parallel rank ``dp_rank``
    and expert-data-parallel rank ``edp_rank`` (which slice of every bucket the distributed optimizer gives it).
    ``params_bytes``: 2 for BF16 parameters (``train.params_dtype``), 4 for FP32."""
    (one,) = ranks_bytes(cfg, stage, [(dp_rank, edp_rank)], params_bytes=params_bytes)
    return one


def ranks_bytes(cfg: Any, stage: int, ranks: Sequence[tuple[int, int]], *,
                params_bytes: int = BF16) -> list[RankBytes]:
    """:func:`rank_bytes` of each ``(dp_rank, edp_rank)`` in ``ranks``, in that order: the optimizer setting, the
    stage's parameters and its two buffers' layouts are built once for all of them."""
    cfg = _as_cfg(cfg)
    s = OptimizerSetting.from_config(cfg)
    dp, edp = shard_sizes(cfg)
    bucket = s.bucket_size
    if bucket is None and s.overlap_grad_reduce:
        bucket = max(DEFAULT_BUCKET, 1_000_000 * int(cfg.parallel.data))
    if stage > 0:
        bucket = None  # megatron DDP: no bucketing after the first pipeline stage
    per = (8 if params_bytes == FP32 else 12) + (FP32 if s.precision_aware else 0)
    held = []  # (shards, group's layout, its element count, which of the pair is this group's rank)
    for group, shards, which in zip(_groups(cfg, stage), (dp, edp), (0, 1)):
        if group:
            held.append((shards, buffer_layout(group, shards=shards, distributed=s.distributed, bucket_size=bucket),
                         sum(x.numel for x in group), which))
    params = sum((lay.numel if s.distributed else total) * params_bytes for _, lay, total, _ in held)
    grads = sum(lay.numel * s.grad_bytes for _, lay, _, _ in held)
    out = []
    for pair in ranks:
        device = host = 0
        for shards, lay, total, which in held:
            owned = lay.owned(shards, pair[which]) if s.distributed else total
            on_host = round(owned * s.host_fraction)
            device += (owned - on_host) * per
            host += on_host * per
        out.append(RankBytes(params, grads, device, host))
    return out


__all__ = ["Param", "Layout", "RankBytes", "buffer_layout", "stage_parameters", "stages", "shard_sizes", "rank_bytes",
           "ranks_bytes", "PARAM_ALIGN", "BUCKET_ALIGN", "DEFAULT_BUCKET"]
