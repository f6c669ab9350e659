"""One optimizer step of the trainer, and the evaluation: megatron-core's schedule over the step's micro-batches.

:class:`Stepper` holds what every step reuses (the layout's groups, the micro-batch shapes, the position ids);
``Stepper.run(step, consumed)`` does one update and returns its :class:`StepOutput`: the step's loss (nats/token,
mean over micro-batches and data-parallel ranks, the last pipeline stage's, known on every rank), lr, global grad
norm and the metrics that go to MLflow. :func:`evaluate` is the held-out loss. Every function here is collective:
every rank of the run calls it at the same point.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from fp4moe.train import batches


@dataclass
class StepOutput:
    """One optimizer update: ``step`` (1-based, after the update), ``consumed`` samples, ``loss`` (nats/token),
    ``lr``, ``grad_norm`` (before clipping), ``seconds`` (wall time of the update), ``metrics`` for MLflow."""
    step: int
    consumed: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    metrics: dict[str, float | None] = field(default_factory=dict)


class Stepper:
    """The step's constants and the two quantities measured once: the bytes one micro-batch's forward keeps for
    backward (``saved_bytes``, on the process's first step) and the largest size of the FP8 weight copies
    (``cache_bytes``, ``train.fp8_weight_cache``; 0 without)."""

    def __init__(self, cfg: Any, derived: dict[str, Any], parts: Any, device: Any) -> None:
        import torch
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
        from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

        if parts.settings is None:
            from fp4moe.settings import Settings

            parts.settings = Settings.from_config(cfg)
        p = parts.settings.parallel
        self.cfg, self.derived, self.parts, self.device = cfg, derived, parts, device
        self.micro, self.gbs, self.seq = p.micro_batch, p.global_batch, p.seq_length
        self.accum = int(derived["grad_accum_steps"])
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        # pipeline parallelism: megatron's 1F1B schedule runs the micro-batches; the loss is the last stage's
        self.pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group() if self.pp_size > 1 else None
        self.pp_last = parallel_state.get_pipeline_model_parallel_last_rank() if self.pp_size > 1 else None
        # The auxiliary (MoE load-balancing, MTP) losses' backward scale, 1 / accumulation steps like the main loss,
        # as megatron's schedules set it. Assigned, not set_loss_scale(): that copies into whatever tensor an earlier
        # model in this process left there (a 0-d one cannot take our [1]).
        MoEAuxLossAutoScaler.main_loss_backward_scale = torch.full((1,), 1.0 / self.accum, device=device)
        if parts.mcfg.mtp_num_layers:
            MTPLossAutoScaler.main_loss_backward_scale = torch.full((1,), 1.0 / self.accum, device=device)
        self.pos = torch.arange(self.seq, device=device).unsqueeze(0).expand(self.micro, -1)
        self.params = list(parts.model.parameters())
        self.saved_bytes: Any = None   # int, or with PP one int per stage
        self.cache_bytes = 0

    def run(self, step: int, consumed: int, *, first_of_process: bool) -> StepOutput:
        """The update from ``step`` to ``step + 1``: zero the gradient buffers, the micro-batches of samples
        ``consumed ...`` through megatron's schedule, ``finalize_model_grads`` (DP / expert-DP reduction, the
        embedding copies of PP, the router expert bias), the lr of ``step + 1``, megatron's optimizer (global norm,
        clipping, AdamW). Raises FloatingPointError when the optimizer skips the update (non-finite gradients)."""
        import torch
        import torch.distributed as dist
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        from fp4moe.model.gpt_model import a2a_stats, release_dispatcher_tensors
        from fp4moe.ops.weight_cache import CACHE as wcache
        from fp4moe.train import optim

        parts, device = self.parts, self.device
        parts.profiler.before_step(step + 1)
        parts.meter.before_step()
        a2a_before = a2a_stats(parts.model)
        t0 = time.perf_counter()
        parts.ddp.zero_grad_buffer()
        parts.opt.zero_grad()
        micro_batches = [batches.micro_batch(parts.train_ds, consumed, k, self.micro, self.dp_rank, self.dp_size, device,
                                        non_blocking=True) for k in range(self.accum)]
        losses, measured = forward_backward(parts.ddp, micro_batches, self.pos, seq=self.seq, micro=self.micro,
                                            forward_only=False,
                                            measure_exclude=self.params if self.saved_bytes is None else None)
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        for loss in losses:
            loss_sum += loss
        if self.saved_bytes is None:
            self.saved_bytes = measured if self.pp_size == 1 else per_stage(measured, self.pp_group)
        finalize_model_grads([parts.ddp])
        release_dispatcher_tensors(parts.model)  # else their graphs keep activations into the next step
        parts.sched.step(1)  # update `step + 1` takes the schedule's lr at step + 1
        lr = optim.current_lr(parts.sched)
        self.cache_bytes = max(self.cache_bytes, wcache.bytes())  # the FP8 weight copies this step made
        ok, norm_v, _ = parts.opt.step()  # global grad norm over every rank, clipping, AdamW; parameters gathered
        wcache.new_step()  # (a torch optimizer's step hook did too; megatron's copy to the model came after it)
        if not ok:
            raise FloatingPointError(f"megatron's optimizer skipped the update of step {step + 1} (non-finite "
                                     "gradients)")
        norm_v = float(norm_v)
        step += 1
        consumed += self.gbs
        loss_step = loss_sum / self.accum
        if self.dp_size > 1:
            dist.all_reduce(loss_step, group=self.dp_group)
            loss_step /= self.dp_size
        if self.pp_size > 1:  # from the last stage to the others (rank 0, which logs, is a first stage)
            dist.broadcast(loss_step, src=self.pp_last, group=self.pp_group)
        loss_v = float(loss_step.item())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        m: dict[str, float | None] = {"loss": loss_v, "lr": lr, "grad_norm": norm_v, "consumed_samples": float(consumed)}
        m.update(parts.meter.after_step(dt))
        m.update(moe_losses(parts.mcfg, self.accum, self.pp_group, device))
        # all-to-all payload bytes of this step on this GPU (recipe dispatcher; none under bf16), the routed rows its
        # tokens sent and its experts received (every recipe: the routing's imbalance) and, on the process's first
        # step, the bytes one micro-batch's forward keeps for backward (parameters excluded). Under pipeline
        # parallelism both are summed over the pipeline's stages (the whole model, as with PP = 1); the largest
        # stage's saved bytes are logged apart.
        a2a_after = a2a_stats(parts.model)
        a2a = {f"a2a/{k}": float(v - a2a_before.get(k, 0)) for k, v in a2a_after.items()
               if k.endswith(("_bytes", "_rows"))}
        m.update(sum_over_stages(a2a, self.pp_group))
        if first_of_process:
            if self.pp_size == 1:
                m["saved_activation_bytes_per_micro_batch"] = float(self.saved_bytes)
            else:
                m["saved_activation_bytes_per_micro_batch"] = float(sum(self.saved_bytes))
                m["saved_activation_bytes_per_micro_batch_max_stage"] = float(max(self.saved_bytes))
        return StepOutput(step=step, consumed=consumed, loss=loss_v, lr=lr, grad_norm=norm_v, seconds=dt, metrics=m)

    def evaluate(self) -> float:
        """The held-out loss now (:func:`evaluate`)."""
        return evaluate(self.parts.model, self.parts.valid_ds, self.parts.settings, self.derived, self.device,
                        self.pos)


def moe_losses(mcfg: Any, accum: int, pp_group: Any = None, device: Any = None) -> dict[str, float]:
    """megatron-core's MoE auxiliary losses of the step just done (e.g. ``moe/seq_load_balancing_loss``), the
    mean over MoE layers of the per-micro-batch mean, reduced across ranks; clears megatron's tracker. Collective:
    every rank calls it.

    With pipeline parallelism (``pp_group`` of more than one stage) megatron sums the per-layer values over the
    stages, which needs every stage to reduce the same names: a stage without MoE layers (or with other aux
    losses) gets zero entries for the names the other stages have, and each name's result is taken from the first
    stage that holds such a layer (that stage also averaged it over data parallelism), so every rank returns the
    whole model's values."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, track_moe_metrics

    names = owners = None
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        import torch

        tracker = get_moe_layer_wise_logging_tracker()
        # the names this stage's own layers logged (not the zero stand-ins of an earlier step, which stay in the
        # process-global tracker)
        own = sorted(n for n, v in tracker.items() if not v.get("fp4moe_stand_in"))
        owners = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(owners, own, group=pp_group)
        names = sorted(set().union(*owners))
        size = int(mcfg.num_layers) + int(mcfg.mtp_num_layers or 0)
        for name in names:
            if name not in tracker:
                tracker[name] = {"values": torch.zeros(size, device=device), "reduce_group": None,
                                 "avg_group": None, "reduce_group_has_dp": False, "fp4moe_stand_in": True}
    out: dict[str, Any] = {}
    track_moe_metrics(loss_scale=1.0 / accum, iteration=0, total_loss_dict=out, num_layers=mcfg.num_layers,
                      moe_layer_freq=mcfg.moe_layer_freq, mtp_num_layers=mcfg.mtp_num_layers, track_names=names)
    got = {f"moe/{k}": float(v) for k, v in out.items()}
    if owners is None:
        return got
    every = [None] * len(owners)
    dist.all_gather_object(every, got, group=pp_group)
    return {f"moe/{n}": next(r[f"moe/{n}"] for o, r in zip(owners, every) if n in o) for n in names}


