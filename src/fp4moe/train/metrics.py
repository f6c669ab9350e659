"""MLflow for a training run (rank 0 only), throughput and memory measurement.

One MLflow run per training run, in experiment ``tracking.experiment`` of store ``tracking.uri`` (else
``fp4moe.tracking.tracking_uri()``: ``$MLFLOW_TRACKING_URI`` or ``<repo>/mlruns/mlflow.db``). The store is
checked with ``fp4moe.tracking.check_reachable`` before anything is built. A resumed run continues the MLflow run
whose id its checkpoint holds.

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
the end, and a write that failed stops the run at its next log, flush or finish with an error naming the store.
"""
from __future__ import annotations

import json
import os
import platform
import queue
import statistics
import threading
import time
from importlib import metadata
from typing import Any, Mapping

from omegaconf import OmegaConf

from fp4moe import tracking

GB = 1024 ** 3
MLFLOW_BATCH = 100  # log_batch limit on params per call


def resolve_uri(cfg: Any) -> str:
    uri = OmegaConf.select(cfg, "tracking.uri")
    return str(uri) if uri else tracking.tracking_uri()


def flatten(node: Any, prefix: str = "") -> dict[str, str]:
    """Dotted keys -> string values of a nested dict (lists and scalars as JSON-ish strings)."""
    out: dict[str, str] = {}
    if isinstance(node, Mapping):
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    key = prefix[:-1]
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


class TrackingError(RuntimeError):
    """A background write to the MLflow store failed; the message names the store and what was written before."""


class Tracker:
    """The MLflow run of this training run (rank 0); a no-op object on the other ranks.

    ``start`` writes synchronously; ``log`` and ``set_tags`` queue their writes for one background thread (in
    order; ``background=False`` writes at once). ``flush`` waits until everything queued is in the store,
    ``finish`` flushes, ends the run and stops the thread. A failed write is raised (``TrackingError``) at the next
    ``log`` / ``set_tags`` / ``flush`` / ``finish``; the writes queued after it are dropped, since the run stops."""

    def __init__(self, uri: str, experiment: str, enabled: bool, background: bool | None = None) -> None:
        """``background``: None takes ``FP4MOE_TRACKING_THREAD`` (default on)."""
        self.uri, self.experiment, self.enabled = uri, experiment, enabled
        self.background = tracking_thread() if background is None else background
        self.client = None
        self.run_id: str | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._error: tuple[str, BaseException] | None = None
        self._last_logged_step: int | None = None  # the last step whose metrics reached the store

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                what = item[0]
                if self._error is None:  # after a failure nothing more is written
                    try:
                        self._write(*item)
                    except BaseException as e:  # noqa: BLE001 - handed to the training thread
                        self._error = (what, e)
            finally:
                self._queue.task_done()

    def _raise_failed(self) -> None:
        if self._error is not None:
            what, e = self._error
            done = "none" if self._last_logged_step is None else f"up to step {self._last_logged_step}"
            raise TrackingError(f"writing {what} to the MLflow store {self.uri} failed ({type(e).__name__}: {e}); "
                                f"metrics in the store: {done}. Check the store (a server that went away, a full "
                                "disk); a resumed run continues the same MLflow run from its checkpoint") from e

    def _write(self, what: str, step: int | None, fn, args) -> None:
        fn(*args)
        if what == "metrics":
            self._last_logged_step = step

    def _submit(self, what: str, step: int | None, fn, *args) -> None:
        self._raise_failed()
        if self._thread is None:
            self._write(what, step, fn, args)
        else:
            self._queue.put((what, step, fn, args))

    def flush(self) -> None:
        """Wait until every queued write is in the store; raise ``TrackingError`` if one failed."""
        if self._thread is not None:
            self._queue.join()
        self._raise_failed()

    def start(self, run_name: str, params: dict[str, str], tags: dict[str, str], resume_run_id: str | None) -> None:
        """Create the run, or reopen ``resume_run_id`` (status RUNNING again; only params it lacks are added,
        changed ones are listed in the tag ``resume.changed_params``)."""
        if not self.enabled:
            return
        from mlflow.entities import Param, RunTag

        self.client = tracking._client(self.uri)
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
            # carries no stopped_by_signal (nor requeued), which describe how a run ended
            if "stopped_by_signal" in old_tags:
                before = old_tags.get("resume.stopped_by_signals")
                tags["resume.stopped_by_signals"] = ",".join(filter(None, (before, old_tags["stopped_by_signal"])))
            for stale in ("stopped_by_signal", "requeued"):
                if stale in old_tags:
                    client.delete_tag(resume_run_id, stale)
        else:
            exp_id = tracking._experiment_id(client, self.experiment, self.uri)
            self.run_id = client.create_run(exp_id, run_name=run_name).info.run_id
            if resume_run_id:
                tags = {**tags, "resumed_from_missing_run": resume_run_id}
        items = [Param(k[:250], v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), MLFLOW_BATCH):
            client.log_batch(self.run_id, params=items[i:i + MLFLOW_BATCH])
        all_tags = {**tracking.environment_tags(), **tags}
        client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in all_tags.items()])
        if self.background:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._work, name="fp4moe-mlflow", daemon=True)
            self._thread.start()

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        if not self.enabled or self.run_id is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if v is not None]
        if batch:
            self._submit("metrics", step, self.client.log_batch, self.run_id, batch)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if self.enabled and self.run_id is not None:
            from mlflow.entities import RunTag

            self._submit("tags", None, self.client.log_batch, self.run_id, [], [], [RunTag(k, str(v))
                                                                                   for k, v in tags.items()])

    def finish(self, status: str) -> None:
        """Flush, then end the run with ``status``: FINISHED, FAILED or KILLED (stopped by a signal; a resume sets it
        RUNNING again); FAILED if a queued write failed, which is raised after the run is ended."""
        if not (self.enabled and self.run_id is not None):
            return
        failed = None
        try:
            self.flush()
        except TrackingError as e:
            failed, status = e, "FAILED"
        finally:
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception:  # noqa: BLE001 - the store already failed: the first error is the one to report
            if failed is None:
                raise
        if failed is not None:
            raise failed


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


__all__ = ["resolve_uri", "flatten", "hardware_tags", "Tracker", "Meter"]
