"""``python -m fp4moe.train [overrides...]``: train per conf/train.yaml (Hydra app; see conf/README.md).

    python -m fp4moe.train                                        # tiny model on CPU (the root config's defaults)
    python -m fp4moe.train train=short_cpu train.params_dtype=fp32
    torchrun --nproc-per-node 2 -m fp4moe.train parallel=two_gpu_ep2 cluster=workstation_2gpu
    python -m fp4moe.train experiment=paper_t1 hydra/launcher=slurm_h100    # Slurm via submitit (P4)
    python -m fp4moe.train experiment=paper_f4 hydra/launcher=slurm_h100    # a benchmark (F3/F4): fp4moe.launch.bench_job

A finished run ends with one line, ``done: step S/T, loss L, ..., N tokens/GPU/s (median), peak memory M GiB; log
DIR; checkpoints DIR; MLflow URI run ID`` (fp4moe.runs.outcome.done_line); a multirun with the table of its cells
(fp4moe.runs.outcome.MultirunSummary). Known-harmless megatron-core/MLflow warnings are not shown
(fp4moe.known_warnings).

Each run has its own folder, ``logs/<task_name>/runs/<model>-<precision>-<recompute>-<hash of the config>``
(fp4moe.runs.folder; the hash leaves out keys that do not change the run, such as ``train.progress_bar``), where
its checkpoints go (a relative ``train.checkpoint_dir``, the default): the same command continues a stopped run, and
on a finished one says so and exits 0 without training. ``hydra.run.dir=...`` picks another folder.

Exit status: 0 finished (or already finished: nothing trained); 2 the config, a switch (``kernels.*`` or its
``FP4MOE_*`` variable, ``FP4MOE_TRACKING_THREAD``), the data or the MLflow store cannot be used, or
``train.resume=false`` where the run's checkpoints exist (one message, no traceback, before training starts), or a
Slurm launcher cannot submit (sbatch refuses the job, saying why, or Slurm's commands are not on PATH), or a
checkpoint cannot be written mid-run (a full disk: one message naming the folder and the newest complete checkpoint,
which stays); 3 out
of GPU memory (recorded in MLflow as ``outcome=OOM``; in a multirun the sweep goes on); 128 + N stopped by signal N
(SIGTERM, SIGUSR1, SIGINT: Ctrl-C; a second Ctrl-C aborts without it) after writing a checkpoint; the stop message
prints the command that resumes (the same command; in a multirun with checkpoints in its timestamped sweep folder,
plus ``hydra.sweep.dir=...``). In a Slurm job, SIGUSR2 (the time-limit / preemption signal of the launcher
profiles) writes a checkpoint and requeues the job, which resumes from it into the same MLflow run (fp4moe.launch.slurm).
"""
from __future__ import annotations

import faulthandler
import logging
import os
import re
import shlex
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue

from fp4moe import known_warnings
from fp4moe.config import ConfigError
from fp4moe.data.errors import DataError
from fp4moe.paths import conf_dir
from fp4moe.recipe import RecipeError
from fp4moe.settings import Settings, explain, schema_picked
from fp4moe.tracking.mlflow_store import TrackingUnavailable

CONF_DIR = conf_dir()   # fp4moe.paths: $FP4MOE_CONF_DIR, else the checkout's conf/
EXIT_CONFIG, EXIT_OOM = 2, 3
_TASKS_STARTED = 0  # tasks this process has started: an OSError before the first is Hydra's setup (main's wrapper)
log = logging.getLogger("fp4moe.train")
known_warnings.install()  # before megatron-core is imported (most of its known warnings come at import) and MLflow


