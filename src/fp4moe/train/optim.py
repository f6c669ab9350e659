"""megatron-core's DDP, optimizer and learning-rate scheduler, built from fp4moe's config.

The trainer wraps its model in megatron-core 0.16.1's ``DistributedDataParallel`` and updates it with
``get_megatron_optimizer`` (torch's AdamW inside megatron's mixed-precision / distributed / hybrid-device
optimizers) and ``OptimizerParamScheduler``; nothing of the update is fp4moe's own. Three inputs:

- ``optimizer`` (conf/optimizer/*.yaml, :class:`fp4moe.settings.OptimizerSetting`): where the state lives and in what
  precision. ``gpu_fp32``: DDP with an FP32 gradient buffer + ``Float16OptimizerWithFloat16Params`` (FP32 main
  params and moments of every parameter). ``distributed``: megatron's ``DistributedOptimizer``, main params and
  moments sharded over the data-parallel group (dense parameters) and the expert-data-parallel group (routed
  experts at EP > 1). ``distributed_bf16_grads``: the precision-aware optimizer with BF16 main grads (the BF16
  gradient buffer is reduce-scattered in BF16). ``offload``: the same with the FP32 main params, the moments and
  the AdamW update on the host (``HybridDeviceOptimizer``).
- ``train.adamw``: lr, min_lr, betas, eps, weight_decay (none on 1-D parameters and biases, megatron's rule),
  grad_clip (megatron's global-norm clipping; null: no clipping, the norm is still computed and logged).
- ``train.schedule``: megatron's ``OptimizerParamScheduler`` (linear warm-up, then cosine or constant). Update k
  (1-based) uses the scheduler's lr at step k (``Trainer`` calls ``scheduler.step(1)`` before ``optimizer.step``),
  so the first update is not spent at lr 0 and update ``total`` reaches min_lr.

Workarounds, all for megatron-core 0.16.1 without Transformer Engine or apex (kept here, applied by
fp4moe.model.cpu_shims where megatron's own code needs patching):

1. The precision-aware optimizer (BF16 main grads) is accepted by ``OptimizerConfig`` only with TE's
   ``FusedAdam`` (optimizer_config.py: RuntimeError otherwise) *unless* ``optimizer_cpu_offload`` is set, in which
   case megatron builds its ``HybridDeviceOptimizer`` around torch's AdamW. ``distributed_bf16_grads`` is therefore
   built as ``optimizer_cpu_offload=True`` with ``optimizer_offload_fraction=0``: the same HybridDeviceOptimizer,
   every tensor on the GPU (FP32 copies of the BF16 shards, FP32 moments).
2. ``OptimizerConfig.__post_init__`` calls ``is_te_min_version`` for the precision-aware optimizer, which raises
   TypeError when TE is absent (it compares None with a version): cpu_shims shim 0c makes it False.
3. Adam moments in BF16 (``exp_avg_dtype``) exist only in TE's FusedAdam: refused by OptimizerSetting.
4. Resuming megatron's DistributedOptimizer around torch's AdamW (no apex / TE): its ``load_state_dict``
   (distrib_optimizer.py, the ``not HAVE_APEX_OR_TE`` branch) gives every parameter's state the same ``step``
   tensor, which torch's AdamW then increments once per parameter: the bias correction of every update after a
   resume is wrong. :func:`load_optimizer_state_dict` gives each state its own copy. With the offloading
   HybridDeviceOptimizer its ``load_state_dict`` first runs a ``dummy_step`` (random gradients: it moves the model's
   weights) and its ``dp_reshardable`` loader does not hand the loaded state to the sub-optimizers, as megatron's
   other loaders do (``_sync_hdo_state_to_sub_optimizers``): :func:`load_optimizer_state_dict` does, and the
   checkpoint loads the model's weights after the optimizer (fp4moe.train.checkpoint.load).
6. megatron's sharded checkpoint of a DistributedOptimizer (fp4moe.train.checkpoint, ``sharded_state_dict`` with
   ``is_loading``) starts with ``self.load_state_dict(self.state_dict())``, whose ``state_dict`` (the
   ``not HAVE_APEX_OR_TE`` branch) asserts that the optimizer's states hold one ``step``: a fresh optimizer has none.
   :func:`sharded_optimizer_state_dict` first gives it megatron's own dummy state (``_init_optimizer_states_with_
   dummy_values``: a zero-gradient AdamW step; the HybridDeviceOptimizer's ``dummy_step``), which the load then
   overwrites (main params, moments, step); the model's weights are loaded after.
5. On a machine without CUDA (the tests): megatron's optimizer code allocates on ``device='cuda'``, checks
   ``tensor.type() == 'torch.cuda.*'`` and builds its HybridDeviceOptimizer from ``param.is_cuda``:
   fp4moe.model.cpu_shims (shims 7-9, held for the run) makes those run on the CPU, nothing else.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from fp4moe.config import ConfigError
from fp4moe.settings import SCHEDULES, OptimizerSetting  # SCHEDULES: fp4moe.settings.Schedule refuses others first

log = logging.getLogger("fp4moe.train")

_GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _params_dtype(model: torch.nn.Module) -> torch.dtype:
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if len(dtypes) != 1:
        raise ValueError(f"the model's trainable parameters have dtypes {sorted(map(str, dtypes))}: one expected")
    return dtypes.pop()


def ddp_config(setting: OptimizerSetting):
    """megatron-core ``DistributedDataParallelConfig`` of ``setting`` (gradients averaged over DP by pre-scaling,
    megatron's default; one bucket per buffer unless ``overlap_grad_reduce`` or ``bucket_size``)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=setting.main_grads_dtype == "fp32", overlap_grad_reduce=setting.overlap_grad_reduce,
        use_distributed_optimizer=setting.distributed, overlap_param_gather=setting.overlap_param_gather,
        bucket_size=setting.bucket_size)


