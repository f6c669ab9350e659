#!/bin/bash
# sbatch, after creating the folder the templates' logs go to (logs/slurm/ under the current directory). Slurm opens
# a job's --output/--error files before its script runs: when their folder is missing the job fails at once
# (FAILED, exit 0:53) and leaves no log at all, so the folder must exist when the job starts; no line of the
# script can create it. Run it from the directory you submit from (the repository root: the templates cd to
# $FP4MOE_ROOT, default the submit directory); arguments as sbatch's:
#
#   slurm/submit.sh slurm/train.sbatch experiment=paper_t1 precision=mxfp4 recompute=mla_up_proj
#   slurm/submit.sh --nodes=4 --time=24:00:00 slurm/train.sbatch experiment=paper_f5 precision=fp8
#
# With your own --output/--error (or --chdir), create their folder yourself.
set -euo pipefail
mkdir -p logs/slurm
exec sbatch "$@"
