"""MLflow for a training run (rank 0 only), throughput and memory measurement.

One MLflow run per training run, in experiment ``tracking.experiment`` of store
``fp4moe.tracking.mlflow_store.config_uri(cfg)`` (``tracking.uri``, else ``$MLFLOW_TRACKING_URI`` or
``<repo>/mlruns/mlflow.db``). The store is
checked with ``fp4moe.tracking.mlflow_store.check_reachable`` before anything is built. A resumed run continues the
MLflow run whose id its checkpoint holds.

- params: the resolved config flattened to dotted keys (lists as JSON), ``derived.*`` (fp4moe.config.derived),
  ``recipe`` (the recipe's name in results, ``Recipe.tag``: precision.label or precision.name), ``git_commit``.
- tags: hardware, device, world size, launcher, torch / megatron-core / triton / CUDA versions, git state.
- metrics, step = optimizer update (1-based): ``loss`` (LM cross entropy, nats/token, mean over the global batch),
  ``lr``, ``grad_norm`` (before clipping), ``step_time_s``, ``tokens_per_gpu_per_s`` (measured steps only: the
  first ``measure.warmup_steps`` steps of each process start are left out), ``peak_mem_allocated_gb`` /
  ``peak_mem_reserved_gb`` (CUDA only, since the memory-stats reset at the end of the warm-up; NOT logged on CPU,
  the run carries the tag ``peak_memory=not measured (CPU)``), ``mem_allocated_at_step_start_gb`` (CUDA only, every
  step: what a step inherits from the last one, i.e. weights, FP32 master weights and AdamW states, nothing of the
  last step's activations), ``eval_loss``, and megatron-core's MoE auxiliary
  losses as its tracker reports them (``moe/seq_load_balancing_loss``: mean over MoE layers, before the
  coefficient ``model.moe.aux_loss_coeff``).
- summary metrics at the end (also written to ``summary.json`` in the Hydra output folder): ``summary/tgs_mean``,
  ``summary/tgs_median``, ``summary/tgs_min``, ``summary/tgs_max``, ``summary/measured_steps``,
  ``summary/step_time_median_s``, ``summary/peak_mem_allocated_gb``, ``summary/peak_mem_reserved_gb``,
  ``summary/peak_mem_pct`` (% of the GPU's total memory), ``summary/mem_allocated_at_step_start_gb`` (the last
  step's), ``summary/optimizer_state_bytes`` / ``_host_bytes`` (megatron's optimizer state on the GPU / in host
  memory: FP32 main params, AdamW moments and, with BF16 main grads, the FP32 gradient copies; bytes, the fullest
  rank's; ``fp4moe.scale.optimizer_state`` predicts them exactly), ``summary/grad_buffer_bytes`` (megatron DDP's
  gradient buffers), ``summary/fp8_weight_cache_bytes`` (the FP8 weight copies of ``train.fp8_weight_cache`` at
  their largest; 0 without it), each also as ``..._min`` (the emptiest rank's), ``summary/final_loss``,
  ``summary/final_eval_loss``.

Metrics and tags are written by a background thread (``Tracker``), so that a step does not wait for the store (an
H200 profile showed the GPU idle while the trainer's step end ran); the trainer flushes before each checkpoint and at
the end. A store that fails mid-run does not stop the training: what it could not take is kept in
``<checkpoint folder>/mlflow_pending.jsonl`` (one warning line names the store and the file), logged into the run
when it resumes or is rerun with the store back, or by hand::

    python -m fp4moe.train.metrics <checkpoint folder>/mlflow_pending.jsonl [--tracking-uri URI]
"""
from __future__ import annotations

import json
import logging
import os
import platform
import queue
import re
import statistics
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping

from fp4moe.tracking import mlflow_store

log = logging.getLogger("fp4moe.train")
GB = 1024 ** 3


