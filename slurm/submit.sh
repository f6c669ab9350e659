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
#
# Before anything is queued (a 32-node job may wait hours, then fail at once), with the templates' default trainer
# (TRAIN unset): the Python the job will run ($PYTHON, default <FP4MOE_ROOT, else this folder>/.venv/bin/python, as
# the templates) must exist, and the cell's overrides (the arguments after the template) must compose into a config
# the trainer accepts (`python -m fp4moe.launch dry-run`, which also prints each cell's predicted memory). Either
# failing is one message and exit 2, nothing submitted.
set -euo pipefail
args=("$@")
overrides=()
for i in "${!args[@]}"; do   # the template is the first argument that is a file; the cell's overrides follow it
  if [ -f "${args[$i]}" ]; then overrides=("${args[@]:$((i + 1))}"); break; fi
done
if [ -z "${TRAIN:-}" ]; then
  PYTHON=${PYTHON:-${FP4MOE_ROOT:-$PWD}/.venv/bin/python}
  if [ ! -x "$PYTHON" ]; then
    echo "slurm/submit.sh: no Python at $PYTHON, which the job would run: create the venv there (make venv, on the" \
         "filesystem the nodes share) or export PYTHON=...; nothing submitted" >&2
    exit 2
  fi
  if ! checked=$("$PYTHON" -m fp4moe.launch dry-run --summary "${overrides[@]}" 2>&1); then
    printf '%s\n' "$checked" | tail -n 3 >&2
    echo "slurm/submit.sh: the overrides ${overrides[*]} are not a config the trainer can run (above); nothing" \
         "submitted" >&2
    exit 2
  fi
fi
mkdir -p logs/slurm
exec sbatch "$@"
