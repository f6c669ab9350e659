"""Slurm jobs that outlive their time limit, and Slurm's view of a failed Hydra job (P4, issue 5).

A Slurm launcher profile (conf/hydra/launcher/) asks for ``--signal=USR2@<cluster.signal_delay_s>``: before the time
limit (or on preemption) every task gets SIGUSR2. submitit's handler would requeue at once; a training loop must
first finish its step and write a checkpoint. The trainer (fp4moe/train/loop.py) does, with its own atomic
checkpoints (fp4moe/train/checkpoint.py, which also hold the MLflow run id)::

    with slurm.Preemption() as preempt:                    # SIGUSR2 (requeue), SIGTERM and SIGUSR1 (stop)
        for step in range(start, steps):
            ...                                            # one step, then the after-step hooks
            signum = preempt.poll(device)                  # the signal, agreed by all ranks (0: none)
            if signum:
                save_checkpoint(); break
    if signum:
        preempt.leave(signum)                              # requeue (raises Requeued) or return: exit 128 + signum

The requeued job runs the same Hydra job again (same overrides, same output directory), finds its checkpoint in
that folder and the MLflow run id in the checkpoint, and continues that run. ``SlurmCallback`` (``hydra.callbacks``
in conf/train.yaml) creates the MLflow schema once before a sweep's jobs start, and makes a job whose task raised end
FAILED in Slurm: Hydra catches the exception, so without it Slurm and ``sacct`` would say COMPLETED.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from typing import Any

from fp4moe.tracking import mlflow_store

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)   # checkpoint and stop, no requeue (SIGINT: Ctrl-C)


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


_LIBC: Any = None


def _c_handler(signum: int) -> int | None:
    """The address of the C-level handler of ``signum`` (``sigaction``; Linux x86-64 / aarch64 layout, where
    ``sa_handler`` comes first), or None where it cannot be read. Python's ``signal.getsignal`` does not see a
    handler that C code (a CUDA or communication library) installed over Python's."""
    if not sys.platform.startswith("linux"):
        return None
    global _LIBC
    try:
        import ctypes

        if _LIBC is None:
            _LIBC = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct sigaction is 152 bytes on x86-64 glibc
        if _LIBC.sigaction(int(signum), None, buf) != 0:
            return None
        return int.from_bytes(buf.raw[:ctypes.sizeof(ctypes.c_void_p)], sys.byteorder)
    except (OSError, AttributeError):
        return None