def flatten(node: Any, prefix: str = "", show: Callable[[Any], str] | None = None) -> dict[str, str]:
    """Dotted keys -> string values of a nested dict (``prefix``: ending in '.'); each leaf written by ``show``
    (default: lists as JSON, scalars with ``str``)."""
    out: dict[str, str] = {}
    if isinstance(node, Mapping):
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}.", show))
        return out
    key = prefix[:-1]
    if show is not None:
        out[key] = show(node)
    else:
        out[key] = json.dumps(node) if isinstance(node, list) else str(node)
    return out


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def hardware_tags(device: Any, world_size: int, launcher: str) -> dict[str, str]:
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        hw = f"{world_size} x {props.name} ({props.total_memory / GB:.0f} GiB)"
        mem = "torch.cuda.max_memory_allocated / max_memory_reserved"
    else:
        cpu = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
        except OSError:
            pass
        hw = f"{world_size} process(es) on CPU: {cpu}, {os.cpu_count()} cores"
        mem = "not measured (CPU)"
    return {"hardware": hw, "device": device.type, "world_size": str(world_size), "launcher": launcher,
            "peak_memory": mem, "torch_version": torch.__version__, "megatron_core": _version("megatron-core"),
            "triton": _version("triton"), "cuda": str(torch.version.cuda), "mlflow": _version("mlflow-skinny")}


TRACKING_THREAD_ENV = "FP4MOE_TRACKING_THREAD"


def tracking_thread() -> bool:
    """``FP4MOE_TRACKING_THREAD``: unset or ``1`` writes metrics and tags from a background thread (the default),
    ``0`` from the training loop (for side-by-side measurements). ValueError naming the values for anything else."""
    raw = os.environ.get(TRACKING_THREAD_ENV, "1").strip() or "1"
    if raw not in ("0", "1"):
        raise ValueError(f"{TRACKING_THREAD_ENV}={os.environ[TRACKING_THREAD_ENV]!r}: use 1 (the default: MLflow "
                         "writes from a background thread) or 0 (from the training loop)")
    return raw == "1"


PENDING_FILE = "mlflow_pending.jsonl"  # in the run's checkpoint folder: what a failed store could not take
RETRY_S = 60.0  # after a store failure, the writer tries the store again at most this often (seconds)
REPLAY_COMMAND = "python -m fp4moe.train.metrics"


class TrackingError(RuntimeError):
    """A write to the MLflow store failed and no pending file keeps it (the tracker has none, or it cannot be
    written); the message names the store, the file and the last step the store holds."""


def _why(e: BaseException) -> str:
    """``e`` as one short line (MLflow's and SQLAlchemy's messages run over several, with the SQL statement)."""
    text = " ".join(str(e).split()).split(" [SQL:")[0]
    text = re.sub(r"^\(raised as a result of [^)]*\) ", "", text)  # SQLAlchemy's note on when it flushed
    return f"{type(e).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _send(client: Any, rec: Mapping[str, Any]) -> None:
    """Write one record (``kind`` metrics, tags or status, as the pending file holds them) to the store."""
    from mlflow.entities import Metric, RunTag

    run_id, kind = rec["run_id"], rec["kind"]
    if kind == "metrics":
        mlflow_store.log_batched(client, run_id, metrics=[Metric(k, float(v), int(rec["time"]), int(rec["step"]))
                                                          for k, v in rec["metrics"].items()])
    elif kind == "tags":
        mlflow_store.log_batched(client, run_id, tags=[RunTag(k, str(v)) for k, v in rec["tags"].items()])
    elif kind == "status":
        client.set_terminated(run_id, status=rec["status"], end_time=rec.get("time"))
    else:
        raise ValueError(f"unknown record kind {kind!r}")