def optimizer_config(setting: OptimizerSetting, adamw: Any, params_dtype: torch.dtype):
    """megatron-core ``OptimizerConfig``: torch's AdamW (decoupled weight decay) with ``train.adamw``'s
    hyperparameters (``adamw``: fp4moe.settings.AdamW, or the config's node), placed and typed as ``setting`` says (module docstring, workaround 1)."""
    from megatron.core.optimizer import OptimizerConfig

    clip = adamw.grad_clip
    betas = [float(b) for b in adamw.betas]
    if len(betas) != 2:
        raise ConfigError(f"train.adamw.betas={list(adamw.betas)}: give two values, e.g. [0.9, 0.95]")
    pa = setting.precision_aware
    return OptimizerConfig(
        optimizer="adam", lr=float(adamw.lr), min_lr=float(adamw.min_lr), weight_decay=float(adamw.weight_decay),
        adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=float(adamw.eps), decoupled_weight_decay=True,
        clip_grad=0.0 if clip is None else float(clip), bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
        use_distributed_optimizer=setting.distributed, use_precision_aware_optimizer=pa,
        main_grads_dtype=_GRAD_DTYPES[setting.main_grads_dtype],
        optimizer_cpu_offload=pa, optimizer_offload_fraction=setting.host_fraction,
        overlap_cpu_optimizer_d2h_h2d=setting.overlap_cpu_optimizer_d2h_h2d)


