"""Runs read from an MLflow store, as plain records (no torch; mlflow imported inside the functions).

Which runs mean what:

- trainer runs (``python -m fp4moe.train``, fp4moe.train.metrics): any experiment; recognised by the tags
  ``recipe``, ``recompute``, ``model`` and ``hardware`` the trainer sets;
- kernel benchmark rows (experiment ``kernels``, fp4moe.tracking.bench_log): tag ``kind=row`` / ``kind=summary``;
- MoE layer benchmark rows (experiment ``moe_layer``, fp4moe.tracking.layer_bench_log): tag ``layer_bench_id``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from fp4moe.tracking.mlflow_store import TrackingUnavailable, check_readable, normalize_uri, search_all_runs

KERNELS = "kernels"          # fp4moe.tracking.bench_log.EXPERIMENT (not imported: keeps this module's imports small)
MOE_LAYER = "moe_layer"      # fp4moe.tracking.layer_bench_log.EXPERIMENT
TRAINER_TAGS = ("recipe", "recompute", "model", "hardware")


@dataclass(frozen=True)
class RunRecord:
    """One MLflow run: latest metric values, params and tags as strings."""

    run_id: str
    experiment: str
    name: str
    status: str
    start_time: int
    params: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)

    @property
    def is_trainer(self) -> bool:
        return all(self.tags.get(k) for k in TRAINER_TAGS)


@dataclass
class Store:
    """The runs of one store and a way to read a metric's history (``[(step, value)]`` by step)."""

    uri: str
    runs: list[RunRecord]
    history: Callable[[str, str], list[tuple[int, float]]] = lambda run_id, key: []
    note: str = ""

    def experiment(self, name: str) -> list[RunRecord]:
        return [r for r in self.runs if r.experiment == name]

    def trainer_runs(self) -> list[RunRecord]:
        return [r for r in self.runs if r.is_trainer]


def _missing_sqlite(uri: str) -> bool:
    if not uri.startswith("sqlite:///"):
        return False
    db = uri.removeprefix("sqlite:///")
    return db not in ("", ":memory:") and not Path(db).exists()


# how to point the report and the notebooks at another store (appended to a store error's one line)
WHERE_HINT = "Report: --tracking-uri URI; notebooks: tracking_uri in the parameters cell."


def load(where: str | os.PathLike | None = None) -> Store:
    """Every run of every experiment in the store; an absent sqlite file is an empty store (not created).

    A store that cannot be read (a server that does not answer, a file that is not an MLflow store, a server that is
    not MLflow) raises ``fp4moe.tracking.mlflow_store.TrackingUnavailable``: one line naming the URI and the fix,
    within seconds (Jupyter shows that line without a traceback)."""
    uri = normalize_uri(where)
    if _missing_sqlite(uri):
        return Store(uri, [], note=f"no MLflow store at {uri} yet")
    check_readable(uri, WHERE_HINT)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    client = MlflowClient(tracking_uri=uri)
    runs: list[RunRecord] = []
    try:
        for exp in client.search_experiments(view_type=ViewType.ACTIVE_ONLY):
            for r in search_all_runs(client, [exp.experiment_id]):
                runs.append(RunRecord(r.info.run_id, exp.name, r.info.run_name or "", r.info.status,
                                      int(r.info.start_time or 0), dict(r.data.params), dict(r.data.metrics),
                                      {k: v for k, v in r.data.tags.items()}))
    except Exception as e:  # noqa: BLE001 - mlflow's errors (HTML pages, SQL) become one line naming the store
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise TrackingUnavailable(f"MLflow store {uri} could not be read ({type(e).__name__}: {first}). Check that "
                                  f"it is an MLflow store. {WHERE_HINT}") from None
    runs.sort(key=lambda r: (r.experiment, r.start_time, r.run_id))

    def history(run_id: str, key: str) -> list[tuple[int, float]]:
        last: dict[int, tuple[int, float]] = {}
        for m in client.get_metric_history(run_id, key):
            if m.step not in last or m.timestamp >= last[m.step][0]:
                last[m.step] = (m.timestamp, m.value)
        return [(s, v) for s, (_, v) in sorted(last.items())]

    return Store(uri, runs, history)


__all__ = ["KERNELS", "MOE_LAYER", "RunRecord", "Store", "load"]
