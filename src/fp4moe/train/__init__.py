"""The trainer (P3, issue 4): ``python -m fp4moe.train`` (a Hydra app over conf/train.yaml).

- :mod:`fp4moe.train.loop`: :func:`~fp4moe.train.loop.train`, the run's phases (checks, set-up, where it starts,
  build, resume, the MLflow run, the steps and their hooks, the end)
- :mod:`fp4moe.train.components`: seeds, data, model, DDP, optimizer, scheduler, meter, profiler (the build)
- :mod:`fp4moe.train.resume`: the claim on the checkpoint folder, the checkpoint to start from, loading it
- :mod:`fp4moe.train.attempt`: who trains a checkpoint folder now, and what became of the attempt before
- :mod:`fp4moe.train.run_record`: the MLflow run's name, params and tags
- :mod:`fp4moe.train.step`: one optimizer step through megatron's schedule, and the evaluation
- :mod:`fp4moe.train.hooks`: after each step: evaluation, MLflow, progress, profiler, checkpoints, stop signals
- :mod:`fp4moe.train.summary`: the ``summary/*`` metrics at the end
- :mod:`fp4moe.train.dist`: torch.distributed (single process, torchrun, Slurm) and megatron parallel state
- :mod:`fp4moe.train.batches`: the one door to ``fp4moe.data.build_token_datasets`` and the resumable sampler
- :mod:`fp4moe.train.optim`: megatron-core's DDP, optimizer and LR scheduler from the ``optimizer`` group,
  ``train.adamw`` and ``train.schedule``
- :mod:`fp4moe.train.checkpoint`: atomic per-rank checkpoints, resume checks
- :mod:`fp4moe.launch.slurm` (outside this package): checkpoint-and-stop on SIGTERM / SIGUSR1, checkpoint-and-requeue on
  Slurm's SIGUSR2, the failed-job callback
- :mod:`fp4moe.train.metrics`: MLflow run (params, tags, per-step metrics, summary), tokens/GPU/s, peak memory
- :mod:`fp4moe.train.profile`: the optional ``torch.profiler`` window over some steps (``train.profile``)
- :mod:`fp4moe.train.host_env`: the process's environment from ``cluster.env``, applied before torch starts

Importing this package imports neither torch nor megatron-core.
"""