def fuse_wgrads(model: torch.nn.Module) -> tuple[int, int]:
    """Gradient-accumulation fusion (``train.wgrad_accumulation_fusion``): weight gradients added into megatron
    DDP's ``main_grad`` where they are made, not written and then added by DDP's hook. Registers the routed experts'
    weights of fp4moe's MoE layers (``RecipeGroupedMLP``; ``fp4moe.ops.grouped_experts.fuse_wgrad_accumulation``)
    and turns on megatron's own ``gradient_accumulation_fusion`` in every megatron linear (attention, dense MLP,
    shared experts, ``SequentialMLP`` experts, output layer; through ``fp4moe.ops.wgrad_accumulation`` where apex is
    absent, ``fp4moe.model.cpu_shims`` 0f), which reads it at each call. The FP8 linears of the recipes compute
    their gradients themselves and leave them to the hook. With tied embeddings the output layer adds into the
    embedding's weight, which also gets the embedding lookup's gradient through autograd (the first stage's, or an
    MTP stage's copy): that weight gets ``zero_out_wgrad``, as megatron sets it itself only at PP = 1, so the hook
    still adds what autograd gathered and the fused GEMM's stand-in gradient is zeros, not uninitialized memory.
    Call after the DDP wrap, under the shims. Returns (expert weights registered, megatron linears fused)."""
    from megatron.core.tensor_parallel import layers

    from fp4moe.model.recipe_moe import RecipeGroupedMLP
    from fp4moe.ops.grouped_experts import fuse_wgrad_accumulation

    if not layers._grad_accum_fusion_available:
        raise RuntimeError("megatron's gradient_accumulation_fusion needs apex or fp4moe.model.cpu_shims.active(): "
                           "call fuse_wgrads inside the shims' scope")
    experts = linears = 0
    for m in model.modules():
        if isinstance(m, RecipeGroupedMLP):
            w1, w2 = m.grouped_weights()
            experts += fuse_wgrad_accumulation([*w1, *w2])
        elif isinstance(m, (layers.ColumnParallelLinear, layers.RowParallelLinear)) and not getattr(
                m, "computes_fp8", False):
            m.gradient_accumulation_fusion = True
            linears += 1
    if getattr(model, "share_embeddings_and_output_weights", False):
        shared = model.shared_embedding_or_output_weight()
        if shared is not None:
            shared.zero_out_wgrad = True
    return experts, linears


def wrap_model(model: torch.nn.Module, setting: OptimizerSetting):
    """``model`` (megatron ``GPTModel``, parameters already in their training dtype and on their device) in
    megatron-core's ``DistributedDataParallel`` (with the distributed optimizer it moves every parameter into its
    flat buffer)."""
    from megatron.core.distributed import DistributedDataParallel

    return DistributedDataParallel(model.config, ddp_config(setting), model)


def gather_updated_params(ddp: Any) -> None:
    """Make every rank's parameters the updated ones now. With ``optimizer.overlap_param_gather`` megatron's
    distributed optimizer step updates each rank's own shard of the parameter buffer only; the other ranks' shards
    are all-gathered during the next forward, each bucket awaited in the forward pre-hook of the first module that
    owns one of its parameters. What reads the parameters before that forward (a checkpoint's model state) calls
    this first: a synchronous all-gather of every bucket (megatron's own ``disable_forward_pre_hook`` does the same
    before a save); the next forward then finds them gathered. Collective over DP / expert-DP; nothing without
    ``overlap_param_gather``, where the step itself gathered."""
    if getattr(ddp, "use_forward_hook", False):
        ddp.start_param_sync(force_sync=True)


def build_optimizer(ddp: Any, setting: OptimizerSetting, adamw: Any):
    """megatron-core's optimizer over the DDP-wrapped model (a ``ChainedOptimizer``: dense and expert parameters)."""
    from megatron.core.optimizer import get_megatron_optimizer

    return get_megatron_optimizer(optimizer_config(setting, adamw, _params_dtype(ddp.module)), [ddp])


def check_schedule(train_cfg: Any) -> str:
    """``train.schedule.name``, refused (ConfigError) when megatron's scheduler has no such decay style here."""
    name = str(getattr(getattr(train_cfg, "schedule", None), "name", None) or "cosine")
    if name not in SCHEDULES:
        raise ConfigError(f"train.schedule.name={name!r}: pick one of {', '.join(SCHEDULES)}")
    return name