def replay_pending(path: str | os.PathLike, uri: str | None = None) -> tuple[int, list[str]]:
    """Log what a :class:`Tracker` kept in ``path`` while its store failed into the runs it belongs to, in order, then
    delete the file. ``uri``: the store (None: the one the file names). Returns (records logged, run ids).
    A last line cut short by a kill is skipped. TrackingUnavailable (one line: the store, the file, the fix) when
    the store cannot take them; the file then stays, and a second replay logs everything again (a metric logged
    twice at one step has the same value)."""
    from fp4moe.tracking.mlflow_store import TrackingUnavailable, check_reachable

    path = Path(path)
    lines = path.read_text().splitlines()
    recs: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise TrackingUnavailable(f"{path} line {i + 1} is not JSON: not a pending file of fp4moe.train "
                                          "(fp4moe.train.metrics.Tracker writes them)") from None
    stores = [r["uri"] for r in recs if r.get("kind") == "store"]
    uri = uri or (stores[-1] if stores else mlflow_store.tracking_uri())
    writes = [r for r in recs if r.get("kind") != "store"]
    runs = list(dict.fromkeys(r["run_id"] for r in writes))
    check_reachable(uri, f"(The metrics of run(s) {', '.join(runs)} stay in {path} until then.)")
    client = mlflow_store._client(uri)
    fix = f"the file stays; fix the store and run `{REPLAY_COMMAND} {path}` again"
    for run_id in runs:
        try:
            client.get_run(run_id)
        except Exception as e:  # noqa: BLE001 - mlflow raises its own exception types for a missing run
            raise TrackingUnavailable(f"MLflow store {mlflow_store.without_credentials(uri)} has no run {run_id}, which "
                                      f"{path} belongs to ({_why(e)}): pass that run's store with --tracking-uri "
                                      f"(or MLFLOW_TRACKING_URI), or move {path} away to go on without "
                                      "logging it") from None
    try:
        for rec in writes:
            _send(client, rec)
    except Exception as e:  # noqa: BLE001 - any store failure: one line
        raise TrackingUnavailable(f"logging {path} into MLflow store {mlflow_store.without_credentials(uri)} failed "
                                  f"({_why(e)}); {fix}") from None
    path.unlink()
    return len(writes), runs


def replay_if_pending(path: Path, uri: str) -> None:
    """:func:`replay_pending` when ``path`` exists (a store that failed in an earlier process), saying what it
    logged; nothing otherwise."""
    if path.is_file():
        n, runs = replay_pending(path, uri)
        log.info("logged %d records that %s kept for run %s while the store failed", n, path, ", ".join(runs))


