"""Slurm jobs that outlive their time limit, and Slurm's view of a failed Hydra job (P4, issue 5).

A Slurm launcher profile (conf/hydra/launcher/) asks for ``--signal=USR2@<cluster.signal_delay_s>``: before the time
limit (or on preemption) every task gets SIGUSR2. submitit's handler would requeue at once; a training loop must
first finish its step and write a checkpoint. So the trainer's loop does, in this order (tests/slurm_app/app.py is
the working example)::

    from fp4moe import slurm

    ckpts = slurm.Checkpoints(slurm.checkpoint_dir(cfg.train.checkpoint_dir))   # per cell, stable across requeues
    last = ckpts.latest()                                  # None, or (step, path) of the newest complete one
    state, start = (load(last.path), last.step) if last else (fresh(), 0)
    with slurm.mlflow_run(ckpts, experiment, run_name) as run, slurm.Preemption() as preempt:
        for step in range(start, steps):
            ...                                            # one step; mlflow.log_metric(..., step=step)
            slurm.inject_faults(cfg, step)                 # test knobs `+fault.*`; no-op without them
            stop = preempt.requested()                     # the signal, agreed by all ranks
            if stop or (step + 1) % interval == 0:
                ckpts.save(step + 1, lambda path: save(state, path))
            if stop:
                preempt.requeue()                          # submitit re-pickles the job, scontrol requeue, exit

With several ranks: every rank polls ``requested()`` and calls ``save(..., rank=, barrier=)`` and ``requeue()``; only
rank 0 opens ``mlflow_run`` (the others use ``contextlib.nullcontext()``).

The requeued job runs the same Hydra job again (same overrides, same output directory), finds the checkpoint and
the MLflow run id in the same folder, and continues that run. ``SlurmCallback`` (``hydra.callbacks`` in conf/train.yaml)
creates the MLflow schema once before a sweep's jobs start, and makes a job whose task raised end FAILED in Slurm:
Hydra catches the exception, so without it Slurm and ``sacct`` would say COMPLETED.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple

from fp4moe import tracking

RUN_ID_FILE = "mlflow_run_id"
_STEP_DIR = re.compile(r"^step_(\d{9})$")


def preempt_signal() -> signal.Signals:
    """The signal submitit and our profiles use: ``SIG$SUBMITIT_PREEMPT_SIGNAL``, default SIGUSR2."""
    return signal.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")]


def job_tags() -> dict[str, str]:
    """The Slurm job's identity as MLflow tags (empty outside Slurm). The job id survives requeues."""
    keys = {"slurm_job_id": "SLURM_JOB_ID", "slurm_array_job_id": "SLURM_ARRAY_JOB_ID",
            "slurm_array_task_id": "SLURM_ARRAY_TASK_ID", "slurm_restart_count": "SLURM_RESTART_COUNT",
            "slurm_cluster": "SLURM_CLUSTER_NAME", "slurm_nodelist": "SLURM_JOB_NODELIST"}
    tags = {tag: os.environ[var] for tag, var in keys.items() if var in os.environ}
    if "slurm_job_id" in tags:
        tags.setdefault("slurm_restart_count", "0")
    return tags


def _rank() -> int:
    return int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")))


# ---------------------------------------------------------------------------------------------- checkpoints

def checkpoint_dir(path: str | os.PathLike) -> Path:
    """``path`` made absolute: a relative one lives in this Hydra job's output directory (one per sweep cell, the
    same after a requeue), or in the working directory outside Hydra."""
    path = Path(path).expanduser()
    if path.is_absolute():
        return path
    base = Path.cwd()
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            base = Path(HydraConfig.get().runtime.output_dir)
    except ImportError:
        pass
    return base / path


class Checkpoint(NamedTuple):
    step: int   # steps done: resume at this step
    path: Path  # what the trainer's save function wrote (a file or a folder)


