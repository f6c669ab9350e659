"""fp4moe.train.metrics.Tracker against a real MLflow SQLite store: metrics and tags written by the background
thread arrive complete and in step order, ``flush`` makes them visible before the run ends, and a store that fails
mid-run stops the run with an error that names the store and the last step it holds (nothing is dropped silently).
No torch needed."""
from __future__ import annotations

import sqlite3
import threading

import pytest

from fp4moe.train.metrics import Tracker, TrackingError


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> str:
    """One store for the tests that leave it intact (creating an MLflow SQLite store takes seconds)."""
    folder = tmp_path_factory.mktemp("tracker_store")
    return f"sqlite:///{folder / 'mlflow.db'}"


def _client(uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _history(uri, run_id, key):
    return [(m.step, m.value) for m in sorted(_client(uri).get_metric_history(run_id, key), key=lambda m: m.step)]


@pytest.mark.parametrize("background", [True, False])
def test_every_step_reaches_the_store_in_order(shared, background):
    store = shared
    t = Tracker(store, "tracker_test", enabled=True, background=background)
    t.start("run", {"a": "1"}, {"hardware": "cpu"}, resume_run_id=None)
    assert (t._thread is not None) == background
    for step in range(1, 41):
        t.log(step, {"loss": 10.0 - step / 10, "lr": 1e-3 * step, "skipped": None})
    t.set_tags({"profile_dir": "/x"})
    t.flush()  # visible before the run ends
    assert [s for s, _ in _history(store, t.run_id, "loss")] == list(range(1, 41))
    assert _client(store).get_run(t.run_id).info.status == "RUNNING"
    t.log(41, {"summary/final_loss": 5.9})
    t.finish("FINISHED")
    run = _client(store).get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["profile_dir"] == "/x"
    assert _history(store, t.run_id, "loss")[-1] == (40, pytest.approx(6.0))
    assert _history(store, t.run_id, "summary/final_loss") == [(41, pytest.approx(5.9))]
    assert "skipped" not in run.data.metrics
    assert not any(th.name == "fp4moe-mlflow" for th in threading.enumerate())  # the writer thread has ended


def test_a_store_that_fails_mid_run_stops_the_run_with_a_named_error(store, tmp_path):
    t = Tracker(store, "tracker_test", enabled=True)
    t.start("run", {}, {}, resume_run_id=None)
    for step in (1, 2, 3):
        t.log(step, {"loss": float(step)})
    t.flush()
    with sqlite3.connect(tmp_path / "mlruns" / "mlflow.db") as db:  # the store breaks under the run
        db.execute("DROP TABLE metrics")
    t.log(4, {"loss": 4.0})  # queued: the failure shows at the next call
    with pytest.raises(TrackingError, match=r"(?s)writing metrics to the MLflow store sqlite:///.*mlflow\.db failed "
                                            r"\(.*\); metrics in the store: up to step 3"):
        t.flush()
    with pytest.raises(TrackingError, match="up to step 3"):
        t.log(5, {"loss": 5.0})
    with pytest.raises(TrackingError, match="up to step 3"):
        t.finish("FINISHED")
    assert _client(store).get_run(t.run_id).info.status == "FAILED"
    assert not any(th.name == "fp4moe-mlflow" for th in threading.enumerate())


def test_a_disabled_tracker_writes_nothing_and_starts_no_thread(shared):
    store = shared
    t = Tracker(store, "tracker_disabled", enabled=False)
    t.start("run", {}, {}, resume_run_id=None)
    t.log(1, {"loss": 1.0})
    t.set_tags({"x": "y"})
    t.flush()
    t.finish("FINISHED")
    assert t.run_id is None and t._thread is None
    assert _client(store).search_experiments(filter_string="name = 'tracker_disabled'") == []


def test_the_thread_switch(shared, monkeypatch):
    """FP4MOE_TRACKING_THREAD: unset / 1 the writer thread, 0 the training loop writes; a typo names the variable."""
    from fp4moe.train.metrics import tracking_thread

    monkeypatch.delenv("FP4MOE_TRACKING_THREAD", raising=False)
    assert tracking_thread() and Tracker(shared, "x", enabled=True).background
    monkeypatch.setenv("FP4MOE_TRACKING_THREAD", "0")
    assert not Tracker(shared, "x", enabled=True).background
    monkeypatch.setenv("FP4MOE_TRACKING_THREAD", "yes")
    with pytest.raises(ValueError, match="FP4MOE_TRACKING_THREAD='yes': use 1"):
        tracking_thread()