def build_scheduler(optimizer: Any, train_cfg: Any, derived: dict[str, Any]):
    """megatron-core's ``OptimizerParamScheduler`` in optimizer updates: warm-up ``derived['warmup_steps']``, decay
    to ``train.adamw.min_lr`` at update ``derived['steps']`` (at least one update after the warm-up, which megatron
    requires), constant weight decay. A resumed run takes the schedule of its config and the update count of its
    checkpoint (``override_opt_param_scheduler``), so a longer ``train.steps`` extends the decay."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    a = train_cfg.adamw
    warmup, total = int(derived["warmup_steps"]), int(derived["steps"])
    wd = float(a.weight_decay)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=float(a.lr), min_lr=float(a.min_lr), lr_warmup_steps=warmup,
        lr_decay_steps=max(total, warmup + 1), lr_decay_style=check_schedule(train_cfg), start_wd=wd, end_wd=wd,
        wd_incr_steps=max(total, 1), wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True)


def current_lr(scheduler: Any) -> float:
    """The scheduler's learning rate at its current step (the default parameter group's)."""
    return float(scheduler.get_lr({}))


# -------------------------------------------------------------------------------------------- state accounting

def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _state_tensors(opt: Any):
    """Every tensor megatron optimizer ``opt`` updates or keeps as state, each once: the tensors in its inner
    optimizer's parameter groups (FP32 main params, or the HybridDeviceOptimizer's FP32 / host copies, or views of
    the model's own parameters), their ``.grad`` (the HybridDeviceOptimizer's FP32 gradient copies, kept from one
    step to the next; a view of DDP's gradient buffer elsewhere) and AdamW's moments."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    inner = opt.optimizer
    if inner is None:
        return
    optimizers = inner.sub_optimizers if isinstance(inner, HybridDeviceOptimizer) else [inner]
    seen: set[int] = set()
    for o in optimizers:
        params = [p for g in o.param_groups for p in g["params"]]
        tensors = params + [p.grad for p in params]
        tensors += [st.get(k) for st in o.state.values() for k in ("exp_avg", "exp_avg_sq")]
        for t in tensors:
            if torch.is_tensor(t) and id(t) not in seen:
                seen.add(id(t))
                yield t


def state_bytes(optimizer: Any, ddp: Any) -> dict[str, int]:
    """Bytes of this rank's optimizer state, by where they live: ``{'device': ..., 'host': ...}`` (host: the CPU
    copies of an offloading HybridDeviceOptimizer). Counted: FP32 main params, AdamW's moments and the
    HybridDeviceOptimizer's FP32 gradient copies; not counted: what is the model's or DDP's (a main param that is
    the parameter itself, as for FP32 models; gradients that are views of DDP's buffer). Once the moments exist
    (after the first update); before it, the main params only."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    model_storage = {p.untyped_storage().data_ptr() for p in ddp.module.parameters()}
    model_storage |= {b.grad_data.untyped_storage().data_ptr() for b in ddp.buffers + ddp.expert_parallel_buffers}
    out = {"device": 0, "host": 0}
    for opt in _inner_optimizers(optimizer):
        host: set[int] = set()
        if isinstance(opt.optimizer, HybridDeviceOptimizer):
            host = {id(t) for sub in opt.optimizer.cpu_optimizers for t in _state_tensors(_Holder(sub))}
        for t in _state_tensors(opt):
            if t.untyped_storage().data_ptr() in model_storage:
                continue
            out["host" if id(t) in host else "device"] += t.numel() * t.element_size()
    return out


class _Holder:
    """A torch optimizer seen as a megatron optimizer (``.optimizer``), for :func:`_state_tensors`."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer


def grad_buffer_bytes(ddp: Any) -> int:
    """Bytes of megatron DDP's gradient buffers on this rank (dense and expert, padding included)."""
    return sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers + ddp.expert_parallel_buffers)


# -------------------------------------------------------------------------------------------- checkpoints

def _is_distributed(opt: Any) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


def optimizer_state_dict(optimizer: Any) -> list[dict[str, Any]]:
    """This rank's whole optimizer state, one entry per inner optimizer (dense, experts): megatron's
    ``state_dict()`` and, for a DistributedOptimizer, its shards' main params and moments in megatron's
    ``dp_reshardable`` form (this rank's buckets as they are; resumed by a run of the same layout)."""
    out = []
    for opt in _inner_optimizers(optimizer):
        sd = opt.state_dict()
        if _is_distributed(opt):
            state = opt.get_parameter_state_dp_reshardable()
            for key, by_dtype in state.items():
                if isinstance(key, int):  # buffer index -> {dtype: [bucket: [param entries]]}
                    for buckets in by_dtype.values():
                        for bucket in buckets:
                            for entry in bucket:
                                entry["padding"] = False  # what load_parameter_state_from_dp_reshardable filters on
            sd["param_state"] = state
            sd["param_state_sharding_type"] = "dp_reshardable"
        out.append(sd)
    return out