def _hydra_context() -> tuple[str | None, str | None, bool, str | None]:
    """(multirun cell name, output folder, is multirun, the override that brings the same command back to the output
    folder: None where it comes back by itself) of the current Hydra job."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None, None, False, None
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    from fp4moe.resolvers import dirname

    cell = dirname(hc.job.override_dirname or f"job{hc.job.num}") if multirun else None
    out = hc.runtime.output_dir
    return cell, out, multirun, _refind(hc, multirun, out)


# resolvers whose value is the same on every call with the same config (fp4moe.runs.folder); any other one in the
# folder's setting (Hydra's ${now:...}, ${oc.env:...}) may give another folder next time
_STABLE_RESOLVERS = {"fp4moe.run_name"}


def _refind(hc, multirun: bool, out: str) -> str | None:
    """``hydra.run.dir=<out>`` (a multirun: ``hydra.sweep.dir=<its sweep folder>``) when the folder's setting uses a
    resolver that may change between calls (the multiruns' timestamp); None when the same command finds ``out``
    again (the run folder of fp4moe.runs.folder, or a fixed ``hydra.run.dir=...``)."""
    from omegaconf import OmegaConf

    raw = str(OmegaConf.to_container(hc.sweep if multirun else hc.run, resolve=False)["dir"])
    if not set(re.findall(r"\$\{\s*([\w.]+)\s*:", raw)) - _STABLE_RESOLVERS:
        return None
    folder = Path(out)
    if multirun:  # <sweep dir>/<subdir>
        folder = folder.parents[len(Path(str(hc.sweep.subdir)).parts) - 1]
    text = str(folder)
    if not re.fullmatch(r"[\w./+-]+", text):  # a Hydra override value with spaces, commas, quotes: quoted
        text = "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return f"hydra.{'sweep' if multirun else 'run'}.dir={text}"


def _resume_hint(cfg: DictConfig, out: str | None, refind: str | None) -> str:
    """What a stop says to resume: the exact command where this is a plain ``python`` process (under torchrun or in
    a Slurm job: 'rerun the same command'), with ``refind`` added when the checkpoints are in the job's folder."""
    # the checkpoints are in the job's folder when train.checkpoint_dir is relative (fp4moe.train.checkpoint.run_dir)
    relative = not Path(str(cfg.train.checkpoint_dir)).expanduser().is_absolute()
    extra = refind if refind and out and relative else None
    if any(k in os.environ for k in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")):
        return "to resume, rerun the same command" + (f" with {shlex.quote(extra)}" if extra else "")
    prog = sys.argv[0]
    script = ["-m", "fp4moe.train"] if Path(prog).resolve() == Path(__file__).resolve() else [prog]
    args = [a for a in sys.argv[1:] if not (extra and a.startswith(extra.split("=")[0] + "="))]
    interpreter = (getattr(sys, "orig_argv", None) or [sys.executable])[0]
    return "to resume: " + shlex.join([interpreter, *script, *args, *([extra] if extra else [])])


def one_line_config_errors() -> None:
    """Make a config Hydra cannot compose (a value of the wrong type, a key no schema of fp4moe.settings has), or a
    value of Hydra's own config that cannot be resolved (a Slurm launcher profile over a cluster group without Slurm
    values), end the process like every other bad input: one line naming the key and the fix, exit 2, no traceback,
    no MLflow run (fp4moe.settings.explain; a missing config file keeps Hydra's list of the options, on the same
    line).

    Hydra (1.3.8, pinned) prints a composition error as two or three lines and exits 1 inside
    ``hydra._internal.utils.run_and_report``, before the task function runs, so this wraps that function; any other
    error keeps Hydra's own report."""
    from hydra._internal import utils as hydra_utils
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    report = hydra_utils.run_and_report
    if getattr(report, "fp4moe_one_line", False):
        return

    def run_and_report(func):
        def composed():
            try:
                return func()
            except (ConfigCompositionException, OmegaConfBaseException) as e:
                # an OmegaConf error here is Hydra's own config (the launcher's values, read after composing), a
                # value that has none (`???`, read by the run folder's name before any task; the task says its own,
                # see task), or a bug of the task's: only the last keeps its traceback
                missing = isinstance(e, (MissingMandatoryValue, InterpolationToMissingValueError))
                if isinstance(e, OmegaConfBaseException) and not missing and not str(
                        getattr(e, "full_key", "") or "").startswith("hydra."):
                    raise
                print(f"fp4moe.train: ConfigError: {explain(e)}", file=sys.stderr)
                sys.exit(EXIT_CONFIG)
            except Exception as e:  # noqa: BLE001 - a refused submission or Hydra's folder: one line; else raise
                why = submission_refused(e)
                if why is None and isinstance(e, OSError) and e.filename is not None and not _TASKS_STARTED:
                    # before any task started, an OSError naming a file is Hydra's own: the run (sweep) folder or
                    # the files it writes there (a path under a file, a folder this process cannot write)
                    why = (f"cannot create the run's folder: {e.strerror}: {e.filename}; hydra.run.dir "
                           "(hydra.sweep.dir in a multirun) must be a folder this process can create or write")
                if why is None:
                    raise
                print(f"fp4moe.train: {why}", file=sys.stderr)
                sys.exit(EXIT_CONFIG)
        return report(composed)

    run_and_report.fp4moe_one_line = True
    hydra_utils.run_and_report = run_and_report


def submission_refused(e: BaseException) -> str | None:
    """The one line for a Slurm launcher whose ``sbatch`` could not submit the multirun's jobs (Slurm's commands not
    on PATH, or sbatch refusing the script: a partition, GPU (gres) or account this cluster does not have, or Slurm's
    own trouble, which sbatch's message names), with the fix; None for anything else. A job that was submitted and
    then failed (submitit's FailedJobError from the job's result) is not this: it keeps the job's traceback."""
    import subprocess

    cause = e.__cause__
    fix = ("where it names a resource (partition, account, qos, GPUs: gres), the cluster profile sets it "
           "(cluster=<profile>, conf/cluster/; FP4MOE_SLURM_* where it reads them), and `python -m fp4moe.launch "
           "dry-run --scripts <the same overrides>` prints the sbatch script without submitting")
    if (type(e).__name__ == "FailedJobError" and isinstance(cause, subprocess.CalledProcessError)
            and Path(str(cause.cmd).split()[0] if isinstance(cause.cmd, str) else str(cause.cmd[0])).name == "sbatch"):
        return f"Slurm refused the job: {' '.join(str(e).split())}; {fix}"
    # submitit (1.5.4, pinned) looks for srun before it submits; sbatch missing alone is Popen's FileNotFoundError
    if (isinstance(e, RuntimeError) and 'Could not detect "srun"' in str(e)) or (
            isinstance(e, FileNotFoundError) and Path(str(e.filename or "")).name == "sbatch"):
        return ("Slurm's commands (srun, sbatch) are not on PATH, so a Slurm launcher (hydra/launcher=slurm_*) "
                "cannot submit from this machine: run on a Slurm login node, or pick hydra/launcher=local")
    return None


def main(*args, **kwargs):
    """``python -m fp4moe.train [overrides]``: Hydra's app (:func:`task`), its composition errors in one line."""
    why = schema_picked([a for a in sys.argv[1:] if not a.startswith("-")], CONF_DIR)
    if why is not None:  # Hydra would compose it, and the first value the schema leaves unset would say less
        print(f"fp4moe.train: ConfigError: {why}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    one_line_config_errors()
    return task(*args, **kwargs)


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def task(cfg: DictConfig) -> dict | None:
    """Train; returns a short result (in a multirun it reaches the launcher, e.g. through submitit)."""
    try:
        return _task(cfg)
    except (MissingMandatoryValue, InterpolationToMissingValueError) as e:
        # a value left `???` that is read before the typed config is built (the resume hint reads
        # train.checkpoint_dir, the cluster's environment its group): one line as the typed config says it
        print(f"fp4moe.train: ConfigError: {explain(e)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def _task(cfg: DictConfig) -> dict | None:
    global _TASKS_STARTED
    _TASKS_STARTED += 1
    # A crash inside a C extension (segmentation fault, abort) otherwise ends the process with no word in its log and
    # its MLflow run left RUNNING: print every thread's Python stack to stderr first.
    if not faulthandler.is_enabled():
        faulthandler.enable()
    cell, out, multirun, refind = _hydra_context()
    from fp4moe.launch import bench_job
    from fp4moe.train.host_env import apply_cluster_env

    try:
        apply_cluster_env(cfg)  # before torch loads: OpenMP, inductor and the allocator read it once
    except ConfigError as e:
        print(f"fp4moe.train: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    if bench_job.is_bench(cfg):  # F3/F4: a benchmark, not training (fp4moe/launch/bench_job.py)
        try:
            return bench_job.run(cfg.bench, Settings.from_config(cfg).parallel)  # the typed config, once
        except ConfigError as e:
            print(f"fp4moe.train: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(EXIT_CONFIG)
    from fp4moe.train.loop import is_oom, oom_line, train

    try:
        result = train(cfg, multirun_cell=cell, output_dir=out, resume_hint=_resume_hint(cfg, out, refind))
    except (ConfigError, RecipeError, TrackingUnavailable, DataError) as e:
        print(f"fp4moe.train: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    except Exception as e:  # noqa: BLE001 - only out-of-memory is a result (an OOM cell of a table); the rest raises
        if not is_oom(e):
            raise
        print(f"fp4moe.train: out of GPU memory (recorded in MLflow as outcome=OOM): {oom_line(e)}", file=sys.stderr)
        if not multirun:
            sys.exit(EXIT_OOM)
        return {"outcome": "OOM"}
    if result.stopped_by:
        sys.exit(128 + result.stopped_by)
    if result.already_finished:  # said so in the log; no figures of this call to report
        return {"outcome": "already finished", "run_id": result.run_id, "step": result.step,
                "total_steps": result.total_steps, "checkpoint": str(result.checkpoint)}
    s = result.summary
    from fp4moe.runs.outcome import done_line
    from fp4moe.tracking.mlflow_store import config_uri, without_credentials

    done = {"outcome": "done", "run_id": result.run_id, "start_step": result.start_step, "step": result.step,
            "total_steps": result.total_steps, "recipe": result.recipe,
            "checkpoint": str(result.checkpoint) if result.checkpoint else None,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "final_loss": s.get("summary/final_loss"),
            "final_eval_loss": s.get("summary/final_eval_loss"), "tokens_per_gpu_s": s.get("summary/tgs_median"),
            "peak_mem_gib": s.get("summary/peak_mem_allocated_gb"), "output_dir": out,
            "tracking_uri": without_credentials(config_uri(cfg))}
    if result.is_main:  # one line for the run, not one per process (a Slurm job's tasks share one output file)
        log.info("%s", done_line(done))
    return done


if __name__ == "__main__":
    # a job's process: a time-limit or stop signal during the start-up (torch, megatron-core, the rendezvous) is kept
    # for the run instead of killing it (fp4moe.launch.slurm.catch_early)
    from fp4moe.launch import slurm

    slurm.catch_early()
    main()
