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

The run's phases, each in its own module: :func:`preflight` (below), where it starts (fp4moe.train.resume), the
build (fp4moe.train.components), the MLflow run (fp4moe.train.run_record, fp4moe.train.metrics.Tracker), the steps
(fp4moe.train.step.Stepper) each followed by the after-step hooks (fp4moe.train.hooks: evaluation, logging,
progress, profiler, the caller's callback, the hooks of ``train.hooks``, checkpoints, stop signals), the end
(fp4moe.train.summary).

Order of the set-up, so that every mistake is reported before anything expensive: ``fp4moe.config.check`` and
the trainer's own limits, the hook factories of ``train.hooks`` (imported and checked; ConfigError), the MLflow store
(``TrackingUnavailable``), megatron-core's transformer config as fp4moe.model builds it (ConfigError for what cannot
be built without TE), then the hook factories are called, then torch.distributed, megatron parallel state, the
checkpoint to resume from (the newest whole one: damaged ones are skipped with a warning; a run whose checkpoint is at
``train.steps`` already stops there and trains nothing, only logging what the MLflow store could not take at its
end), seeds, data, model, the checkpoint's state.
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from fp4moe.launch import slurm
from fp4moe.tracking import mlflow_store
from fp4moe.config import ConfigError, check
from fp4moe.settings import PARAMS_DTYPES, Settings
from fp4moe.train import resume
from fp4moe.train.dist import check_supported, init_distributed, init_model_parallel, teardown, warm_up_communicators
from fp4moe.train.host_env import apply_cluster_env, cluster_env

log = logging.getLogger("fp4moe.train")



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
    recipe: str = ""                     # the recipe's name in results (Recipe.tag); "" when nothing was trained
    is_main: bool = True                 # rank 0 (or the only process): the one that reports the run