def forward_backward(model: Any, batches: list[Any], pos: Any, *, seq: int, micro: int,
                     forward_only: bool, measure_exclude: Any = None) -> tuple[list[Any], int | None]:
    """Run ``batches`` (this step's micro-batches, each ``(tokens, labels)``) through megatron-core's schedule
    (``get_forward_backward_func``: one after the other for PP = 1, 1F1B for PP > 1, activations of shape
    [seq, micro, hidden] sent between stages). Returns the per-micro-batch mean LM losses (0-d fp32 tensors, in
    micro-batch order) on the last stage ([] elsewhere) and, with ``measure_exclude`` (the parameters), the bytes
    this stage's forward of the first micro-batch kept for backward (None otherwise). Every stage reads the same
    micro-batches (the first for the tokens, the last for the labels; MTP needs both there)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from fp4moe.ops.accounting import SavedTensorBytes

    measured: list[int] = []

    def loss_func(output: Any):
        loss = output.float().mean()
        # the schedule divides the first element by the micro-batch count in place: report a copy
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator: Any, model: Any):
        tokens, labels = next(data_iterator)
        if measure_exclude is not None and not measured:
            with SavedTensorBytes(exclude=measure_exclude) as counter:
                out = model(tokens, pos, None, labels=labels)
            measured.append(counter.release())
        else:
            out = model(tokens, pos, None, labels=labels)
        return out, loss_func

    store = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                                        num_microbatches=len(batches), seq_length=seq, micro_batch_size=micro,
                                        forward_only=forward_only)
    return [d["loss"] for d in store], (measured[0] if measured else None)


def evaluate(model: Any, valid_ds: Any, settings: Any, derived: dict[str, Any], device: Any, pos: Any) -> float:
    """Mean LM loss (nats/token) over the first ``train.eval_steps`` (``settings``: fp4moe.settings.Settings) global batches of the validation split (the same
    samples every time), averaged over DP ranks. With pipeline parallelism: megatron's schedule with
    ``forward_only``, the loss computed on the last stage and broadcast to the pipeline's other stages."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    p = settings.parallel
    micro, accum = p.micro_batch, int(derived["grad_accum_steps"])
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    n_steps = settings.train.eval_steps
    total = torch.zeros((), dtype=torch.float64, device=device)
    model.eval()
    with torch.no_grad():
        for s in range(n_steps):
            micro_batches = []
            for k in range(accum):
                tokens, labels = batches.micro_batch(valid_ds, s * p.global_batch, k, micro,
                                                      dp_rank, dp_size, device)
                if pp_size == 1:
                    total += model(tokens, pos, None, labels=labels).float().mean().double()
                else:
                    micro_batches.append((tokens, labels))
            if micro_batches:
                losses, _ = forward_backward(model, micro_batches, pos, seq=p.seq_length,
                                             micro=micro, forward_only=True)
                for loss in losses:
                    total += loss.double()
    model.train()
    total /= n_steps * accum
    if dp_size > 1:
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        total /= dp_size
    if pp_size > 1:
        dist.broadcast(total, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return float(total.item())


def per_stage(value: Any, pp_group: Any) -> list[Any]:
    """``value`` of every stage of this process's pipeline, in stage order (collective over ``pp_group``)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(out, value, group=pp_group)
    return out


def sum_over_stages(values: dict[str, float], pp_group: Any) -> dict[str, float]:
    """Per-key sum of ``values`` over the pipeline's stages (a key missing on a stage counts 0); ``values`` itself
    without pipeline parallelism."""
    if pp_group is None:
        return values
    total: dict[str, float] = {}
    for stage in per_stage(values, pp_group):
        for k, v in stage.items():
            total[k] = total.get(k, 0.0) + v
    return total


__all__ = ["StepOutput", "Stepper", "evaluate", "forward_backward", "moe_losses", "per_stage", "sum_over_stages"]