class Tracker:
    """The MLflow run of this training run (rank 0); a no-op object on the other ranks.

    ``start`` writes synchronously; ``log`` and ``set_tags`` queue their writes for one background thread (in
    order; ``background=False`` writes at once). ``flush`` waits until everything queued is written, ``finish``
    flushes, ends the run and stops the thread.

    A store that fails mid-run does not stop the training: with a ``pending`` file (the trainer's:
    ``<checkpoint folder>/mlflow_pending.jsonl``) the first failed write logs one warning line naming the store and
    the file, and that write and every later one of this process (metrics, tags, the run's end) are appended to the
    file as JSON lines (fsynced). The writer tries the store again at most every ``retry_s`` seconds (before a
    write; a local SQLite store only if its database file is there again, a server only if ``/health`` answers, so
    that a retry creates nothing): when the store takes the pending file (:func:`replay_pending`), the file is
    removed, one line says so, and writes go to the store again. Otherwise ``finish`` says once more where they
    are, with how to log them. ``start`` first logs a pending file it finds into its run (the resumed run, the store back);
    ``python -m fp4moe.train.metrics FILE`` does the same by hand (:func:`replay_pending`). Without a ``pending``
    file, or when it cannot be written either, the failure is raised (``TrackingError``) at the next ``log`` /
    ``set_tags`` / ``flush`` / ``finish``."""

    def __init__(self, uri: str, experiment: str, enabled: bool, background: bool | None = None,
                 pending: str | os.PathLike | None = None, retry_s: float = RETRY_S) -> None:
        """``background``: None takes ``FP4MOE_TRACKING_THREAD`` (default on)."""
        self.uri, self.experiment, self.enabled = uri, experiment, enabled
        self.retry_s = float(retry_s)
        self._last_try = 0.0                         # time.monotonic() of the last retry of a failed store
        self.background = tracking_thread() if background is None else background
        self.pending = Path(pending) if pending is not None else None
        self.client = None
        self.run_id: str | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._error: TrackingError | None = None     # nothing more can be written anywhere: raised
        self._failed: str | None = None              # the store failed (what, why): writes go to `pending`
        self._kept_steps: list[int] = []             # first and last step whose metrics went to `pending`
        self._last_logged_step: int | None = None    # the last step whose metrics reached the store

    def _work(self) -> None:
        while True:
            rec = self._queue.get()
            try:
                if rec is None:
                    return
                self._write(rec)
            finally:
                self._queue.task_done()

    def _raise_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _stored(self) -> str:
        return "none" if self._last_logged_step is None else f"up to step {self._last_logged_step}"

    def _write(self, rec: dict[str, Any]) -> None:
        """``rec`` to the store; once the store has failed, to the pending file. Never raises: a failure that
        cannot be kept becomes ``self._error``."""
        if self._error is not None:  # nothing more is written
            return
        what = f"the metrics of step {rec['step']}" if rec["kind"] == "metrics" else f"the run's {rec['kind']}"
        if self._failed is not None and self.pending is not None:
            self._retry_store()
        if self._failed is None:
            try:
                _send(self.client, rec)
                if rec["kind"] == "metrics":
                    self._last_logged_step = rec["step"]
                return
            except Exception as e:  # noqa: BLE001 - any failure of the store
                self._failed = f"{what} ({_why(e)})"
                if self.pending is None:
                    self._error = TrackingError(
                        f"writing {what} to the MLflow store {self._store()} failed ({_why(e)}); metrics in the "
                        f"store: {self._stored()}. Check the store (a server that went away, a full disk); a resumed "
                        "run continues the same MLflow run from its checkpoint")
                    return
                log.warning("MLflow store %s failed writing %s; training goes on: run %s's metrics, tags and end "
                            "from here on are kept in %s (%s %s logs them later)", self._store(), self._failed,
                            self.run_id, self.pending, REPLAY_COMMAND, self.pending)
                self._keep({"kind": "store", "uri": self._store(), "run_id": self.run_id, "failed": self._failed})
        self._keep(rec)
        if rec["kind"] == "metrics":
            self._kept_steps = [self._kept_steps[0] if self._kept_steps else rec["step"], rec["step"]]

    def _store(self) -> str:
        return mlflow_store.without_credentials(self.uri)

    def _retry_store(self) -> None:
        """At most every ``retry_s`` seconds: if the store is back, log the pending file into it (the file is then
        removed) and write to the store again from here on; if not, or it fails again, keep writing to the file."""
        now = time.monotonic()
        if now - self._last_try < self.retry_s:
            return
        self._last_try = now
        db = mlflow_store.sqlite_file(self.uri)
        if db is not None and not db.is_file():  # an SQLite store away: opening it would create an empty one
            return
        kept = (f"steps {self._kept_steps[0]}-{self._kept_steps[1]}" if self._kept_steps else "no steps")
        try:  # replay_pending asks the store first (check_reachable: a server's /health, a folder's write access)
            n, _ = replay_pending(self.pending, self.uri)
        except Exception as e:  # noqa: BLE001 - still failing: the file stays and grows, as before the retry
            log.debug("MLflow store %s still fails (%s); writes stay in %s", self._store(), _why(e), self.pending)
            return
        log.info("MLflow store %s is back: the %d records (%s) that %s kept are logged into run %s, and its writes go "
                 "to the store again", self._store(), n, kept, self.pending, self.run_id)
        self._failed, self._kept_steps = None, []
        self.client = mlflow_store._client(self.uri)

    def _keep(self, rec: dict[str, Any]) -> None:
        if self._error is not None:
            return
        try:
            self.pending.parent.mkdir(parents=True, exist_ok=True)
            with open(self.pending, "a") as f:
                f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            self._error = TrackingError(
                f"MLflow store {self._store()} failed writing {self._failed}, and {self.pending} cannot keep what "
                f"it could not take ({_why(e)}); metrics in the store: {self._stored()}. Fix the store or free "
                "space there; a resumed run continues the same MLflow run from its checkpoint")

    def _submit(self, rec: dict[str, Any]) -> None:
        self._raise_failed()
        if self._thread is None:
            self._write(rec)
            self._raise_failed()
        else:
            self._queue.put(rec)

    def flush(self) -> None:
        """Wait until every queued write is in the store (or, the store failed, in the pending file); raise
        ``TrackingError`` if one could be kept nowhere."""
        if self._thread is not None:
            self._queue.join()
        self._raise_failed()

    def start(self, run_name: str, params: dict[str, str], tags: dict[str, str], resume_run_id: str | None,
              earlier_run: str | None = None) -> None:
        """Create the run, or reopen ``resume_run_id`` (status RUNNING again; only params it lacks are added,
        changed ones are listed in the tag ``resume.changed_params``). A pending file left by an earlier process
        is logged first (TrackingUnavailable when it cannot be).

        ``earlier_run``: the MLflow run of the attempt that trained the same checkpoint folder before
        (fp4moe.train.attempt). When it is not the run continued here and still says RUNNING, its process ended
        without a checkpoint of it: it is ended FAILED with the tag ``lost`` naming this run, and this run gets
        the tag ``earlier_attempt``."""
        if not self.enabled:
            return
        from mlflow.entities import Param, RunTag

        if self.pending is not None:
            if self.uri.startswith(("http://", "https://")):  # fail over to the pending file in seconds, not minutes
                mlflow_store.limit_http_retries()
            replay_if_pending(self.pending, self.uri)
        self.client = mlflow_store._client(self.uri)
        client = self.client
        existing = None
        if resume_run_id:
            try:
                existing = client.get_run(resume_run_id)
            except Exception:  # noqa: BLE001 - a store without that run: start a new one, say so in a tag
                existing = None
        if existing is not None:
            self.run_id = resume_run_id
            client.update_run(resume_run_id, status="RUNNING")
            old = existing.data.params
            changed = sorted(k for k, v in params.items() if k in old and old[k] != v)
            params = {k: v for k, v in params.items() if k not in old}
            old_tags = existing.data.tags
            tags = {**tags, "resume.changed_params": ",".join(changed) or "none",
                    "resume.count": str(int(old_tags.get("resume.count", "0")) + 1)}
            # the stop that this resume continues from goes into the run's history: a run that went on to finish
            # carries no stopped_by_signal, which describes how a run ended ('requeued' stays: it is history too)
            if "stopped_by_signal" in old_tags:
                before = old_tags.get("resume.stopped_by_signals")
                tags["resume.stopped_by_signals"] = ",".join(filter(None, (before, old_tags["stopped_by_signal"])))
                client.delete_tag(resume_run_id, "stopped_by_signal")
        else:
            exp_id = mlflow_store._experiment_id(client, self.experiment, self.uri)
            self.run_id = client.create_run(exp_id, run_name=run_name).info.run_id
            if resume_run_id:
                tags = {**tags, "resumed_from_missing_run": resume_run_id}
        lost = earlier_run if earlier_run and earlier_run != self.run_id else None
        if lost:
            tags = {**tags, "earlier_attempt": lost}
        all_tags = {**mlflow_store.environment_tags(), **tags}
        mlflow_store.log_batched(client, self.run_id, params=[Param(k[:250], v[:6000]) for k, v in params.items()],
                                 tags=[RunTag(k, str(v)) for k, v in all_tags.items()])
        if lost:
            self._end_lost(lost)
        if self.background:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._work, name="fp4moe-mlflow", daemon=True)
            self._thread.start()

    def _end_lost(self, run_id: str) -> None:
        """End ``run_id`` FAILED with the tag ``lost`` if it still says RUNNING (a run of another store, or gone:
        nothing); one warning line either way it is ended."""
        try:
            run = self.client.get_run(run_id)
        except Exception:  # noqa: BLE001 - deleted, or never reached this store: nothing to mark
            return
        if run.info.status != "RUNNING":
            return
        last = max((m.step for m in self.client.get_metric_history(run_id, "loss")), default=None)
        why = (f"its process ended without a checkpoint of this run (killed, crashed, or stopped before it could "
               f"save; last logged step {last}); the same checkpoint folder was trained again as run {self.run_id}")
        self.client.set_tag(run_id, "lost", why)
        self.client.set_terminated(run_id, status="FAILED")
        log.warning("MLflow run %s (an earlier attempt at this run, last step %s) ended without a checkpoint: "
                    "marked FAILED, tag 'lost'; this attempt is run %s", run_id, last, self.run_id)

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        if not self.enabled or self.run_id is None:
            return
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        if values:
            self._submit({"kind": "metrics", "run_id": self.run_id, "step": int(step),
                          "time": int(time.time() * 1000), "metrics": values})

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if self.enabled and self.run_id is not None:
            self._submit({"kind": "tags", "run_id": self.run_id, "tags": {k: str(v) for k, v in tags.items()}})

    def finish(self, status: str) -> None:
        """Flush, then end the run with ``status``: FINISHED, FAILED or KILLED (stopped by a signal; a resume sets it
        RUNNING again). After a store failure the end goes to the pending file too, and one warning line says how
        to log the file; a write that could be kept nowhere is raised (``TrackingError``) after the run is ended."""
        if not (self.enabled and self.run_id is not None):
            return
        try:
            self.flush()
        except TrackingError:
            status = "FAILED"
        finally:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None
        if self._error is not None:
            try:
                self.client.set_terminated(self.run_id, status=status)
            except Exception:  # noqa: BLE001 - the store already failed: the first error is the one to report
                pass
            raise self._error
        self._write({"kind": "status", "run_id": self.run_id, "status": status, "time": int(time.time() * 1000)})
        self._raise_failed()
        if self._failed is not None:
            steps = (f"steps {self._kept_steps[0]}-{self._kept_steps[1]}" if self._kept_steps else "no steps")
            log.warning("MLflow store %s failed writing %s: the metrics of %s and the end (%s) of run %s are in %s; "
                        "rerun the same command once the store works, or run `%s %s`, to log them into the run",
                        self._store(), self._failed, steps, status, self.run_id, self.pending, REPLAY_COMMAND,
                        self.pending)