class Checkpoints:
    """A run's checkpoint folder: complete checkpoints ``step_<9 digits>`` and the MLflow run id (``mlflow_run_id``).

    ``save`` lets the trainer write into a temporary name, then renames it: a job killed mid-save leaves no
    checkpoint that ``latest`` would pick. With several ranks writing one checkpoint, every rank calls ``save``
    with the same step and ``rank`` set: each writes the temporary path, rank 0 renames after ``barrier``.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        self.dir = Path(directory)
        self.keep = keep

    def _all(self) -> list[Checkpoint]:
        if not self.dir.is_dir():
            return []
        found = [Checkpoint(int(m.group(1)), p) for p in self.dir.iterdir() if (m := _STEP_DIR.match(p.name))]
        return sorted(found)

    def latest(self) -> Checkpoint | None:
        """The newest complete checkpoint, or None."""
        found = self._all()
        return found[-1] if found else None

    def save(self, step: int, write: Callable[[Path], Any], *, rank: int = 0,
             barrier: Callable[[], Any] | None = None) -> Path:
        """Call ``write(tmp_path)``, then make it ``step_<step>`` (replacing one of the same step) and keep the
        newest ``keep``. Returns the final path."""
        final = self.dir / f"step_{step:09d}"
        tmp = self.dir / f".tmp_step_{step:09d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        write(tmp)
        if barrier is not None:
            barrier()
        if rank == 0:
            _remove(final)
            os.replace(tmp, final)
            for old in self._all()[:-self.keep]:
                _remove(old.path)
        if barrier is not None:
            barrier()
        return final

    @property
    def run_id(self) -> str | None:
        """The MLflow run id recorded by the first attempt, or None."""
        f = self.dir / RUN_ID_FILE
        if not f.is_file():
            return None
        return f.read_text().strip() or None

    @run_id.setter
    def run_id(self, value: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{RUN_ID_FILE}.tmp"
        tmp.write_text(value + "\n")
        os.replace(tmp, self.dir / RUN_ID_FILE)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


# ---------------------------------------------------------------------------------------------- MLflow

@contextlib.contextmanager
def mlflow_run(ckpts: Checkpoints, experiment: str, run_name: str | None = None,
               params: Mapping[str, object] | None = None, tags: Mapping[str, str] | None = None,
               uri: str | None = None) -> Iterator[Any]:
    """The active MLflow run for this job: the one whose id ``ckpts`` holds, else a new one (its id is written there
    at once, so a requeue before the first checkpoint still continues it).

    Tags: ``fp4moe.tracking.environment_tags()``, ``job_tags()`` (job id, restart count), ``tags``. Params are
    logged by the first attempt only. Ends FINISHED; FAILED on an exception; KILLED when the job leaves to be
    requeued (the next attempt sets it RUNNING again). ``uri`` defaults to ``fp4moe.tracking.tracking_uri()``.
    """
    import mlflow

    uri = uri or tracking.tracking_uri()
    tracking.check_reachable(uri)
    mlflow.set_tracking_uri(uri)
    run_id = ckpts.run_id
    if run_id is None:
        client = mlflow.MlflowClient(uri)
        exp_id = tracking._experiment_id(client, experiment, uri)  # artifacts beside a local store
        run = mlflow.start_run(experiment_id=exp_id, run_name=run_name)
        ckpts.run_id = run.info.run_id
        if params:
            mlflow.log_params({k: str(v) for k, v in params.items()})
    else:
        run = mlflow.start_run(run_id=run_id)
    mlflow.set_tags({**tracking.environment_tags(), **job_tags(), **(tags or {})})
    try:
        yield run
    except Requeued:
        mlflow.set_tag("requeued", "true")
        mlflow.end_run("KILLED")
        raise
    except BaseException:
        mlflow.end_run("FAILED")
        raise
    mlflow.end_run("FINISHED")


def prepare_tracking(uri: str | None = None) -> str:
    """Create the MLflow store's schema now, in one process: parallel jobs opening a new sqlite file race in its
    migrations (``table _alembic_tmp_... already exists``). Returns the URI."""
    uri = uri or tracking.tracking_uri()
    tracking.check_reachable(uri)
    if uri.startswith("sqlite:"):
        from mlflow import MlflowClient

        MlflowClient(uri).search_experiments(max_results=1)
    return uri


# ---------------------------------------------------------------------------------------------- preemption

class Requeued(SystemExit):
    """Raised to leave the job after the requeue was asked for (Hydra lets SystemExit through)."""


class Preemption:
    """The preemption/time-limit signal as a flag the loop polls between steps; ``requeue()`` hands over to submitit.

    Inside a submitit job the previous handler is submitit's: ``requeue()`` calls it, and it pickles the job again
    (hydra-submitit-launcher's ``checkpoint``: the same Hydra job), runs ``scontrol requeue`` and exits; it counts
    time-outs against ``max_num_timeout`` and raises when they are used up (the job then ends FAILED). Without
    submitit but in Slurm (slurm/ sbatch templates) rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` itself. Outside
    Slurm it only exits. Install it in the main thread (Python's signal rule).
    """

    def __init__(self, sig: signal.Signals | None = None):
        self.signal = sig or preempt_signal()
        self._flag = False
        self._previous: Any = None

    def __enter__(self) -> "Preemption":
        self._previous = signal.signal(self.signal, self._on_signal)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.signal(self.signal, self._previous if self._previous is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._flag = True
        print(f"fp4moe.slurm: got {signal.Signals(signum).name}: checkpoint after this step, then requeue",
              file=sys.stderr, flush=True)

    def requested(self, sync: bool = True) -> bool:
        """Whether the signal came. With torch.distributed running, all ranks agree (max over ranks), so they all
        save at the same step; that costs one all-reduce of a scalar: call it every step or every few."""
        flag = self._flag
        dist = sys.modules.get("torch.distributed")
        if sync and dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            t = torch.tensor([1 if flag else 0], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = bool(t.item())
        return flag

    def requeue(self) -> None:
        """Requeue this job and leave (raises ``Requeued``); call after the checkpoint is written."""
        previous = self._previous
        owner = getattr(previous, "__self__", None)
        if owner is not None and type(owner).__module__.startswith("submitit."):
            try:
                previous(self.signal, None)   # rank 0: requeues, then sys.exit; the other ranks return
            except SystemExit as e:
                raise Requeued(e.code) from None
            raise Requeued(0)
        if "SLURM_JOB_ID" in os.environ:
            if _rank() == 0:
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True, timeout=60)
            raise Requeued(0)
        raise Requeued("fp4moe.slurm: preempted outside Slurm; the checkpoint is written, run again to resume")


# ---------------------------------------------------------------------------------------------- test knobs

def inject_faults(cfg: Any, step: int) -> None:
    """Test knobs, all off unless given with ``+fault.<key>=...``: ``fail_at_step`` (raise RuntimeError at that
    step), ``sleep_s`` (sleep after each step, so a job runs past its time limit) on attempts below
    ``sleep_attempts`` (default 1: the first; the requeued one runs at full speed)."""
    from omegaconf import OmegaConf

    fault = OmegaConf.select(cfg, "fault", default=None)
    if not fault:
        return
    if fault.get("fail_at_step") is not None and step == int(fault.fail_at_step):
        raise RuntimeError(f"fp4moe.slurm.inject_faults: fault.fail_at_step={step}")
    attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if fault.get("sleep_s") and attempt < int(fault.get("sleep_attempts", 1)):
        time.sleep(float(fault.sleep_s))


# ---------------------------------------------------------------------------------------------- Hydra

class JobFailed(BaseException):
    """The Hydra task raised inside a Slurm job. A BaseException, so that neither Hydra's callback guard nor
    submitit's result handler swallows it: the process exits 1, Slurm records FAILED, and the launcher's
    submitit reports the job's stderr (with the task's traceback)."""


try:
    from hydra.experimental.callback import Callback as _Callback
except ImportError:  # hydra absent: the callback is never used
    _Callback = object  # type: ignore[assignment,misc]


class SlurmCallback(_Callback):
    """Hydra callback (``hydra.callbacks.slurm`` in conf/train.yaml).

    ``on_multirun_start`` (the launching process, before any job): ``prepare_tracking`` for ``tracking.uri``.
    ``on_job_end`` (in the job): when the task raised and the job runs under Slurm (``SLURM_JOB_ID``), raise
    ``JobFailed`` so that Slurm ends the job FAILED instead of COMPLETED. Outside Slurm: nothing.
    """

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        prepare_tracking(OmegaConf.select(config, "tracking.uri", default=None))

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        if job_return.status == JobStatus.FAILED and "SLURM_JOB_ID" in os.environ:
            err = job_return._return_value
            _submitit_error_result(err)
            raise JobFailed(f"Hydra job failed in Slurm job {os.environ['SLURM_JOB_ID']}: "
                            f"{type(err).__name__}: {err}") from err


def _submitit_error_result(err: BaseException) -> None:
    """Under submitit, write the task's traceback as this task's result, as submitit does for an exception it sees
    (submitit 1.5.4's ("error", traceback) pickle): the launcher then raises FailedJobError with it at once, instead
    of waiting 15 s for a result file and quoting the job's stderr. Best effort: any problem leaves that path."""
    if "SUBMITIT_FOLDER" not in os.environ:
        return
    try:
        import traceback

        import submitit
        from submitit.core import utils

        path = submitit.JobEnvironment().paths.result_pickle
        text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
        with utils.temporary_save_path(path) as tmp:
            utils.cloudpickle_dump(("error", text), tmp)
    except Exception as e:  # noqa: BLE001
        print(f"fp4moe.slurm: could not write submitit's error result ({e!r})", file=sys.stderr)
