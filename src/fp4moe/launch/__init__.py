"""Jobs on Slurm: what would be submitted, safe sbatch lines, and the running job's side of Slurm.

- :mod:`fp4moe.launch.dry_run`: ``python -m fp4moe.launch dry-run experiment=...``, each sweep cell checked, with
  the sbatch script submitit would submit and its predicted peak memory (nothing submitted)
- :mod:`fp4moe.launch.shell`: config values that reach an sbatch script line, shell-quoted or refused
- :mod:`fp4moe.launch.slurm`: the trainer's stop signals (checkpoint and stop, or requeue) and the Hydra callback
  that makes a failed task end FAILED in Slurm
- :mod:`fp4moe.launch.bench_job`: the F3/F4 benchmark experiments as jobs of ``python -m fp4moe.train``
"""
