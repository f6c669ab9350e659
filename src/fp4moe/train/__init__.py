"""The trainer (P3, issue 4): ``python -m fp4moe.train`` (a Hydra app over conf/train.yaml).

- :mod:`fp4moe.train.loop`: :func:`~fp4moe.train.loop.train`, the run (checks, set-up, steps, eval, checkpoints)
- :mod:`fp4moe.train.dist`: torch.distributed (single process, torchrun, Slurm) and megatron parallel state
- :mod:`fp4moe.train.data`: the one door to ``fp4moe.data.build_token_datasets`` and the resumable sampler
- :mod:`fp4moe.train.optim`: megatron-core's DDP, optimizer and LR scheduler from the ``optimizer`` group,
  ``train.adamw`` and ``train.schedule``
- :mod:`fp4moe.train.checkpoint`: atomic per-rank checkpoints, resume checks
- :mod:`fp4moe.slurm` (outside this package): checkpoint-and-stop on SIGTERM / SIGUSR1, checkpoint-and-requeue on
  Slurm's SIGUSR2, the failed-job callback
- :mod:`fp4moe.train.metrics`: MLflow run (params, tags, per-step metrics, summary), tokens/GPU/s, peak memory

Importing this package imports neither torch nor megatron-core.
"""