class Meter:
    """Step times, tokens/GPU/s and peak memory over the measured steps of the run (docs/training.md, How we measure).

    ``warmup`` steps after each process start are not measured; then ``measure_steps`` steps of this process are
    (None: all). On CUDA the peak-memory counters are reset when measurement starts. A resumed run carries the
    measurements of its earlier processes in the checkpoint (``state_dict`` / ``load_state_dict``), so that its
    summary covers every measured step of the run, not only those after the last restart, and its peaks are the
    largest of all its processes'."""

    def __init__(self, tokens_per_step: int, world_size: int, warmup: int, measure_steps: int | None,
                 device: Any) -> None:
        self.tokens_per_step, self.world_size = tokens_per_step, world_size
        self.warmup, self.measure_steps, self.device = warmup, measure_steps, device
        self.seen = 0
        self.tgs: list[float] = []
        self.step_times: list[float] = []
        self.peak_alloc = self.peak_reserved = 0.0
        self.start_alloc: float | None = None  # GB allocated when the last step began (CUDA)
        self.earlier_peaks = (0.0, 0.0)        # (allocated, reserved) GB of the run's earlier processes

    def state_dict(self) -> dict[str, Any]:
        """The measurements so far (every process of the run), for the checkpoint."""
        return {"tgs": list(self.tgs), "step_times": list(self.step_times),
                "peak_alloc": max(self.earlier_peaks[0], self.peak_alloc),
                "peak_reserved": max(self.earlier_peaks[1], self.peak_reserved)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put a checkpoint's measurements before this process's (called once, before the first step)."""
        self.tgs = [float(x) for x in state["tgs"]] + self.tgs
        self.step_times = [float(x) for x in state["step_times"]] + self.step_times
        self.earlier_peaks = (float(state["peak_alloc"]), float(state["peak_reserved"]))

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def measuring(self) -> bool:
        """Whether the step about to run is measured."""
        done = self.seen - self.warmup
        return done >= 0 and (self.measure_steps is None or done < self.measure_steps)

    def before_step(self) -> None:
        import torch

        if self.cuda and self.seen == self.warmup:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.cuda:  # the allocator's host-side count: no synchronisation needed
            self.start_alloc = torch.cuda.memory_allocated(self.device) / GB

    def after_step(self, dt: float) -> dict[str, float | None]:
        """Record a finished step of ``dt`` seconds; return its metrics (None where not measured)."""
        import torch

        measured = self.measuring()
        self.seen += 1
        out: dict[str, float | None] = {"step_time_s": dt, "tokens_per_gpu_per_s": None}
        if self.cuda:
            out["mem_allocated_at_step_start_gb"] = self.start_alloc
        if measured:
            tgs = self.tokens_per_step / (self.world_size * dt)
            self.tgs.append(tgs)
            self.step_times.append(dt)
            out["tokens_per_gpu_per_s"] = tgs
            if self.cuda:
                self.peak_alloc = torch.cuda.max_memory_allocated(self.device) / GB
                self.peak_reserved = torch.cuda.max_memory_reserved(self.device) / GB
                out["peak_mem_allocated_gb"] = self.peak_alloc
                out["peak_mem_reserved_gb"] = self.peak_reserved
        return out

    def summary(self) -> dict[str, float | None]:
        import torch

        s: dict[str, float | None] = {"summary/measured_steps": float(len(self.tgs))}
        if self.tgs:
            s.update({"summary/tgs_mean": statistics.fmean(self.tgs), "summary/tgs_median": statistics.median(self.tgs),
                      "summary/tgs_min": min(self.tgs), "summary/tgs_max": max(self.tgs),
                      "summary/step_time_median_s": statistics.median(self.step_times)})
        if self.cuda and self.tgs:
            total = torch.cuda.get_device_properties(self.device).total_memory / GB
            alloc, reserved = max(self.earlier_peaks[0], self.peak_alloc), max(self.earlier_peaks[1], self.peak_reserved)
            s.update({"summary/peak_mem_allocated_gb": alloc, "summary/peak_mem_reserved_gb": reserved,
                      "summary/peak_mem_pct": 100.0 * alloc / total,
                      "summary/mem_allocated_at_step_start_gb": self.start_alloc})
        return s


def main(argv: list[str] | None = None) -> int:
    """``python -m fp4moe.train.metrics FILE``: log a pending file into its run (:func:`replay_pending`)."""
    import argparse
    import sys

    from fp4moe import known_warnings
    from fp4moe.tracking.mlflow_store import TrackingUnavailable

    known_warnings.install()

    ap = argparse.ArgumentParser(prog=REPLAY_COMMAND, description="Log what a training run kept in its pending "
                                 "file while its MLflow store failed (<checkpoint folder>/mlflow_pending.jsonl) into "
                                 "the run.")
    ap.add_argument("file", type=Path)
    ap.add_argument("--tracking-uri", default=None, help="the store (default: the one the file names)")
    args = ap.parse_args(argv)
    if not args.file.is_file():
        print(f"{REPLAY_COMMAND}: {args.file} does not exist (a run whose store never failed leaves none)",
              file=sys.stderr)
        return 2
    try:
        n, runs = replay_pending(args.file, args.tracking_uri)
    except TrackingUnavailable as e:
        print(f"{REPLAY_COMMAND}: {e}", file=sys.stderr)
        return 2
    print(f"logged {n} records of {args.file} into run {', '.join(runs)}; the file is removed")
    return 0


__all__ = ["flatten", "hardware_tags", "Tracker", "TrackingError", "Meter", "replay_pending", "replay_if_pending",
           "PENDING_FILE"]


if __name__ == "__main__":
    raise SystemExit(main())