# NCCL's own allocations (communicator buffers, the grad-norm all-reduce's scratch) fail with "Failed to CUDA
# calloc / malloc ... bytes" under a generic "unhandled cuda error" (NCCL 2.28's alloc.h)
_OOM_MESSAGES = ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_ALLOC_FAILED", "Failed to CUDA calloc",
                 "Failed to CUDA malloc")


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` means the GPU ran out of memory: torch's ``OutOfMemoryError``, or a library's allocation failure
    that torch reports as a RuntimeError (cuBLAS/cuDNN workspace, a Triton launch, NCCL's DistBackendError)."""
    return type(e).__name__ == "OutOfMemoryError" or (
        isinstance(e, RuntimeError) and any(m in str(e) for m in _OOM_MESSAGES))


def oom_line(e: BaseException) -> str:
    """One line for an out-of-memory ``e``: its first line, and the line that says it failed to allocate where that
    is another (NCCL names the allocation on its last line)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
    said = next((ln for ln in lines if any(m in ln for m in _OOM_MESSAGES)), None)
    return lines[0] if said in (None, lines[0]) else f"{lines[0]} ... {said}"


def preflight(cfg: Any, settings: Settings | None = None) -> dict[str, Any]:
    """Everything that can be refused without torch.distributed: ``fp4moe.config.check`` (every value's type and
    range first: ``settings``, the run's fp4moe.settings.Settings, built here when not given), the trainer's
    limits, the hook factories of ``train.hooks`` (imported and checked against their keywords, not called: fp4moe.train.hooks.configured), the switches
    (``kernels.*`` and their ``FP4MOE_*`` variables, ``FP4MOE_TRACKING_THREAD``), the MLflow store, and megatron-core's
    ``MLATransformerConfig`` as fp4moe.model builds it. Returns ``derived(cfg)``; raises ConfigError / RecipeError /
    TrackingUnavailable."""
    s = settings or Settings.from_config(cfg)
    derived = check(cfg, s)
    check_supported(s.parallel)
    cluster_env(cfg)  # a thread count that is not a positive integer
    dtype = s.train.params_dtype  # one of PARAMS_DTYPES (fp4moe.settings.Train)
    seq, max_pos = s.parallel.seq_length, s.model.max_position_embeddings
    if seq > max_pos:
        raise ConfigError(f"parallel.seq_length={seq} > model.max_position_embeddings={max_pos}: shorten the "
                          "sequence or raise model.max_position_embeddings")
    from fp4moe.train.optim import check_schedule

    check_schedule(s.train)  # the optimizer group and train.adamw were checked by Settings
    from fp4moe.train.checkpoint import format_of

    format_of(cfg)
    from fp4moe.train.profile import profile_window

    profile_window(s.train.profile.steps)  # ConfigError for a bad window
    from fp4moe.train import hooks

    hooks.configured(cfg)  # a hook factory that cannot be imported or called with its keywords
    from fp4moe.ops import kernel_switches
    from fp4moe.train.metrics import tracking_thread

    try:
        # a typo in a kernel switch (kernels.*, or its FP4MOE_* variable) was refused by Settings; DeepGEMM that does
        # not load is refused here, not at the first backward
        kernel_switches(s.kernels)
        tracking_thread()  # nor one in FP4MOE_TRACKING_THREAD
    except ValueError as e:  # SwitchError included
        raise ConfigError(str(e)) from None
    mlflow_store.check_reachable(mlflow_store.config_uri(cfg))  # a file there that is not a store included
    import torch

    from fp4moe.model.megatron_import import import_megatron_core

    import_megatron_core(eager_fusions=not torch.cuda.is_available())  # dynamo is off on CPU anyway (_run)
    from fp4moe.model.gpt_model import transformer_config

    # megatron-core's own config checks and what fp4moe.model cannot build (recompute scopes, dispatcher), now
    transformer_config(cfg.model, cfg.parallel, s.recompute,
                       params_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    return derived


def train(cfg: Any, *, multirun_cell: str | None = None, output_dir: str | Path | None = None,
          after_step: Callable[[int, dict[str, float]], None] | None = None,
          resume_hint: str | None = None) -> TrainResult:
    """Train per the composed config ``cfg`` (conf/train.yaml and its groups).

    ``multirun_cell``: Hydra's ``override_dirname`` of a sweep cell (its own checkpoint folder).
    ``output_dir``: the Hydra job folder: ``summary.json`` goes there (None: not written), and a relative
    ``train.checkpoint_dir`` is resolved in it (``checkpoint.run_dir``).
    ``after_step(step, metrics)``: called on every rank after each step (tests use it to send signals), before
    the hooks of ``train.hooks`` (fp4moe.train.hooks; their factories are called here, before the model is built).
    ``resume_hint``: what a stop by signal says to resume (``python -m fp4moe.train`` gives the exact command);
    None: "to resume, rerun the same command".
    """
    # The signals are caught from the start: one that comes during the set-up (a short Slurm time limit, a
    # preemption) stops the run after its first step, with a checkpoint.
    # where each rank was when a stop signal came: all threads' stacks, in the run's folder
    stacks = None if output_dir is None else Path(output_dir) / f"signal_stacks_rank{slurm.rank()}.txt"
    with slurm.Preemption(stacks_file=stacks) as preempt:
        settings = Settings.from_config(cfg)  # the typed config, once; the groups' raw nodes stay for the model
        derived = preflight(cfg, settings)
        from fp4moe.train import hooks

        extra = [hooks.caller(after_step)] if after_step is not None else []
        extra += hooks.from_config(cfg)  # the factories of train.hooks, before anything is built
        # before the model exists: a run that cannot checkpoint would only find out at its first save
        from fp4moe.train import checkpoint as ckpt

        ckpt.check_writable(ckpt.run_dir(cfg, multirun_cell, output_dir), derived.get("params_total"))
        apply_cluster_env(cfg)
        info = None
        from fp4moe.ops import kernel_switches, use_kernel_switches

        try:
            info = init_distributed(settings.parallel)
            init_model_parallel(settings.parallel, info)
            warm_up_communicators(info)  # before the model fills the GPU: NCCL allocates outside torch's allocator
            # the config's kernel switches (kernels.*) for every op of this run, whatever the environment says later
            with use_kernel_switches(kernel_switches(settings.kernels)):
                result = _run(cfg, settings, derived, info, multirun_cell, output_dir, extra, preempt,
                              resume_hint or "to resume, rerun the same command")
        finally:
            teardown(info)
    if result.stopped_by:  # handlers restored: submitit's own now
        preempt.leave(result.stopped_by)  # the preemption signal in a Slurm job: requeue (raises slurm.Requeued)
    return result


def _run(cfg: Any, settings: Settings, derived: dict[str, Any], info: Any, multirun_cell: str | None, output_dir: Any,
         extra: list[Any], stop: slurm.Preemption, resume_hint: str) -> TrainResult:
    import torch

    from fp4moe.model import cpu_shims

    # megatron-core logs its DDP buckets (every parameter's name) and its whole OptimizerConfig at INFO; the run's
    # config is in MLflow's params, so only its warnings reach the console
    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    # megatron-core's jit_fuser is torch.compile: on CPU it would spend ~20 s in inductor for nothing.
    ctx = torch._dynamo.config.patch(disable=True) if info.device.type == "cpu" else contextlib.nullcontext()
    from fp4moe.train import checkpoint as ckpt

    # fp4moe's patches of megatron-core and torch (no TE; CPU / gloo) are held for the run and undone after it
    with cpu_shims.active(), ctx, resume.claim(ckpt.run_dir(cfg, multirun_cell, output_dir), info) as claim:
        return _loop(cfg, settings, derived, info, multirun_cell, output_dir, extra, stop, resume_hint, claim)


def _loop(cfg: Any, settings: Settings, derived: dict[str, Any], info: Any, multirun_cell: str | None, output_dir: Any,
          extra: list[Any], stop: slurm.Preemption, resume_hint: str, claim: Any) -> TrainResult:
    """The run's phases: where it starts (a finished run stops here), build, resume, the MLflow run, the steps
    with their after-step hooks (``extra``: the caller's and those of ``train.hooks``, after the profiler's and
    before the periodic checkpoint), the end (a last evaluation and checkpoint, the summary)."""
    from fp4moe.ops.weight_cache import CACHE as wcache
    from fp4moe.train import checkpoint as ckpt
    from fp4moe.train import components, hooks, optim
    from fp4moe.train.metrics import PENDING_FILE, Tracker, replay_if_pending
    from fp4moe.train.run_record import describe
    from fp4moe.train.step import Stepper
    from fp4moe.train.summary import summarize, write_summary_json

    t = settings.train
    total_steps = int(derived["steps"])
    # ---- where it starts (before data and model): which checkpoint; a finished run stops here
    root = ckpt.run_dir(cfg, multirun_cell, output_dir)
    fp, fp_settings = ckpt.fingerprint(cfg), ckpt.fingerprinted(cfg)
    found = resume.candidates(root, info, resume=t.resume)
    if found:
        folder, meta = found[0]
        ckpt.check_compatible(folder, meta, world_size=info.world_size, fingerprint_=fp, settings=fp_settings)
        if int(meta["step"]) >= total_steps:
            if info.is_main:
                log.info("already finished at step %d/%d (checkpoint %s); nothing to train", int(meta["step"]),
                         total_steps, folder)
                # what the store could not take at the end of the run: log it now
                replay_if_pending(root / PENDING_FILE, mlflow_store.config_uri(cfg))
            return TrainResult(run_id=meta.get("mlflow_run_id"), start_step=int(meta["step"]),
                               step=int(meta["step"]), total_steps=total_steps, checkpoint=folder,
                               already_finished=True, is_main=info.is_main)
    # ---- build, then resume: the newest checkpoint whose files every rank can read
    parts = components.build(cfg, derived, info, output_dir, settings)
    start = resume.load_newest(root, found, info, parts, fp, fp_settings)

    # ---- MLflow (rank 0): a store that fails mid-run does not stop the training, what it could not take waits in
    # the checkpoint folder
    tracker = Tracker(mlflow_store.config_uri(cfg), str(OmegaConf.select(cfg, "tracking.experiment") or "train"),
                      enabled=info.is_main, pending=root / PENDING_FILE)
    record = describe(cfg, derived, info, settings, parts.dinfo, root)
    tracker.start(record.name, record.params, record.tags, resume_run_id=start.run_id,
                  earlier_run=claim.earlier_run(record.store))
    if tracker.run_id is not None:  # rank 0: the folder's record names the MLflow run it trains now
        claim.record(tracker.run_id, record.store)
    result = TrainResult(run_id=tracker.run_id, start_step=start.step, step=start.step, total_steps=total_steps,
                         recipe=record.recipe, is_main=info.is_main)
    # every rank learns the run id (it goes into every checkpoint's meta via rank 0 only)
    (result.run_id,) = resume.from_rank0([tracker.run_id], info)

    stepper = Stepper(cfg, derived, parts, info.device)
    step, consumed = start.step, start.consumed
    ckpt_format = ckpt.format_of(cfg)
    keep = t.keep_checkpoints

    def save() -> Path:
        tracker.flush()  # every logged step up to the checkpoint's is in the store (or the pending file) before
        #                  the checkpoint exists
        optim.gather_updated_params(parts.ddp)  # overlap_param_gather: the step's update is in every shard
        return ckpt.save(root, step=step, consumed_samples=consumed, rank=info.rank, world_size=info.world_size,
                         model=parts.model, optimizer=parts.opt, schedule=parts.sched, mlflow_run_id=result.run_id,
                         fingerprint_=fp, keep=keep, meter=parts.meter, format_=ckpt_format, settings=fp_settings)

    state = hooks.LoopState(step=step, total_steps=total_steps, save=save, eval_losses=result.eval_losses)
    bar = None
    if info.is_main and t.progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=step, desc=f"train {record.recipe}", unit="step", dynamic_ncols=True)
    eval_every = t.eval_interval
    after = [hooks.evaluation(eval_every, stepper.evaluate), hooks.mlflow_log(tracker, t.log_interval or 1)]
    after += [hooks.progress_bar(bar, int(derived["tokens_per_step"]))] if bar is not None else []
    after += [hooks.profiler_window(parts.profiler, tracker, info.is_main)]
    after += extra
    after += [hooks.periodic_checkpoint(t.checkpoint_interval),
              hooks.stop_signals(stop, info.device, resume_hint)]
    status = "FAILED"
    # FP8 copies of the weights once per optimizer step (fp4moe/ops/weight_cache.py), registered after the DDP wrap
    # (megatron's buffers hold the parameters now); dropped after each optimizer step
    if t.fp8_weight_cache:
        wcache.enable(stepper.params)
    try:
        parts.model.train()
        while step < total_steps:
            out = stepper.run(step, consumed, first_of_process=step == start.step)
            step, consumed = out.step, out.consumed
            result.losses[step], result.lrs[step], result.grad_norms[step] = out.loss, out.lr, out.grad_norm
            result.step = state.step = step
            if not math.isfinite(out.loss):
                raise FloatingPointError(f"loss is {out.loss} at step {step} (lr {out.lr:.3g}, grad norm "
                                         f"{out.grad_norm:.3g})")
            state.metrics, state.seconds = out.metrics, out.seconds
            for hook in after:
                hook(state)
            if state.stopped_by:
                break
        result.stopped_by = state.stopped_by
        # ---- the end: a last evaluation, and a resumed run's last checkpoint
        if eval_every and not result.stopped_by and state.last_eval != step and step > start.step:
            result.eval_losses[step] = stepper.evaluate()
            tracker.log(step, {"eval_loss": result.eval_losses[step]})
        if start.step and not result.stopped_by and step > start.step:
            # a resumed run ends with a checkpoint, train.checkpoint_interval or not: the same command then finds
            # it finished, not its stop's checkpoint to train the rest from again into the finished MLflow run
            state.checkpoint_now()
        result.checkpoint = state.checkpoint
        result.summary = summary = summarize(parts.meter, parts.opt, parts.ddp, stepper.cache_bytes, result.losses,
                                             result.eval_losses, info)
        tracker.log(step, summary)
        if output_dir is not None and info.is_main:
            write_summary_json(output_dir, {
                "run_id": result.run_id, "step": step, "total_steps": total_steps, "stopped_by": result.stopped_by,
                "recipe": record.recipe, "recompute": settings.recompute.name,
                "checkpoint": str(result.checkpoint) if result.checkpoint else None, **summary})
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
        parts.profiler.close()
        if bar is not None:
            bar.close()
        tracker.finish(status)
    return result


__all__ = ["train", "preflight", "is_oom", "oom_line", "TrainResult", "PARAMS_DTYPES"]