def rank() -> int:
    """This process's global rank from the launcher's environment (SLURM_PROCID, else RANK; 0 alone)."""
    return int(os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0")))


# ---------------------------------------------------------------------------------------------- MLflow

def prepare_tracking(uri: str | None = None) -> str:
    """Create the MLflow store's schema now, in one process: parallel jobs opening a new sqlite file race in its
    migrations (``table _alembic_tmp_... already exists``). Returns the URI."""
    uri = uri or mlflow_store.tracking_uri()
    mlflow_store.check_reachable(uri)
    if uri.startswith("sqlite:"):
        from mlflow import MlflowClient

        MlflowClient(uri).search_experiments(max_results=1)
    return uri


# ---------------------------------------------------------------------------------------------- preemption

_early: list[int] = []   # the first signal catch_early() recorded, until a Preemption takes it over


def _on_early_signal(signum: int, frame: Any) -> None:
    if not _early:
        _early.append(signum)
        print(f"fp4moe.launch.slurm: got {signal.Signals(signum).name} while starting: the run checkpoints after its "
              "first step", file=sys.stderr, flush=True)


def catch_early(signals: tuple[signal.Signals, ...] | None = None) -> None:
    """Record the preemption signal, SIGTERM and SIGUSR1 (``signals``) from now until a ``Preemption`` is entered,
    instead of dying by their default action. A job's start-up (imports, the config, the rendezvous: tens of seconds,
    minutes on a large cluster) can meet the time-limit or a preemption signal; by default it would kill the process
    and end the job FAILED, with no checkpoint and no requeue. The first ``Preemption`` takes the recorded signal
    over (its run stops after its first step, with a checkpoint, and requeues on the preemption signal). Only
    signals still at their default action are taken (submitit's own handlers stay); main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in signals or (preempt_signal(), signal.SIGTERM, signal.SIGUSR1):
        if signal.getsignal(s) == signal.SIG_DFL:
            signal.signal(s, _on_early_signal)


class Requeued(SystemExit):
    """Raised to leave the job after the requeue was asked for (Hydra lets SystemExit through)."""


class Preemption:
    """Stop signals as a flag the loop polls between steps; ``leave()`` then hands over to Slurm.

    Watches the preemption signal (``preempt_signal()``, SIGUSR2: checkpoint, then requeue) and ``STOP_SIGNALS``
    (SIGTERM from ``scancel`` or ``kill``, SIGUSR1 from ``sbatch --signal=USR1@...``, SIGINT from Ctrl-C: checkpoint,
    then stop). The handler only records the first signal; a second SIGINT raises KeyboardInterrupt (abort now).
    Handlers are installed in the main thread only (Python's rule) and the previous ones are restored on exit.

    Two guards for a stop that would otherwise end the process with no word and no checkpoint: with ``stacks_file``,
    every watched signal first appends all threads' Python stacks to that file (``faulthandler.register``, chained
    to the handler; where the run was when it was stopped); and ``poll`` checks that the handlers are still the
    ones installed here, at Python's level and at the C level (``sigaction``, Linux): a library that replaced one
    is named in one warning line and the handler is put back, so the stop still checkpoints.

    Requeue (``requeue()``, for the preemption signal inside a Slurm job): inside a submitit job the previous
    handler is submitit's: it is called, pickles the job again (hydra-submitit-launcher's ``checkpoint``: the same
    Hydra job), runs ``scontrol requeue`` and exits; it counts time-outs against ``max_num_timeout`` and raises when
    they are used up (the job then ends FAILED). In a plain sbatch job (slurm/ templates) rank 0 runs
    ``scontrol requeue $SLURM_JOB_ID`` itself.
    """

    def __init__(self, stop_signals: tuple[signal.Signals, ...] = STOP_SIGNALS,
                 stacks_file: str | os.PathLike | None = None):
        self.signal = preempt_signal()
        self.signals = tuple(dict.fromkeys((*stop_signals, self.signal)))
        self.received = 0
        self._previous: dict[int, Any] = {}
        self.stacks_file = stacks_file
        self._stacks: Any = None
        self._c_handlers: dict[int, int | None] = {}
        self._warned: set[int] = set()
        self._active = False

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                previous = signal.signal(s, self._on_signal)
                # catch_early's recorder hands over: after this run the default action again
                self._previous[s] = signal.SIG_DFL if previous == _on_early_signal else previous
            if self.stacks_file is not None:
                try:
                    self._stacks = open(self.stacks_file, "a")
                except OSError as e:
                    print(f"fp4moe.launch.slurm: cannot open {self.stacks_file} for the stacks at a stop signal ({e})",
                          file=sys.stderr)
            self._install_stacks()
            self._active = True
            if _early and _early[0] in self.signals:   # a signal of the start-up (catch_early): this run's now
                self._on_signal(_early.pop(), None)
        return self

    def _install_stacks(self) -> None:
        """faulthandler's dump before the Python handler (``stacks_file``), then the C handlers to watch."""
        import faulthandler

        for s in self._previous:
            if self._stacks is not None:
                faulthandler.register(s, file=self._stacks, all_threads=True, chain=True)
            self._c_handlers[s] = _c_handler(s)

    def _check_handlers(self) -> None:
        """Put back a handler that something replaced since ``__enter__`` (warned once per signal)."""
        replaced = []
        for s in self._previous:
            py, c = signal.getsignal(s), _c_handler(s)
            if py != self._on_signal:
                replaced.append((s, f"Python handler {py!r}"))
            elif self._c_handlers.get(s) is not None and c != self._c_handlers[s]:
                replaced.append((s, f"C handler at {c:#x}"))
        if not replaced:
            return
        import faulthandler

        for s, what in replaced:
            if s not in self._warned:
                self._warned.add(s)
                print(f"fp4moe.launch.slurm: the {signal.Signals(s).name} handler was replaced (now: {what}) by a "
                      "library after the run started; put back, so that the signal still checkpoints", file=sys.stderr,
                      flush=True)
            if self._stacks is not None:
                faulthandler.unregister(s)
            signal.signal(s, self._on_signal)
        self._install_stacks()

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        if self._stacks is not None:
            import faulthandler

            for s in self._previous:
                faulthandler.unregister(s)  # back to the Python handler, restored below
            self._stacks.close()
            self._stacks = None
            try:  # no signal came: no file
                if os.path.getsize(self.stacks_file) == 0:
                    os.remove(self.stacks_file)
            except OSError:
                pass
        for s, h in self._previous.items():  # kept in _previous: requeue() calls submitit's handler after exit
            if s == self.signal and "SLURM_JOB_ID" in os.environ:
                # In a Slurm job the signal may come again, or late, after the loop: it must neither kill a finished
                # job (its default action: FAILED) nor make submitit requeue it. requeue() calls the handler itself.
                h = signal.SIG_IGN
            signal.signal(s, h if h is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received:
            if signum == signal.SIGINT:  # a second Ctrl-C: abort now, without the checkpoint
                raise KeyboardInterrupt
            return
        self.received = signum
        then = "requeue" if self.will_requeue(signum) else "stop"
        again = " (Ctrl-C again aborts without it)" if signum == signal.SIGINT else ""
        print(f"fp4moe.launch.slurm: got {signal.Signals(signum).name}: checkpoint after this step, then {then}{again}",
              file=sys.stderr, flush=True)

    def poll(self, device: Any = None) -> int:
        """The signal every rank agrees on (the largest number any rank received), or 0. With torch.distributed
        running this is one all-reduce of a scalar on ``device`` (default: the current CUDA device under nccl, else
        CPU), so all ranks stop at the same step: call it on every rank, every step or every few."""
        if self._active and threading.current_thread() is threading.main_thread():
            self._check_handlers()
        got = self.received
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import torch

            if device is None:
                device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            t = torch.tensor([got], dtype=torch.int64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            got = int(t.item())
        return got

    def requested(self) -> bool:
        """Whether any rank got one of the signals (collective, as ``poll``)."""
        return bool(self.poll())

    def _submitit_handler(self) -> Any:
        previous = self._previous.get(self.signal)
        owner = getattr(previous, "__self__", None)
        return previous if owner is not None and type(owner).__module__.startswith("submitit.") else None

    def will_requeue(self, signum: int) -> bool:
        """Whether ``leave(signum)`` requeues: the preemption signal, inside a submitit or Slurm job."""
        return signum == self.signal and (self._submitit_handler() is not None or "SLURM_JOB_ID" in os.environ)

    def leave(self, signum: int) -> None:
        """After the checkpoint: requeue when ``will_requeue(signum)`` (raises ``Requeued``), else return (the
        caller exits, e.g. with 128 + signum)."""
        if self.will_requeue(signum):
            self.requeue()

    def requeue(self) -> None:
        """Requeue this job and leave (raises ``Requeued``); call after the checkpoint is written."""
        handler = self._submitit_handler()
        if handler is not None:
            try:
                handler(self.signal, None)   # rank 0: requeues, then sys.exit; the other ranks return
            except SystemExit as e:
                raise Requeued(e.code) from None
            raise Requeued(0)
        if "SLURM_JOB_ID" in os.environ:
            if rank() == 0:
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True, timeout=60)
            raise Requeued(0)
        raise Requeued("fp4moe.launch.slurm: preempted outside Slurm; the checkpoint is written, run again to resume")


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

    ``on_multirun_start`` (the launching process, before any job): ``prepare_tracking`` for the jobs' store
    (``fp4moe.tracking.mlflow_store.config_uri``: the trainer's rule).
    ``on_job_end`` (in the job): when the task raised and the job runs under Slurm (``SLURM_JOB_ID``), raise
    ``JobFailed`` so that Slurm ends the job FAILED instead of COMPLETED. Outside Slurm: nothing.
    """

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        prepare_tracking(mlflow_store.config_uri(config))

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
        print(f"fp4moe.launch.slurm: could not write submitit's error result ({e!r})", file=sys.stderr)
