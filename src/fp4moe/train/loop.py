"""The training run: checks, distributed set-up, data, model, optimizer, resume, steps, evaluation, checkpoints,
MLflow. Entry point :func:`train`; ``python -m fp4moe.train`` (fp4moe/train/__main__.py) wraps it in Hydra.

One step (one optimizer update) = ``global_batch`` samples of ``seq_length`` tokens: ``grad_accum_steps`` micro-
batches of ``micro_batch`` samples on each of the DP ranks, run by megatron-core's own schedule
(``get_forward_backward_func``: one micro-batch after the other for PP = 1, non-interleaved 1F1B for PP > 1,
activations [seq, micro, hidden] sent between stages). Per micro-batch: megatron-core ``GPTModel`` forward with
labels -> per-token cross entropy [micro, seq] -> mean, divided by grad_accum_steps by the schedule -> backward
(megatron's MoE auxiliary and MTP losses ride the same backward, scaled the same way). The model is wrapped in
megatron-core's ``DistributedDataParallel``, whose hooks add each gradient into its buffer. Then megatron's
``finalize_model_grads``: the DP (and expert-DP) reduction, the word-embedding copies of first and last pipeline
stage (tied output layer, MTP) summed over megatron's embedding group, the router expert-bias update from the tokens
each expert got in the global batch. Then megatron's optimizer (fp4moe.train.optim: the ``optimizer`` group says
where its state lives) takes the global gradient norm over all ranks, clips and updates, at the lr of megatron's
scheduler for this update.

The step's loss (and the evaluation loss, ``forward_only``) is the last stage's, broadcast over the pipeline so that
rank 0 (a first stage) logs it; the MoE aux losses are reduced over the stages, the all-to-all bytes and the
saved-activation bytes summed over them (the largest stage's saved bytes also logged). Checkpoints are sharded by
default (fp4moe.train.checkpoint: megatron-core dist_checkpointing, tensors under their global names, resumed at
any layout with the same optimizer group); per-rank ones resume at their own layout.

Order of the set-up, so that every mistake is reported before anything expensive: ``fp4moe.config.check`` and
the trainer's own limits (ConfigError), the MLflow store (``TrackingUnavailable``), megatron-core's transformer
config as fp4moe.model builds it (ConfigError for what cannot be built without TE), then torch.distributed,
megatron parallel state, the checkpoint to resume from (the newest whole one: damaged ones are skipped with a
warning; a run whose checkpoint is at ``train.steps`` already stops there and trains nothing, only logging what
the MLflow store could not take at its end), seeds, data, model, the checkpoint's state.
"""
from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from fp4moe import slurm, tracking
from fp4moe.config import ConfigError, check
from fp4moe.recipe import Recipe
from fp4moe.train import data as data_mod
from fp4moe.train.dist import (barrier, check_supported, gather_object, host_tags, init_distributed,
                               init_model_parallel, teardown, warm_up_communicators)
from fp4moe.train.host_env import apply_cluster_env, cluster_env

log = logging.getLogger("fp4moe.train")

PARAMS_DTYPES = ("bf16", "fp32")


@dataclass
class TrainResult:
    """What a call to :func:`train` did. Losses are nats/token, keyed by step (1-based optimizer update)."""
    run_id: str | None
    start_step: int
    step: int
    total_steps: int
    losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    lrs: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    stopped_by: int = 0                  # signal number that stopped the run, 0 if it ran to the end
    checkpoint: Path | None = None       # last checkpoint written by this call (or, already_finished, the last)
    already_finished: bool = False       # the checkpoint was at train.steps already: nothing trained, nothing logged
    summary: dict[str, float | None] = field(default_factory=dict)


_OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED")


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` means the GPU ran out of memory: torch's ``OutOfMemoryError``, or a library's allocation failure
    that torch reports as a plain RuntimeError (cuBLAS/cuDNN workspace, a Triton launch)."""
    return type(e).__name__ == "OutOfMemoryError" or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in _OOM_MESSAGES))


def preflight(cfg: Any) -> dict[str, Any]:
    """Everything that can be refused without torch.distributed: ``fp4moe.config.check`` (every value's type and
    range first, ``fp4moe.config.check_values``), the trainer's limits,
    the switches (``kernels.*`` and their ``FP4MOE_*`` variables, ``FP4MOE_TRACKING_THREAD``), the MLflow store, and megatron-core's ``MLATransformerConfig`` as
    fp4moe.model builds it. Returns ``derived(cfg)``; raises ConfigError / RecipeError / TrackingUnavailable."""
    derived = check(cfg)
    check_supported(cfg)
    cluster_env(cfg)  # a thread count that is not a positive integer
    dtype = str(OmegaConf.select(cfg, "train.params_dtype", default="bf16"))
    if dtype not in PARAMS_DTYPES:
        raise ConfigError(f"train.params_dtype={dtype!r}: pick one of {', '.join(PARAMS_DTYPES)}")
    seq, max_pos = int(cfg.parallel.seq_length), int(cfg.model.max_position_embeddings)
    if seq > max_pos:
        raise ConfigError(f"parallel.seq_length={seq} > model.max_position_embeddings={max_pos}: shorten the "
                          "sequence or raise model.max_position_embeddings")
    from fp4moe.train.optim import check_schedule

    check_schedule(cfg.train)  # the optimizer group and train.adamw were checked by check()
    from fp4moe.train.checkpoint import format_of

    format_of(cfg)
    from fp4moe.train.profile import profile_window

    profile_window(OmegaConf.select(cfg, "train.profile.steps", default=None))  # ConfigError for a bad window
    from fp4moe.ops import kernel_switches
    from fp4moe.train.metrics import tracking_thread

    try:
        # a typo in a kernel switch (kernels.*, or its FP4MOE_* variable) is refused here, not at the first backward
        kernel_switches(OmegaConf.select(cfg, "kernels", default=None))
        tracking_thread()  # nor one in FP4MOE_TRACKING_THREAD
    except ValueError as e:  # SwitchError included
        raise ConfigError(str(e)) from None
    from fp4moe.train.metrics import resolve_uri

    tracking.check_reachable(resolve_uri(cfg))
    import torch

    from fp4moe.model.megatron_import import import_megatron_core

    import_megatron_core(eager_fusions=not torch.cuda.is_available())  # dynamo is off on CPU anyway (_run)
    from fp4moe.model.build import transformer_config

    # megatron-core's own config checks and what fp4moe.model cannot build (recompute scopes, dispatcher), now
    transformer_config(cfg.model, cfg.parallel, cfg.recompute,
                       params_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    return derived


def train(cfg: Any, *, multirun_cell: str | None = None, output_dir: str | Path | None = None,
          after_step: Callable[[int, dict[str, float]], None] | None = None,
          resume_hint: str | None = None) -> TrainResult:
    """Train per the composed config ``cfg`` (conf/train.yaml and its groups).

    ``multirun_cell``: Hydra's ``override_dirname`` of a sweep cell (its own checkpoint folder).
    ``output_dir``: the Hydra job folder: ``summary.json`` goes there (None: not written), and a relative
    ``train.checkpoint_dir`` is resolved in it (``checkpoint.run_dir``).
    ``after_step(step, metrics)``: called on every rank after each step (tests use it to send signals).
    ``resume_hint``: what a stop by signal says to resume (``python -m fp4moe.train`` gives the exact command);
    None: "to resume, rerun the same command".
    """
    # The signals are caught from the start: one that comes during the set-up (a short Slurm time limit, a
    # preemption) stops the run after its first step, with a checkpoint.
    # where each rank was when a stop signal came: all threads' stacks, in the run's folder
    stacks = None if output_dir is None else Path(output_dir) / f"signal_stacks_rank{slurm.rank()}.txt"
    with slurm.Preemption(stacks_file=stacks) as preempt:
        derived = preflight(cfg)
        # before the model exists: a run that cannot checkpoint would only find out at its first save
        from fp4moe.train import checkpoint as ckpt

        ckpt.check_writable(ckpt.run_dir(cfg, multirun_cell, output_dir), derived.get("params_total"))
        apply_cluster_env(cfg)
        info = None
        from fp4moe.ops import kernel_switches, use_kernel_switches

        try:
            info = init_distributed(cfg)
            init_model_parallel(cfg, info)
            warm_up_communicators(info)  # before the model fills the GPU: NCCL allocates outside torch's allocator
            # the config's kernel switches (kernels.*) for every op of this run, whatever the environment says later
            with use_kernel_switches(kernel_switches(OmegaConf.select(cfg, "kernels", default=None))):
                result = _run(cfg, derived, info, multirun_cell, output_dir, after_step, preempt,
                              resume_hint or "to resume, rerun the same command")
        finally:
            teardown(info)
    if result.stopped_by:  # handlers restored: submitit's own now
        preempt.leave(result.stopped_by)  # the preemption signal in a Slurm job: requeue (raises slurm.Requeued)
    return result


def _seed_everything(seed: int) -> None:
    """python, numpy, torch (CPU and CUDA) and megatron-core's model-parallel RNG tracker (TP/EP streams)."""
    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _build_data(cfg: Any, info: Any):
    """Rank 0 builds first (tokenizer, indexed dataset, caches), the others then read what it wrote."""
    if info.rank == 0:
        out = data_mod.build_token_datasets(cfg)
    barrier()
    if info.rank != 0:
        out = data_mod.build_token_datasets(cfg)
    train_ds, valid_ds, dinfo = out
    seq, vocab = int(cfg.parallel.seq_length), int(cfg.model.vocab_size)
    if int(dinfo["vocab_size"]) > vocab:
        raise ConfigError(f"the tokenizer has {dinfo['vocab_size']} tokens but model.vocab_size={vocab}: raise "
                          "model.vocab_size or use a smaller tokenizer")
    for name, ds in (("train", train_ds), ("valid", valid_ds)):
        if len(ds) == 0:
            raise ConfigError(f"the {name} split is empty at parallel.seq_length={seq}: use more text or a "
                              "shorter sequence")
        n = len(ds[0])
        if n != seq + 1:
            raise ConfigError(f"{name} samples have {n} tokens, the trainer needs parallel.seq_length + 1 = {seq + 1}")
    return train_ds, valid_ds, dinfo


def _moe_losses(mcfg: Any, accum: int, pp_group: Any = None, device: Any = None) -> dict[str, float]:
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


def _forward_backward(model: Any, batches: list[Any], pos: Any, *, seq: int, micro: int,
                      forward_only: bool, measure_exclude: Any = None) -> tuple[list[Any], int | None]:
    """Run ``batches`` (this step's micro-batches, each ``(tokens, labels)``) through megatron-core's schedule
    (``get_forward_backward_func``: one after the other for PP = 1, 1F1B for PP > 1, activations of shape
    [seq, micro, hidden] sent between stages). Returns the per-micro-batch mean LM losses (0-d fp32 tensors, in micro-batch order) on the
    last stage ([] elsewhere) and, with ``measure_exclude`` (the parameters), the bytes this stage's forward of the
    first micro-batch kept for backward (None otherwise). Every stage reads the same micro-batches (the first for
    the tokens, the last for the labels; MTP needs both there)."""
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


def _evaluate(model: Any, valid_ds: Any, cfg: Any, derived: dict[str, Any], info: Any, pos: Any) -> float:
    """Mean LM loss (nats/token) over the first ``eval_steps`` global batches of the validation split (the same
    samples every time), averaged over DP ranks. With pipeline parallelism: megatron's schedule with
    ``forward_only``, the loss computed on the last stage and broadcast to the pipeline's other stages."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    micro, accum = int(cfg.parallel.micro_batch), int(derived["grad_accum_steps"])
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    n_steps = int(cfg.train.get("eval_steps") or 1)
    total = torch.zeros((), dtype=torch.float64, device=info.device)
    model.eval()
    with torch.no_grad():
        for s in range(n_steps):
            batches = []
            for k in range(accum):
                tokens, labels = data_mod.micro_batch(valid_ds, s * int(cfg.parallel.global_batch), k, micro,
                                                      dp_rank, dp_size, info.device)
                if pp_size == 1:
                    total += model(tokens, pos, None, labels=labels).float().mean().double()
                else:
                    batches.append((tokens, labels))
            if batches:
                losses, _ = _forward_backward(model, batches, pos, seq=int(cfg.parallel.seq_length),
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


def _per_stage(value: Any, pp_group: Any) -> list[Any]:
    """``value`` of every stage of this process's pipeline, in stage order (collective over ``pp_group``)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(out, value, group=pp_group)
    return out


def _sum_over_stages(values: dict[str, float], pp_group: Any) -> dict[str, float]:
    """Per-key sum of ``values`` over the pipeline's stages (a key missing on a stage counts 0); ``values`` itself
    without pipeline parallelism."""
    if pp_group is None:
        return values
    total: dict[str, float] = {}
    for stage in _per_stage(values, pp_group):
        for k, v in stage.items():
            total[k] = total.get(k, 0.0) + v
    return total


def _run(cfg: Any, derived: dict[str, Any], info: Any, multirun_cell: str | None, output_dir: Any,
         after_step: Any, stop: slurm.Preemption, resume_hint: str) -> TrainResult:
    import torch

    from fp4moe.model import cpu_shims

    cpu_shims.apply()
    # megatron-core logs its DDP buckets (every parameter's name) and its whole OptimizerConfig at INFO; the run's
    # config is in MLflow's params, so only its warnings reach the console
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    # megatron-core's jit_fuser is torch.compile: on CPU it would spend ~20 s in inductor for nothing.
    ctx = torch._dynamo.config.patch(disable=True) if info.device.type == "cpu" else contextlib.nullcontext()
    from fp4moe.train import checkpoint as ckpt

    with ctx, _claim(ckpt.run_dir(cfg, multirun_cell, output_dir), info) as claim:
        return _loop(cfg, derived, info, multirun_cell, output_dir, after_step, stop, resume_hint, claim)


def _claim(root: Path, info: Any) -> Any:
    """fp4moe.train.attempt.claim on rank 0, its outcome shared with every rank (collective): all go on, or all
    raise the same Busy (another process trains ``root``)."""
    from fp4moe.train import attempt

    held, why = None, None
    try:
        held = attempt.claim(root, info.rank == 0)
    except attempt.Busy as e:
        why = str(e)
    (why,) = _from_rank0([why], info)
    if why is not None:
        if held is not None:
            held.release()
        raise attempt.Busy(why)
    return held


def _from_rank0(values: list[Any], info: Any) -> list[Any]:
    """Rank 0's ``values`` on every rank (``broadcast_object_list``; collective), as they are alone."""
    if info.world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(values, src=0)
    return values


def _resume_candidates(root: Path, info: Any, *, resume: bool) -> list[tuple[Path, dict[str, Any]]]:
    """The whole-looking checkpoints of ``root`` (``fp4moe.train.checkpoint.scan``), newest first, the same on
    every rank (rank 0 looks; collective): the damaged ones newer than the first are warned about, and a folder
    with step folders but none whole is a ConfigError. ``resume`` false: ConfigError when any step folder exists."""
    from fp4moe.train import checkpoint as ckpt

    found: list[Any] = [None, None]
    if info.rank == 0:
        try:
            whole, damaged = ckpt.scan(root)
            if (whole or damaged) and not resume:
                names = ", ".join(f.name for f, _ in (whole + damaged)[:3])
                raise ConfigError(f"train.resume=false but {root} holds checkpoints ({names}): remove them, set "
                                  "train.checkpoint_dir elsewhere, or resume")
            if damaged and not whole:
                raise ckpt.none_usable(root, damaged)
            newest = whole[0][1]["step"] if whole else -1
            for folder, why in damaged:
                if int(folder.name[len("step_"):]) > newest:
                    log.warning("checkpoint %s is damaged (%s); falling back to the newest complete one", folder, why)
            found = [whole, None]
        except ConfigError as e:
            found = [None, str(e)]
    found = _from_rank0(found, info)
    if found[1] is not None:
        raise ConfigError(found[1])
    return found[0]


def _loop(cfg: Any, derived: dict[str, Any], info: Any, multirun_cell: str | None, output_dir: Any,
          after_step: Any, stop: slurm.Preemption, resume_hint: str, claim: Any) -> TrainResult:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from fp4moe.model.build import a2a_stats, build_gpt_model, release_dispatcher_tensors, to_bf16_params
    from fp4moe.ops.weight_cache import CACHE as wcache
    from fp4moe.train import checkpoint as ckpt
    from fp4moe.train.metrics import (PENDING_FILE, Meter, Tracker, flatten, hardware_tags, replay_if_pending,
                                      resolve_uri)
    from fp4moe.config import OptimizerSetting
    from fp4moe.train import optim
    from fp4moe.train.profile import StepProfiler

    t = cfg.train
    device = info.device
    total_steps = int(derived["steps"])
    # ---- resume, part 1 (before data and model): which checkpoint; a finished run stops here
    root = ckpt.run_dir(cfg, multirun_cell, output_dir)
    fp = ckpt.fingerprint(cfg)
    candidates = _resume_candidates(root, info, resume=bool(t.get("resume", True)))
    if candidates:
        folder, meta = candidates[0]
        ckpt.check_compatible(folder, meta, world_size=info.world_size, fingerprint_=fp)
        if int(meta["step"]) >= total_steps:
            if info.is_main:
                log.info("already finished at step %d/%d (checkpoint %s); nothing to train", int(meta["step"]),
                         total_steps, folder)
                # what the store could not take at the end of the run: log it now
                replay_if_pending(root / PENDING_FILE, resolve_uri(cfg))
            return TrainResult(run_id=meta.get("mlflow_run_id"), start_step=int(meta["step"]),
                               step=int(meta["step"]), total_steps=total_steps, checkpoint=folder,
                               already_finished=True)
    if device.type == "cuda":  # a local multirun runs its cells in one process: free what an earlier cell (or its
        import gc              # OOM traceback) left cached, so that each cell's peak memory is its own

        gc.collect()
        torch.cuda.empty_cache()
    _seed_everything(int(t.seed))
    train_ds, valid_ds, dinfo = _build_data(cfg, info)

    profiler = StepProfiler(cfg, output_dir, device, info.rank)
    profiler.start_memory_history()  # train.profile.memory: every allocation from here on gets its site
    dtype = torch.bfloat16 if str(t.get("params_dtype", "bf16")) == "bf16" else torch.float32
    model = build_gpt_model(cfg, params_dtype=dtype).to(device)
    if bool(t.get("layout_invariant_init", True)):  # megatron's draws depend on the EP/PP layout (fp4moe.model.init)
        from fp4moe.model.init import reinit_layout_invariant

        reinit_layout_invariant(model, int(t.seed))
        _seed_everything(int(t.seed))  # and the RNG state after the build is the same for every layout too
    if dtype == torch.bfloat16:
        to_bf16_params(model)  # as megatron-core's Float16Module, router expert-bias state kept fp32
    mcfg = model.config
    setting = OptimizerSetting.from_config(cfg)
    ddp = optim.wrap_model(model, setting)  # megatron-core's DDP: gradient buffers (and parameter buffers)
    opt = optim.build_optimizer(ddp, setting, t.adamw)
    sched = optim.build_scheduler(opt, t, derived)
    if setting.overlap_grad_reduce:  # as megatron-lm: only the last micro-batch's backward starts the reduction
        mcfg.no_sync_func = ddp.no_sync

    measure = t.get("measure") or {}
    meter = Meter(int(derived["tokens_per_step"]), info.world_size, int(measure.get("warmup_steps") or 0),
                  None if measure.get("steps") is None else int(measure["steps"]), device)

    # ---- resume, part 2: the newest checkpoint whose files every rank can read
    step, consumed, run_id = 0, 0, None
    unreadable: list[tuple[Path, str]] = []
    for folder, meta in candidates:
        ckpt.check_compatible(folder, meta, world_size=info.world_size, fingerprint_=fp)
        sharded = meta.get("format") == ckpt.SHARDED
        payload = why = None
        if sharded:  # collective: torch's loader reports a rank's failure to every rank
            try:
                meta = ckpt.load_sharded(folder, rank=info.rank, world_size=info.world_size, model=model,
                                         optimizer=opt, schedule=sched, meter=meter)
            except ckpt.Damaged as e:
                why = str(e)
        else:
            try:
                payload = ckpt.read_payload(folder, info.rank)
            except ckpt.Damaged as e:
                why = str(e)
        whys = gather_object(why, info.world_size)  # every rank resumes from the same one
        bad = [w for w in whys if w]
        if bad:
            if info.is_main:
                log.warning("checkpoint %s is damaged (%s); falling back to the previous one", folder, bad[0])
            unreadable.append((folder, bad[0]))
            continue
        if not sharded:
            meta = ckpt.load(folder, rank=info.rank, model=model, optimizer=opt, schedule=sched, meter=meter,
                             payload=payload)
            del payload
        step, consumed, run_id = int(meta["step"]), int(meta["consumed_samples"]), meta.get("mlflow_run_id")
        if info.is_main:
            log.info("resumed from %s (step %d, %d samples consumed)", folder, step, consumed)
        break
    else:
        if candidates:  # every complete-looking one failed to load
            raise ckpt.none_usable(root, unreadable)
    start_step = step

    # ---- MLflow (rank 0)
    # a store that fails mid-run: training goes on, what it could not take waits in the checkpoint folder
    tracker = Tracker(resolve_uri(cfg), str(OmegaConf.select(cfg, "tracking.experiment") or "train"),
                      enabled=info.is_main, pending=root / PENDING_FILE)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    params = flatten({k: v for k, v in resolved.items() if k != "hydra"})
    params["tracking.uri"] = tracking.without_credentials(resolve_uri(cfg))
    params.update({f"derived.{k}": str(v) for k, v in derived.items()})
    recipe = Recipe.from_config(cfg.precision).tag  # a preset's name, or a variant's label (mxfp4_mlp_shared)
    params.update({"recipe": recipe, "git_commit": tracking.environment_tags()["mlflow.source.git.commit"],
                   "data.vocab_size_tokenizer": str(dinfo.get("vocab_size")),
                   "data.train_tokens": str(dinfo.get("train_tokens")), "data.valid_tokens": str(dinfo.get("valid_tokens")),
                   "data.tokenizer_path": str(dinfo.get("tokenizer_path")),
                   "data.dataset_prefix": str(dinfo.get("dataset_prefix"))})
    tags = hardware_tags(device, info.world_size, info.launcher)
    tags.update({"recipe": recipe, "recompute": str(cfg.recompute.name), "model": str(cfg.model.name),
                 "optimizer": setting.name,
                 "checkpoint_dir": str(root), **host_tags(info.hosts), **slurm.job_tags()})
    extra = OmegaConf.select(cfg, "tracking.tags", default=None) or {}  # the caller's own (e.g. fp4moe.reproduce_runs)
    tags.update({str(k): str(v) for k, v in extra.items()})
    run_name = f"{cfg.get('task_name', 'train')}/{cfg.model.name}/{recipe}/{cfg.recompute.name}"
    store = tracking.without_credentials(resolve_uri(cfg))
    tracker.start(run_name, params, tags, resume_run_id=run_id, earlier_run=claim.earlier_run(store))
    if tracker.run_id is not None:  # rank 0: the folder's record names the MLflow run it trains now
        claim.record(tracker.run_id, store)
    result = TrainResult(run_id=tracker.run_id, start_step=start_step, step=step, total_steps=int(derived["steps"]))
    # every rank learns the run id (it goes into every checkpoint's meta via rank 0 only)
    (result.run_id,) = _from_rank0([tracker.run_id], info)

    # ---- loop constants
    p = cfg.parallel
    micro, gbs, seq = int(p.micro_batch), int(p.global_batch), int(p.seq_length)
    accum = int(derived["grad_accum_steps"])
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    dp_group = parallel_state.get_data_parallel_group()
    # pipeline parallelism: megatron's 1F1B schedule runs the micro-batches; the loss is the last stage's
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_group = parallel_state.get_pipeline_model_parallel_group() if pp_size > 1 else None
    pp_last = parallel_state.get_pipeline_model_parallel_last_rank() if pp_size > 1 else info.rank
    # The auxiliary (MoE load-balancing, MTP) losses' backward scale, 1 / accumulation steps like the main loss, as
    # megatron's schedules set it. Assigned, not set_loss_scale(): that copies into whatever tensor an earlier model
    # in this process left there (a 0-d one cannot take our [1]).
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.full((1,), 1.0 / accum, device=device)
    if mcfg.mtp_num_layers:
        MTPLossAutoScaler.main_loss_backward_scale = torch.full((1,), 1.0 / accum, device=device)
    pos = torch.arange(seq, device=device).unsqueeze(0).expand(micro, -1)
    log_every = int(t.get("log_interval") or 1)
    eval_every = t.get("eval_interval")
    ckpt_every = t.get("checkpoint_interval")
    keep = int(t.get("keep_checkpoints") or 2)
    ckpt_format = ckpt.format_of(cfg)

    def save() -> Path:
        tracker.flush()  # every logged step up to the checkpoint's is in the store (or the pending file) before
        #                  the checkpoint exists
        path = ckpt.save(root, step=step, consumed_samples=consumed, rank=info.rank, world_size=info.world_size,
                         model=model, optimizer=opt, schedule=sched, mlflow_run_id=result.run_id,
                         fingerprint_=fp, keep=keep, meter=meter, format_=ckpt_format)
        result.checkpoint = path
        return path

    bar = None
    if info.is_main and bool(t.get("progress_bar", True)):
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=step, desc=f"train {recipe}", unit="step", dynamic_ncols=True)
    status = "FAILED"
    last_saved = last_eval = -1
    params = list(model.parameters())
    saved_bytes: int | None = None  # measured once, on this process's first micro-batch
    # FP8 copies of the weights once per optimizer step (fp4moe/ops/weight_cache.py), registered after the DDP wrap
    # (megatron's buffers hold the parameters now); dropped after each opt.step() below
    cache_bytes = 0
    if bool(t.get("fp8_weight_cache", False)):
        wcache.enable(params)
    try:
        model.train()
        while step < total_steps:
            profiler.before_step(step + 1)
            meter.before_step()
            a2a_before = a2a_stats(model)
            t0 = time.perf_counter()
            ddp.zero_grad_buffer()
            opt.zero_grad()
            batches = [data_mod.micro_batch(train_ds, consumed, k, micro, dp_rank, dp_size, device, non_blocking=True)
                       for k in range(accum)]
            losses, measured = _forward_backward(ddp, batches, pos, seq=seq, micro=micro, forward_only=False,
                                                 measure_exclude=params if saved_bytes is None else None)
            loss_sum = torch.zeros((), dtype=torch.float32, device=device)
            for loss in losses:
                loss_sum += loss
            if saved_bytes is None:
                saved_bytes = measured if pp_size == 1 else _per_stage(measured, pp_group)
            finalize_model_grads([ddp])  # DP / expert-DP reduction, embedding copies (PP), router expert bias
            release_dispatcher_tensors(model)  # else their graphs keep activations into the next step (full recompute)
            sched.step(1)  # update `step + 1` takes the schedule's lr at step + 1
            lr = optim.current_lr(sched)
            cache_bytes = max(cache_bytes, wcache.bytes())  # the FP8 weight copies this step made (0: no cache)
            ok, norm_v, _ = opt.step()  # global grad norm over every rank, clipping, AdamW; parameters gathered
            wcache.new_step()  # (a torch optimizer's step hook did too; megatron's copy to the model came after it)
            if not ok:
                raise FloatingPointError(f"megatron's optimizer skipped the update of step {step + 1} (non-finite "
                                         "gradients)")
            norm_v = float(norm_v)
            step += 1
            consumed += gbs
            loss_step = loss_sum / accum
            if dp_size > 1:
                dist.all_reduce(loss_step, group=dp_group)
                loss_step /= dp_size
            if pp_size > 1:  # from the last stage to the others (rank 0, which logs, is a first stage)
                dist.broadcast(loss_step, src=pp_last, group=pp_group)
            loss_v = float(loss_step.item())
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            m: dict[str, float | None] = {"loss": loss_v, "lr": lr, "grad_norm": norm_v,
                                          "consumed_samples": float(consumed)}
            m.update(meter.after_step(dt))
            m.update(_moe_losses(mcfg, accum, pp_group, device))
            # all-to-all payload bytes of this step on this GPU (recipe dispatcher; none under bf16), the routed
            # rows its tokens sent and its experts received (every recipe: the routing's imbalance) and, on the
            # first step, the bytes one micro-batch's forward keeps for backward (parameters excluded). Under
            # pipeline parallelism both are summed over the pipeline's stages (the whole model, as with PP = 1);
            # the largest stage's saved bytes are logged apart.
            a2a_after = a2a_stats(model)
            a2a = {f"a2a/{k}": float(v - a2a_before.get(k, 0)) for k, v in a2a_after.items()
                   if k.endswith(("_bytes", "_rows"))}
            m.update(_sum_over_stages(a2a, pp_group))
            if step == start_step + 1:
                if pp_size == 1:
                    m["saved_activation_bytes_per_micro_batch"] = float(saved_bytes)
                else:
                    m["saved_activation_bytes_per_micro_batch"] = float(sum(saved_bytes))
                    m["saved_activation_bytes_per_micro_batch_max_stage"] = float(max(saved_bytes))
            result.losses[step], result.lrs[step], result.grad_norms[step] = loss_v, lr, norm_v
            result.step = step
            if not math.isfinite(loss_v):
                raise FloatingPointError(f"loss is {loss_v} at step {step} (lr {lr:.3g}, grad norm {norm_v:.3g})")
            if eval_every and (step % int(eval_every) == 0 or step == total_steps):
                m["eval_loss"] = result.eval_losses[step] = _evaluate(model, valid_ds, cfg, derived, info, pos)
                last_eval = step
            if step % log_every == 0 or "eval_loss" in m or step == total_steps:
                tracker.log(step, m)
            if bar is not None:
                tgs = m.get("tokens_per_gpu_per_s")
                bar.set_postfix(loss=f"{loss_v:.4f}", lr=f"{lr:.2e}",
                                tok_s=f"{derived['tokens_per_step'] / dt:.0f}",
                                tgs="warm-up" if tgs is None else f"{tgs:.0f}", refresh=False)
                bar.update(1)
            folder = profiler.after_step(step)
            if folder is not None and info.is_main:
                tracker.set_tags({"profile_dir": str(folder.resolve()), "profile_steps": f"{profiler.first}-{step}"})
            if after_step is not None:
                after_step(step, m)
            slurm.inject_faults(cfg, step)  # test knobs +fault.* (tests/test_slurm.py); nothing without them
            if ckpt_every and (step % int(ckpt_every) == 0 or step == total_steps):
                save()
                last_saved = step
            sig = stop.poll(device)
            if sig:
                if last_saved != step:
                    save()
                    last_saved = step
                result.stopped_by = sig
                log.warning("stopped by signal %d at step %d; checkpoint %s; %s", sig, step, result.checkpoint,
                            "requeued: the job resumes from it" if stop.will_requeue(sig) else resume_hint)
                break
        if eval_every and not result.stopped_by and last_eval != step and step > start_step:
            result.eval_losses[step] = _evaluate(model, valid_ds, cfg, derived, info, pos)
            tracker.log(step, {"eval_loss": result.eval_losses[step]})
        if start_step and not result.stopped_by and last_saved != step and step > start_step:
            # a resumed run ends with a checkpoint, train.checkpoint_interval or not: the same command then finds
            # it finished, not its stop's checkpoint to train the rest from again into the finished MLflow run
            save()
            last_saved = step
        summary = meter.summary()
        for key in ("summary/peak_mem_allocated_gb", "summary/peak_mem_reserved_gb", "summary/peak_mem_pct"):
            if key in summary and info.world_size > 1:  # the largest over the GPUs
                v = torch.tensor([summary[key]], dtype=torch.float64, device=device)
                dist.all_reduce(v, op=dist.ReduceOp.MAX)
                summary[key] = float(v.item())
        # FP32 main params + AdamW moments on the GPU (the distributed optimizer shards them) and in host memory
        # (offload), and megatron DDP's gradient buffers: the fullest rank's, and (_min) the emptiest's
        held = optim.state_bytes(opt, ddp)
        # (and the FP8 weight copies of train.fp8_weight_cache at their largest, fp4moe.scale.memory predicts them)
        state = torch.tensor([float(held["device"]), float(held["host"]), float(optim.grad_buffer_bytes(ddp)),
                              float(cache_bytes)], dtype=torch.float64, device=device)
        low = state.clone()
        if info.world_size > 1:
            dist.all_reduce(state, op=dist.ReduceOp.MAX)
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
        for i, key in enumerate(("optimizer_state_bytes", "optimizer_state_host_bytes", "grad_buffer_bytes",
                                 "fp8_weight_cache_bytes")):
            summary[f"summary/{key}"] = float(state[i].item())
            summary[f"summary/{key}_min"] = float(low[i].item())
        if result.losses:
            summary["summary/final_loss"] = result.losses[max(result.losses)]
        if result.eval_losses:
            summary["summary/final_eval_loss"] = result.eval_losses[max(result.eval_losses)]
        result.summary = summary
        tracker.log(step, summary)
        if output_dir is not None and info.is_main:
            import json

            out = {"run_id": result.run_id, "step": step, "total_steps": total_steps, "stopped_by": result.stopped_by,
                   "recipe": recipe, "recompute": str(cfg.recompute.name),
                   "checkpoint": str(result.checkpoint) if result.checkpoint else None, **summary}
            Path(output_dir, "summary.json").write_text(json.dumps(out, indent=1))
        status = "KILLED" if result.stopped_by else "FINISHED"
        if result.stopped_by:
            tracker.set_tags({"stopped_by_signal": str(result.stopped_by),
                              **({"requeued": "true"} if stop.will_requeue(result.stopped_by) else {})})
    except Exception as e:
        if is_oom(e):
            tracker.set_tags({"outcome": "OOM", "oom_step": str(step + 1)})
        raise
    finally:
        wcache.disable()
        profiler.close()
        if bar is not None:
            bar.close()
        tracker.finish(status)
    return result


__all__ = ["train", "preflight", "is_oom", "TrainResult", "PARAMS_DTYPES"]
