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


def _move_grad(p: torch.nn.Parameter, master: torch.Tensor) -> None:
    """Add a BF16 parameter's ``.grad`` into its fp32 master's ``.grad`` and drop it (nothing when there is none)."""
    if p.grad is None:
        return
    if master.grad is None:
        master.grad = p.grad.float()
    else:
        master.grad.add_(p.grad)
    p.grad = None


class Optimizer:
    """AdamW over fp32 master weights of ``model``'s trainable parameters (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, train_cfg: Any) -> None:
        o = train_cfg.optimizer
        if str(o.get("name", "adamw")) != "adamw":
            raise ConfigError(f"train.optimizer.name={o.name!r}: only adamw is implemented")
        self.params: list[torch.nn.Parameter] = []
        self.masters: list[torch.Tensor] = []
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            master = p if p.dtype == torch.float32 else p.detach().float().clone()
            self.params.append(p)
            self.masters.append(master)
            (decay if p.dim() >= 2 and not name.endswith(".bias") else no_decay).append(master)
        self.expert = [_is_expert(p) for p in self.params]
        # megatron (language_module.py setup_embeddings_and_output_layer): a later pipeline stage's copy of the word
        # embedding is `shared` (left out of the norm); both copies are `shared_embedding` (gradients summed)
        self.shared = [bool(getattr(p, "shared", False)) for p in self.params]
        self.shared_embedding = [bool(getattr(p, "shared_embedding", False)) for p in self.params]
        self._hooks: list[Any] = []
        betas = tuple(float(b) for b in o.betas)
        self.grad_clip = None if o.get("grad_clip") is None else float(o.grad_clip)
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": float(o.weight_decay)}, {"params": no_decay, "weight_decay": 0.0}],
            lr=float(o.lr), betas=betas, eps=float(o.eps))  # torch's default: foreach on CUDA, a loop on CPU

    # -- gradients
    def accumulate(self) -> None:
        """After a micro-batch backward: move BF16 ``.grad`` into the fp32 accumulators (fp32 params keep
        accumulating in ``.grad`` themselves)."""
        for p, m in zip(self.params, self.masters):
            if m is not p:
                _move_grad(p, m)

    def accumulate_in_backward(self) -> None:
        """Do :meth:`accumulate`'s work for each BF16 parameter as soon as a backward pass has accumulated its
        ``.grad`` (``register_post_accumulate_grad_hook``), for schedules that run several backward passes without
        returning in between (megatron's 1F1B). Idempotent; fp32 parameters need nothing."""
        if self._hooks:
            return
        for p, m in zip(self.params, self.masters):
            if m is not p:
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p, m=m: _move_grad(p, m)))

    def main_grads(self) -> list[torch.Tensor]:
        """fp32 gradient of every master (zeros where no micro-batch produced one, e.g. an expert that got no
        token), so every rank reduces the same list."""
        for m in self.masters:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        return [m.grad for m in self.masters]

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
            stages: list[Any] = [None] * dist.get_world_size(pipeline_group)
            dist.all_gather_object(stages, (dense_norms.cpu(), expert_norms.cpu()), group=pipeline_group)
            dense_norms = torch.cat([d for d, _ in stages]).to(device)
            expert_norms = torch.cat([e for _, e in stages]).to(device)

        def sq(n: torch.Tensor) -> torch.Tensor:
            return n.pow(2).sum() if n.numel() else zero.clone()

        sq_dense, sq_expert = sq(dense_norms), sq(expert_norms)
        if expert_parallel_group is not None and dist.get_world_size(expert_parallel_group) > 1:
            dist.all_reduce(sq_expert, group=expert_parallel_group)
        return (sq_dense + sq_expert).sqrt()

    def clip(self, norm: torch.Tensor) -> None:
        """Scale gradients by ``min(1, grad_clip / (norm + 1e-6))`` (torch's clip_grad_norm_ rule)."""
        if self.grad_clip is None:
            return
        coef = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(self.main_grads(), coef)

    # -- update
    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None

    # -- checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"adamw": self.opt.state_dict(),
                "masters": [None if m is p else m.detach().clone() for p, m in zip(self.params, self.masters)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        masters = state["masters"]
        if len(masters) != len(self.masters):
            raise ValueError(f"checkpoint has {len(masters)} master weights, the model {len(self.masters)}")
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, masters):
                if saved is not None:
                    m.copy_(saved)
                    p.copy_(m)
        self.opt.load_state_dict(state["adamw"])


__all__ = ["lr_at", "Schedule", "Optimizer", "SCHEDULES"]