def load_optimizer_state_dict(optimizer: Any, state: list[dict[str, Any]]) -> None:
    """Restore :func:`optimizer_state_dict`'s output into ``optimizer`` (same setting and layout; ValueError
    naming the mismatch otherwise). Load the model's weights after this (workaround 4)."""
    inner = _inner_optimizers(optimizer)
    if len(state) != len(inner):
        raise ValueError(f"checkpoint holds {len(state)} optimizers (dense / expert), this run builds {len(inner)}: "
                         "resume with the same parallel layout and optimizer group")
    for opt, sd in zip(inner, state):
        if ("param_state" in sd) != _is_distributed(opt):
            raise ValueError("checkpoint's optimizer and this run's differ in optimizer.distributed: resume with the "
                             "same optimizer group")
        opt.load_state_dict(sd)
    _after_load(optimizer)


def _after_load(optimizer: Any, step: int | None = None) -> None:
    """Workaround 4 after megatron's ``load_state_dict``: one ``step`` tensor per parameter state (set to ``step``
    when given), and the HybridDeviceOptimizer's loaded state handed to its sub-optimizers."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    for opt in _inner_optimizers(optimizer):
        if opt.optimizer is None:
            continue
        for st in opt.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone() if step is None else torch.full_like(st["step"], float(step))
        if isinstance(opt.optimizer, HybridDeviceOptimizer):
            opt.optimizer._sync_hdo_state_to_sub_optimizers()


def sharded_optimizer_state_dict(optimizer: Any, model_sharded_state_dict: dict[str, Any], *, is_loading: bool,
                                 metadata: dict[str, Any]) -> dict[str, Any]:
    """megatron's ``optimizer.sharded_state_dict`` over the model's sharded state dict (fp4moe.train.checkpoint's
    sharded format; ``metadata``: megatron's, e.g. ``distrib_optim_sharding_type``). For a load, a
    DistributedOptimizer without state gets megatron's dummy state first (workaround 6)."""
    if is_loading:
        from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

        for opt in _inner_optimizers(optimizer):
            if not _is_distributed(opt) or opt.optimizer is None or len(opt.optimizer.state):
                continue
            if isinstance(opt.optimizer, HybridDeviceOptimizer):
                opt.optimizer.dummy_step()
            else:
                opt._init_optimizer_states_with_dummy_values()
    return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=metadata)


def load_sharded_optimizer_state_dict(optimizer: Any, state: dict[str, Any], *, step: int) -> None:
    """Restore what ``dist_checkpointing.load`` read for :func:`sharded_optimizer_state_dict` into ``optimizer``
    (megatron's ``load_state_dict``, then workaround 4), with AdamW's step count ``step`` (the optimizer updates so
    far: the checkpoint's training step, one update each). Load the model's weights after this.

    ``state`` holds this run's own non-tensor values (fp4moe.train.checkpoint stores tensors only); megatron's
    unsharded optimizers take the step from ``state['state']['common_step']`` (which a fresh optimizer's state dict
    does not have), the distributed one from its param groups: both get ``step`` here."""
    inner = _inner_optimizers(optimizer)
    parts = [state[i] for i in sorted(state)] if len(inner) > 1 else [state]
    for opt, part in zip(inner, parts):
        torch_sd = part.get("optimizer", part)  # Float16OptimizerWithFloat16Params: {'optimizer': ...}; FP32: itself
        if not _is_distributed(opt) and isinstance(torch_sd.get("state"), dict):
            torch_sd["state"]["common_step"] = torch.tensor(float(step))
        elif _is_distributed(opt):
            for group in part["optimizer"]["param_groups"]:
                group["step"] = step
    optimizer.load_state_dict(state)
    _after_load(optimizer, step)


__all__ = ["ddp_config", "optimizer_config", "wrap_model", "build_optimizer", "build_scheduler", "check_schedule",
           "current_lr", "state_bytes", "grad_buffer_bytes", "optimizer_state_dict", "load_optimizer_state_dict",
           "sharded_optimizer_state_dict", "load_sharded_optimizer_state_dict",
           "SCHEDULES"]
