"""What a training run is built from, in the order the trainer builds it: seeds, data, the megatron-core model,
megatron's DDP, optimizer and LR scheduler, the step meter and the profiler (:func:`build`).

Nothing here reads a checkpoint or talks to MLflow (fp4moe.train.resume, fp4moe.train.run_record). The order of
the RNG draws is part of the result: the same seed gives the same data order and, with
``train.layout_invariant_init``, the same initial weights under any EP / PP layout.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from fp4moe.config import ConfigError
from fp4moe.train import batches
from fp4moe.train.dist import barrier


@dataclass
class Components:
    """The built run: ``model`` (megatron-core GPTModel, this rank's stages and experts), ``ddp`` (megatron's
    DistributedDataParallel around it), ``opt`` / ``sched`` (megatron's optimizer and OptimizerParamScheduler),
    ``setting`` (fp4moe.settings.OptimizerSetting, = ``settings.optimizer``), ``mcfg`` (the model's TransformerConfig), the token datasets and
    their ``dinfo`` (tokenizer, token counts, dataset prefix), the ``meter`` (tokens/GPU/s, peak memory) and the
    ``profiler`` (train.profile); ``settings``: the run's typed config (fp4moe.settings.Settings)."""
    model: Any
    ddp: Any
    opt: Any
    sched: Any
    setting: Any
    mcfg: Any
    train_ds: Any
    valid_ds: Any
    dinfo: dict[str, Any]
    meter: Any
    profiler: Any
    settings: Any = None


def seed_everything(seed: int) -> None:
    """python, numpy, torch (CPU and CUDA) and megatron-core's model-parallel RNG tracker (TP/EP streams)."""
    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build_data(settings: Any, info: Any):
    """The train and valid token datasets of ``settings`` (the run's fp4moe.settings.Settings) and their info. Rank
    0 builds first (tokenizer, indexed dataset, caches), the others then read what it wrote. ConfigError for a
    tokenizer larger than the model's vocabulary, an empty split, or samples of the wrong length."""
    if info.rank == 0:
        out = batches.build_token_datasets(settings)
    barrier()
    if info.rank != 0:
        out = batches.build_token_datasets(settings)
    train_ds, valid_ds, dinfo = out
    seq, vocab = settings.parallel.seq_length, settings.model.vocab_size
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


def build(cfg: Any, derived: dict[str, Any], info: Any, output_dir: Any, settings: Any = None) -> Components:
    """``settings``: the run's fp4moe.settings.Settings (built from ``cfg`` when None). Seeds, data, model (``train.params_dtype``, layout-invariant initial weights), DDP, optimizer, scheduler,
    meter and profiler for this rank. On CUDA first frees what an earlier run of this process left cached (a local
    multirun runs its cells in one process), so that each run's peak memory is its own."""
    import torch

    from fp4moe.settings import Settings
    from fp4moe.model.gpt_model import build_gpt_model, to_bf16_params
    from fp4moe.train import optim
    from fp4moe.train.metrics import Meter
    from fp4moe.train.profile import StepProfiler

    settings = settings or Settings.from_config(cfg)
    t = settings.train
    device = info.device
    if device.type == "cuda":
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    seed_everything(t.seed)
    train_ds, valid_ds, dinfo = build_data(settings, info)

    profiler = StepProfiler(cfg, output_dir, device, info.rank)
    profiler.start_memory_history()  # train.profile.memory: every allocation from here on gets its site
    dtype = torch.bfloat16 if t.params_dtype == "bf16" else torch.float32
    model = build_gpt_model(cfg, params_dtype=dtype, settings=settings).to(device)
    if t.layout_invariant_init:  # megatron's draws depend on the EP/PP layout (fp4moe.model.init)
        from fp4moe.model.init import reinit_layout_invariant

        reinit_layout_invariant(model, t.seed)
        seed_everything(t.seed)  # and the RNG state after the build is the same for every layout too
    if dtype == torch.bfloat16:
        to_bf16_params(model)  # as megatron-core's Float16Module, router expert-bias state kept fp32
    mcfg = model.config
    setting = settings.optimizer
    ddp = optim.wrap_model(model, setting)  # megatron-core's DDP: gradient buffers (and parameter buffers)
    if t.wgrad_accumulation_fusion:  # weight gradients added into DDP's main_grad where they are made
        optim.fuse_wgrads(model)
    opt = optim.build_optimizer(ddp, setting, t.adamw)
    sched = optim.build_scheduler(opt, t, derived)
    if setting.overlap_grad_reduce:  # as megatron-lm: only the last micro-batch's backward starts the reduction
        mcfg.no_sync_func = ddp.no_sync

    meter = Meter(int(derived["tokens_per_step"]), info.world_size, t.measure.warmup_steps, t.measure.steps, device)
    return Components(model=model, ddp=ddp, opt=opt, sched=sched, setting=setting, mcfg=mcfg, train_ds=train_ds,
                      valid_ds=valid_ds, dinfo=dinfo, meter=meter, profiler=profiler, settings=settings)


__all__ = ["Components", "build", "build_data", "seed_everything"]
