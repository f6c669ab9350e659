"""AdamW with fp32 master weights, the learning-rate schedule, gradient all-reduce, norm and clipping.

Mixed precision (``train.params_dtype: bf16``): the model holds BF16 parameters; the optimizer keeps an fp32
master copy of each and an fp32 gradient accumulator (``main_grad``). After every micro-batch backward,
:meth:`Optimizer.accumulate` adds the BF16 ``.grad`` into it and frees the BF16 gradient, so accumulation over
micro-batches is fp32, as megatron-core's DDP does. ``step`` updates the fp32 masters with ``torch.optim.AdamW``
and copies them back into the BF16 parameters. With fp32 parameters the master *is* the parameter.

Parameter groups: weight decay on every parameter with two or more dimensions (linear weights, embeddings),
none on 1-D ones (RMSNorm weights, biases).

Gradient reduction (data and expert parallelism, megatron-core's convention): the loss of each rank is its
local token mean; dense gradients are summed over the data-parallel group and divided by its size DP; expert
gradients (parameters megatron marks ``allreduce = False``) are summed over the expert-data-parallel group and
divided by the same DP (the all-to-all already summed the EP ranks' contributions).

Pipeline parallelism (megatron-core's conventions, what its ``finalize_model_grads`` and ``clip_grads`` do): each
stage holds its own parameters. A word-embedding weight that lives on two stages (tied output layer, or the MTP
block's embedding on the last stage: megatron marks both copies ``shared_embedding``) has its gradient summed over
megatron's embedding group (:meth:`Optimizer.reduce_embedding_grads`), so both copies take the same update; the
copy that is not the first stage's (marked ``shared``) is left out of the norm. The gradient norm takes the
per-parameter norms of every stage (gathered over the pipeline group), so every rank clips by the same global norm,
the one a single process computes. Under 1F1B the
micro-batches' backward passes are run by megatron's schedule: :meth:`Optimizer.accumulate_in_backward` moves each
BF16 gradient into its fp32 accumulator as soon as the backward pass has produced it (a post-accumulate-grad hook,
as megatron-core's DDP does), so accumulation stays fp32 there too.

Distributed optimizer (``parallel.distributed_optimizer=true``, megatron-core's memory layout: "6 + 12/d" bytes per
parameter): the fp32 master weights and AdamW moments are sharded over the data-parallel group (dense parameters)
and the expert-data-parallel group (routed experts). The parameters are cut into buckets of whole parameters (at
most BUCKET_NUMEL elements each, padded to a multiple of the group size d); rank r owns the r-th 1/d of every bucket
(:class:`ShardLayout`) and keeps fp32 masters and moments of that slice only. The fp32 gradient accumulators stay
full size on every rank, as megatron's grad buffer does; the gradients are all-reduced as without sharding (not
reduce-scattered), so the step is bit for bit the unsharded one, and the grad norm and clipping see the same
gradients. After the update each rank casts its slice to the parameters' dtype and the group all-gathers every
bucket into the parameters. Checkpoints hold each rank's own slice (resume with the same layout).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from fp4moe.config import ConfigError

SCHEDULES = ("cosine", "constant")
BUCKET_NUMEL = 2 ** 26  # fp32 elements per gradient all-reduce bucket (256 MiB)


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int, name: str = "cosine") -> float:
    """Learning rate of optimizer update ``step`` (0-based): linear warm-up ``lr * (step + 1) / warmup`` over the
    first ``warmup`` updates, then cosine from ``lr`` down to ``min_lr`` at update ``total - 1`` (``constant``:
    ``lr`` after warm-up). A pure function of the step, so a resumed run gets the same values."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if name == "constant":
        return lr
    span = max(1, total - warmup - 1)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class Schedule:
    """The schedule of a run (``train.optimizer``, ``train.schedule``, derived warm-up/total steps); its state is
    the number of updates done, ``last_step``."""

    def __init__(self, train_cfg: Any, derived: dict[str, Any]) -> None:
        name = str((train_cfg.get("schedule") or {}).get("name", "cosine"))
        if name not in SCHEDULES:
            raise ConfigError(f"train.schedule.name={name!r}: pick one of {', '.join(SCHEDULES)}")
        o = train_cfg.optimizer
        self.name, self.lr, self.min_lr = name, float(o.lr), float(o.min_lr)
        self.warmup, self.total = int(derived["warmup_steps"]), int(derived["steps"])
        if self.min_lr > self.lr:
            raise ConfigError(f"train.optimizer.min_lr={self.min_lr} > lr={self.lr}: min_lr must not exceed lr")
        self.last_step = 0

    def __call__(self, step: int) -> float:
        return lr_at(step, lr=self.lr, min_lr=self.min_lr, warmup=self.warmup, total=self.total, name=self.name)

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "name": self.name, "lr": self.lr, "min_lr": self.min_lr,
                "warmup": self.warmup, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = int(state["last_step"])


