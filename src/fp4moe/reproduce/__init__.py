"""``make reproduce-table``: run what exists of the reproduction on this machine.

- :mod:`fp4moe.reproduce.pipeline`: ``python -m fp4moe.reproduce``, the steps in order (hardware, kernel
  self-check, benchmarks, trainer runs, report)
- :mod:`fp4moe.reproduce.train_runs`: ``python -m fp4moe.reproduce.train_runs``, the scaled-down trainer
  experiments this machine (or a Slurm profile) can run, each cell once
"""
