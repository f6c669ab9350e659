"""Who trains a checkpoint folder now, and what became of the attempt before (issue 30: never lose a run).

A run's checkpoint folder (``fp4moe.train.checkpoint.run_dir``) holds two files besides its ``step_NNNNNNN/``:

- ``.attempt.lock``: locked (``fcntl.flock``, exclusive) by rank 0 of the attempt that trains the folder, for as
  long as it runs. The kernel drops the lock when the process ends, however it ends (``kill -9`` included), so a
  lock is never stale. A second command that would train the same folder at the same time (the same command twice:
  the run folder is keyed by the config) stops before the model is built, with one line naming the process that
  holds the folder and how to run beside it (:class:`Busy`).
- ``attempt.json``: the attempt that holds (or last held) the lock: host, pid, start time, every rank's host (rank
  order), the Slurm job and restart count when it runs under Slurm, and once its MLflow run exists, that run's id and
  store (without credentials).
- ``attempts.jsonl``: one line per attempt, appended when it takes the lock (so never two writers): its start time,
  rank 0's host and pid, every rank's host, the Slurm job id, restart count and node list. Where each attempt of a
  requeued job ran, rank by rank (a requeue may land on other nodes: rank 0 on another host); :func:`history`
  reads it.

An attempt that ended without a checkpoint of its own run (killed before its first save, or a stop whose save never
happened) leaves its MLflow run RUNNING and ``attempt.json`` naming it. The next attempt finds that record
(:attr:`Attempt.previous`); when it does not continue the same MLflow run (it starts over from step 0, or resumes an
older checkpoint of another run), the trainer's tracker ends the earlier run FAILED with a ``lost`` tag that says
why and names the new run, and tags the new one ``earlier_attempt`` (fp4moe.train.metrics.Tracker.start). What the
lost attempt trained stays in the store, marked, rather than a run that looks alive forever.

Reach of the lock: one host always; across hosts where the file system implements ``flock`` for all its clients
(NFS v4, Lustre mounted with ``flock``, GPFS, BeeGFS); elsewhere it guards one host only.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from fp4moe.atomic_write import write_bytes_atomic
from fp4moe.config import ConfigError

LOCK = ".attempt.lock"
RECORD = "attempt.json"
HISTORY = "attempts.jsonl"


class Busy(ConfigError):
    """Another live process trains this checkpoint folder."""


def _read(path: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


class Attempt:
    """This process's hold on a checkpoint folder (rank 0; on other ranks an empty stand-in). A context manager:
    leaving it releases the lock. ``previous``: the record the attempt before left (None: none, or not rank 0)."""

    def __init__(self, root: Path, previous: dict[str, Any] | None, fd: int | None,
                 hosts: list[str] | None = None) -> None:
        self.root, self.previous, self._fd = root, previous, fd
        self.hosts = list(hosts) if hosts else [socket.gethostname()]
        self.started = time.time()

    def _facts(self) -> dict[str, Any]:
        """Who this attempt is: start time, rank 0's host and pid, every rank's host, the Slurm job (if any)."""
        from fp4moe.launch.slurm import job_tags

        return {"started": round(self.started, 3), "host": socket.gethostname(), "pid": os.getpid(),
                "rank_hosts": self.hosts, **job_tags()}

    def record(self, mlflow_run_id: str | None = None, store: str | None = None) -> None:
        """Write ``attempt.json`` (atomically) for this attempt; rank 0 only (elsewhere nothing)."""
        if self._fd is None:
            return
        rec = {**self._facts(), "mlflow_run_id": mlflow_run_id, "store": store}
        write_bytes_atomic(self.root / RECORD, (json.dumps(rec, indent=1) + "\n").encode())

    def log_start(self) -> None:
        """Append this attempt's line to ``attempts.jsonl``; rank 0 only (elsewhere nothing). One ``write`` of one
        line in append mode, by the holder of the lock."""
        if self._fd is None:
            return
        with open(self.root / HISTORY, "a") as f:
            f.write(json.dumps(self._facts()) + "\n")

    def earlier_run(self, store: str) -> str | None:
        """The MLflow run id of the attempt before, if it logged to ``store`` (a URI without credentials)."""
        prev = self.previous or {}
        return prev.get("mlflow_run_id") if prev.get("store") == store else None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Attempt":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def claim(root: str | os.PathLike, is_main: bool = True, hosts: list[str] | None = None) -> Attempt:
    """Take the checkpoint folder ``root`` for this attempt (creating it): its lock, then ``attempt.json``
    (``previous`` keeps what the file said before) and a line in ``attempts.jsonl``. ``hosts``: every rank's host
    name in rank order (default: this host alone). Raises :class:`Busy` when another process holds the lock.
    Ranks other than 0 (``is_main`` false) take nothing; the caller shares rank 0's outcome with them."""
    root = Path(root)
    if not is_main:
        return Attempt(root, None, None, hosts)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: held by another open of the file, in this process or another
        os.close(fd)
        holder = _read(root / RECORD) or {}
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, started "
               f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started']))}"
               if holder.get("started") else "another process")
        raise Busy(f"{root} is being trained by {who}: wait for it or stop it, or run this one in a folder of its "
                   "own (hydra.run.dir=<new folder>, or train.checkpoint_dir=<new folder>)") from None
    attempt = Attempt(root, _read(root / RECORD), fd, hosts)
    try:
        attempt.record()
        attempt.log_start()
    except BaseException:
        attempt.release()
        raise
    return attempt


def history(root: str | os.PathLike) -> list[dict[str, Any]]:
    """Every attempt's line of ``attempts.jsonl`` in ``root``, oldest first (none: an empty list); a line that is
    not whole JSON (a write cut short) is left out."""
    try:
        lines = (Path(root) / HISTORY).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


__all__ = ["Attempt", "Busy", "HISTORY", "LOCK", "RECORD", "claim", "history"]