def _is_expert(p: torch.nn.Parameter) -> bool:
    return not getattr(p, "allreduce", True)


class ShardLayout:
    """How ``params`` (one group: dense or routed experts) are cut over a group of ``size`` ranks; this is rank
    ``rank``'s view.

    ``buckets``: per bucket ``(padded_numel, [(param index, offset in the bucket, numel), ...])``, whole parameters
    in model order, at most ``bucket_numel`` elements unless one parameter is larger, padded to a multiple of
    ``size``. ``slices``: what this rank owns, ``(bucket, param index, start, end)`` with ``start:end`` in the
    parameter's flattened elements, in bucket order. Parameter indices are into the optimizer's parameter list."""

    def __init__(self, params: list[tuple[int, int]], size: int, rank: int, bucket_numel: int = BUCKET_NUMEL) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a group of {size}")
        self.size, self.rank = size, rank
        self.buckets: list[tuple[int, list[tuple[int, int, int]]]] = []
        cur: list[tuple[int, int, int]] = []
        n = 0
        for k, (index, numel) in enumerate(params):
            cur.append((index, n, numel))
            n += numel
            if n >= bucket_numel or k == len(params) - 1:
                self.buckets.append((-(-n // size) * size, cur))
                cur, n = [], 0
        self.slices: list[tuple[int, int, int, int]] = []
        for b, (padded, members) in enumerate(self.buckets):
            own = padded // size
            lo, hi = rank * own, (rank + 1) * own
            for index, off, numel in members:
                start, end = max(lo, off) - off, min(hi, off + numel) - off
                if start < end:
                    self.slices.append((b, index, start, end))

    @property
    def owned_numel(self) -> int:
        return sum(e - s for _, _, s, e in self.slices)


def _is_decayed(name: str, p: torch.nn.Parameter) -> bool:
    return p.dim() >= 2 and not name.endswith(".bias")


class Optimizer:
    """AdamW over fp32 master weights of ``model``'s trainable parameters (see the module docstring).

    ``shard_groups``: ``(dense group, expert group)`` (process groups, None = the default group) to shard the fp32
    masters and moments over (the distributed optimizer); None keeps all of them on every rank."""

    def __init__(self, model: torch.nn.Module, train_cfg: Any, shard_groups: tuple[Any, Any] | None = None) -> None:
        o = train_cfg.optimizer
        if str(o.get("name", "adamw")) != "adamw":
            raise ConfigError(f"train.optimizer.name={o.name!r}: only adamw is implemented")
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.params: list[torch.nn.Parameter] = [p for _, p in named]
        self.fp32 = [p.dtype == torch.float32 for p in self.params]
        # fp32 gradient accumulators of the BF16 parameters (an fp32 parameter accumulates in its own .grad)
        self._grads: list[torch.Tensor | None] = [None] * len(self.params)
        self.expert = [_is_expert(p) for p in self.params]
        # megatron (language_module.py setup_embeddings_and_output_layer): a later pipeline stage's copy of the word
        # embedding is `shared` (left out of the norm); both copies are `shared_embedding` (gradients summed)
        self.shared = [bool(getattr(p, "shared", False)) for p in self.params]
        self.shared_embedding = [bool(getattr(p, "shared_embedding", False)) for p in self.params]
        self._hooks: list[Any] = []
        # per pipeline stage, (dense, expert) parameter counts in the norm: fixed by the model, gathered once
        self._stage_counts: list[tuple[int, int]] | None = None
        self.grad_clip = None if o.get("grad_clip") is None else float(o.grad_clip)
        decayed = [_is_decayed(name, p) for name, p in named]
        self.layouts: dict[bool, ShardLayout] = {}
        # per bucket, what _gather_params needs each step: (group, size, padded numel, dtype, members,
        # [(this rank's fp32 slice, start, end in the rank's part of the bucket)])
        self._gather_plan: list[tuple[Any, int, int, torch.dtype, list[tuple[int, int, int]],
                                      list[tuple[torch.Tensor, int, int]]]] = []
        if shard_groups is None:
            # fp32 master of every parameter (an fp32 parameter is its own master)
            self.masters: list[torch.Tensor] = [p if f else p.detach().float().clone()
                                                for p, f in zip(self.params, self.fp32)]
            self._opt_params = self.masters
            opt_decayed = decayed
        else:
            self.masters = []   # the masters are the slices of _opt_params
            opt_decayed = self._shard(shard_groups, decayed)
        decay = [m for m, d in zip(self._opt_params, opt_decayed) if d]
        no_decay = [m for m, d in zip(self._opt_params, opt_decayed) if not d]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": float(o.weight_decay)}, {"params": no_decay, "weight_decay": 0.0}],
            lr=float(o.lr), betas=tuple(float(b) for b in o.betas), eps=float(o.eps))
        # torch's default implementation: foreach on CUDA, a loop on CPU

    def _shard(self, shard_groups: tuple[Any, Any], decayed: list[bool]) -> list[bool]:
        """Cut the dense parameters over ``shard_groups[0]``, the routed experts over ``shard_groups[1]``: this
        rank's fp32 slices become the AdamW parameters (``_opt_params``, with ``_shards`` = (param index, start,
        end)), and each bucket's all-gather is planned (``_gather_plan``). Returns the slices' weight-decay flags."""
        self._shards: list[tuple[int, int, int]] = []
        self._opt_params = []
        opt_decayed = []
        for expert, group in ((False, shard_groups[0]), (True, shard_groups[1])):
            sel = [(i, p.numel()) for i, (p, e) in enumerate(zip(self.params, self.expert)) if e == expert]
            if not sel:
                continue
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            layout = ShardLayout(sel, size, rank)
            self.layouts[expert] = layout
            pieces: list[list[tuple[torch.Tensor, int, int]]] = [[] for _ in layout.buckets]
            # where each parameter starts in this rank's part of its bucket (negative: before it)
            offsets = {i: off - rank * (padded // size) for padded, members in layout.buckets for i, off, _ in members}
            for bucket, i, a, b in layout.slices:
                shard = self.params[i].detach().reshape(-1)[a:b].float().clone()
                self._shards.append((i, a, b))
                self._opt_params.append(shard)
                opt_decayed.append(decayed[i])
                pieces[bucket].append((shard, offsets[i] + a, offsets[i] + b))
            for (padded, members), own in zip(layout.buckets, pieces):
                dtypes = {self.params[i].dtype for i, _, _ in members}
                dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
                self._gather_plan.append((group, size, padded, dtype, members, own))
        return opt_decayed

    @property
    def sharded(self) -> bool:
        return bool(self.layouts)

    def state_bytes(self) -> int:
        """Bytes of this rank's fp32 master weights and AdamW moments (fp32 parameters: their own master counts,
        as megatron's 12 B per parameter does), once the moments exist (after the first step); before it, the
        masters' bytes only."""
        masters = sum(m.numel() * m.element_size() for m in self._opt_params)
        moments = sum(t.numel() * t.element_size() for st in self.opt.state.values() for k, t in st.items()
                      if torch.is_tensor(t) and k in ("exp_avg", "exp_avg_sq"))
        return masters + moments

    # -- gradients
    def _move_grad(self, i: int) -> None:
        """Add BF16 parameter i's ``.grad`` into its fp32 accumulator and drop it (nothing when there is none)."""
        p = self.params[i]
        if p.grad is None:
            return
        if self._grads[i] is None:
            self._grads[i] = p.grad.float()
        else:
            self._grads[i].add_(p.grad)
        p.grad = None

    def accumulate(self) -> None:
        """After a micro-batch backward: move BF16 ``.grad`` into the fp32 accumulators (fp32 params keep
        accumulating in ``.grad`` themselves)."""
        for i, f in enumerate(self.fp32):
            if not f:
                self._move_grad(i)

    def accumulate_in_backward(self) -> None:
        """Do :meth:`accumulate`'s work for each BF16 parameter as soon as a backward pass has accumulated its
        ``.grad`` (``register_post_accumulate_grad_hook``), for schedules that run several backward passes without
        returning in between (megatron's 1F1B). Idempotent; fp32 parameters need nothing."""
        if self._hooks:
            return
        for i, (p, f) in enumerate(zip(self.params, self.fp32)):
            if not f:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p, i=i: self._move_grad(i)))

    def main_grads(self) -> list[torch.Tensor]:
        """fp32 gradient of every parameter (zeros where no micro-batch produced one, e.g. an expert that got no
        token), so every rank reduces the same list."""
        out = []
        for i, (p, f) in enumerate(zip(self.params, self.fp32)):
            if f:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                out.append(p.grad)
            else:
                if self._grads[i] is None:
                    self._grads[i] = torch.zeros_like(p, dtype=torch.float32)
                out.append(self._grads[i])
        return out

    def reduce_grads(self, dp_group: Any, dp_size: int, expert_dp_group: Any) -> None:
        """Average gradients over data parallelism (dense: DP group; experts: expert-DP group, divided by DP),
        in flat buckets of at most BUCKET_NUMEL elements (one all-reduce each)."""
        if dp_size == 1:
            return
        grads = self.main_grads()
        for expert, group in ((False, dp_group), (True, expert_dp_group)):
            sel = [g for g, e in zip(grads, self.expert) if e == expert]
            bucket: list[torch.Tensor] = []
            size = 0
            for i, g in enumerate(sel):
                bucket.append(g)
                size += g.numel()
                if size >= BUCKET_NUMEL or i == len(sel) - 1:
                    flat = torch._utils._flatten_dense_tensors(bucket)
                    if dist.get_world_size(group) > 1:
                        dist.all_reduce(flat, group=group)
                    flat.div_(dp_size)
                    for b, r in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                        b.copy_(r)
                    bucket, size = [], 0

    def reduce_embedding_grads(self, embedding_group: Any) -> None:
        """Sum the gradients of the word-embedding copies that live on two pipeline stages (``shared_embedding``)
        over megatron's embedding group (first and last stage), as megatron's ``_allreduce_word_embedding_grads``.
        Nothing when no parameter is shared or the group is None / has one rank (PP = 1)."""
        if embedding_group is None or dist.get_world_size(embedding_group) <= 1 or not any(self.shared_embedding):
            return
        if dist.get_rank() not in dist.get_process_group_ranks(embedding_group):
            return
        for g, shared in zip(self.main_grads(), self.shared_embedding):
            if shared:
                dist.all_reduce(g, group=embedding_group)

    def grad_norm(self, expert_parallel_group: Any = None, pipeline_group: Any = None) -> torch.Tensor:
        """Global L2 norm of the (reduced) gradients, fp32 scalar: dense gradients are replicated on every rank;
        expert gradients are sharded over the expert-parallel group, so their squares are summed over it; with
        pipeline parallelism the per-parameter norms of all stages are gathered over ``pipeline_group`` and summed
        in the model's parameter order (a later stage's copy of a shared word embedding left out, megatron's
        ``shared``), so every rank gets the same norm, bit for bit the one of PP = 1."""
        grads = self.main_grads()
        dense = [g for g, e, s in zip(grads, self.expert, self.shared) if not e and not s]
        experts = [g for g, e, s in zip(grads, self.expert, self.shared) if e and not s]
        device = grads[0].device
        zero = torch.zeros((), dtype=torch.float32, device=device)

        def norms(gs: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack(torch._foreach_norm(gs)) if gs else torch.zeros(0, dtype=torch.float32, device=device)

        dense_norms, expert_norms = norms(dense), norms(experts)
        if pipeline_group is not None and dist.get_world_size(pipeline_group) > 1:
            # every stage's per-parameter norms, in stage order (= the model's parameter order), so that the sum
            # below is the one a single stage would compute: every layout clips by the same bits
            dense_norms, expert_norms = self._gather_stage_norms(dense_norms, expert_norms, pipeline_group)

        def sq(n: torch.Tensor) -> torch.Tensor:
            return n.pow(2).sum() if n.numel() else zero.clone()

        sq_dense, sq_expert = sq(dense_norms), sq(expert_norms)
        if expert_parallel_group is not None and dist.get_world_size(expert_parallel_group) > 1:
            dist.all_reduce(sq_expert, group=expert_parallel_group)
        return (sq_dense + sq_expert).sqrt()

    def _gather_stage_norms(self, dense: torch.Tensor, expert: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stage's per-parameter norms (dense, expert), concatenated in stage order: one tensor all-gather
        on the norms' device per step (padded to the largest stage); the per-stage counts, fixed by the model,
        are exchanged once (``all_gather_object``, on the first call)."""
        n = dist.get_world_size(group)
        if self._stage_counts is None:
            counts: list[Any] = [None] * n
            dist.all_gather_object(counts, (dense.numel(), expert.numel()), group=group)
            self._stage_counts = [tuple(c) for c in counts]
        width = max(d + e for d, e in self._stage_counts)
        mine = torch.zeros(width, dtype=torch.float32, device=dense.device)
        mine[: dense.numel()] = dense
        mine[dense.numel(): dense.numel() + expert.numel()] = expert
        parts = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(parts, mine, group=group)
        return (torch.cat([p[:d] for p, (d, _) in zip(parts, self._stage_counts)]),
                torch.cat([p[d: d + e] for p, (d, e) in zip(parts, self._stage_counts)]))

    def clip(self, norm: torch.Tensor) -> None:
        """Scale gradients by ``min(1, grad_clip / (norm + 1e-6))`` (torch's clip_grad_norm_ rule)."""
        if self.grad_clip is None:
            return
        coef = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(self.main_grads(), coef)

    # -- update
    def step(self, lr: float) -> None:
        """AdamW on the masters (this rank's slices when sharded), then the parameters from them."""
        for group in self.opt.param_groups:
            group["lr"] = lr
        grads = self.main_grads()
        if not self.sharded:
            for m, g in zip(self.masters, grads):
                m.grad = g  # the same tensor for an fp32 parameter
            self.opt.step()
            with torch.no_grad():
                for p, m, f in zip(self.params, self.masters, self.fp32):
                    if not f:
                        p.copy_(m)
            return
        for s, (i, a, b) in zip(self._opt_params, self._shards):
            s.grad = grads[i].reshape(-1)[a:b]
        self.opt.step()
        self._gather_params()

    @torch.no_grad()
    def _gather_params(self) -> None:
        """Every rank's updated slices into every rank's parameters: per bucket, this rank's part cast to the
        parameters' dtype (fp32 when they differ), all-gathered over the shard group, copied into the parameters."""
        for group, d, padded, dtype, members, pieces in self._gather_plan:
            device = self.params[members[0][0]].device
            flat = torch.empty(padded, dtype=dtype, device=device)
            mine = torch.zeros(padded // d, dtype=dtype, device=device)
            for shard, lo, hi in pieces:
                mine[lo:hi].copy_(shard)
            if d > 1 and flat.is_cuda:
                dist.all_gather_into_tensor(flat, mine, group=group)
            elif d > 1:  # gloo: the list form
                dist.all_gather(list(flat.chunk(d)), mine, group=group)
            else:
                flat.copy_(mine)
            for i, off, numel in members:
                self.params[i].view(-1).copy_(flat[off:off + numel])

    def zero_grad(self) -> None:
        for i, p in enumerate(self.params):
            p.grad = None
            self._grads[i] = None
        for m in self._opt_params:
            m.grad = None

    # -- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Unsharded: the AdamW state and every BF16 parameter's master (None for fp32 parameters). Sharded: the
        AdamW state and masters of this rank's slices, and the layout they belong to."""
        if not self.sharded:
            return {"adamw": self.opt.state_dict(),
                    "masters": [None if f else m.detach().clone() for m, f in zip(self.masters, self.fp32)]}
        return {"adamw": self.opt.state_dict(), "shards": [s.detach().clone() for s in self._opt_params],
                "layout": self._layout_key()}

    def _layout_key(self) -> list[Any]:
        return [[bool(e), lay.size, lay.rank, [list(x) for x in lay.slices]] for e, lay in sorted(self.layouts.items())]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if ("shards" in state) != self.sharded:
            kind = "sharded" if "shards" in state else "unsharded"
            raise ValueError(f"checkpoint holds a {kind} optimizer state, this run's optimizer is "
                             f"{'sharded' if self.sharded else 'unsharded'} (parallel.distributed_optimizer)")
        if self.sharded:
            if state["layout"] != self._layout_key():
                raise ValueError("checkpoint's optimizer shards belong to another shard layout: resume with the "
                                 "same parallel layout")
            with torch.no_grad():
                for s, saved in zip(self._opt_params, state["shards"], strict=True):
                    s.copy_(saved)
            self.opt.load_state_dict(state["adamw"])
            self._gather_params()
            return
        masters = state["masters"]
        if len(masters) != len(self.masters):
            raise ValueError(f"checkpoint has {len(masters)} master weights, the model {len(self.masters)}")
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, masters):
                if saved is not None:
                    m.copy_(saved)
                    p.copy_(m)
        self.opt.load_state_dict(state["adamw"])


__all__ = ["lr_at", "Schedule", "Optimizer", "ShardLayout", "SCHEDULES"]
