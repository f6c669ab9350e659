"""fp4moe.train.metrics.Tracker against a real MLflow SQLite store: metrics and tags written by the background
thread arrive complete and in step order, ``flush`` makes them visible before the run ends; a store that fails
mid-run sends the rest to the pending file, which ``python -m fp4moe.train.metrics FILE`` logs into the run once the
store is back, and without a pending file (or one that cannot be written) the failure stops the run with an error
that names the store and the last step it holds (nothing is dropped silently). No torch needed."""
from __future__ import annotations

import json
import logging
import sqlite3
import threading

import pytest

from fp4moe.tracking.mlflow_store import TrackingUnavailable
from fp4moe.train.metrics import PENDING_FILE, Tracker, TrackingError, main, replay_pending


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
    with pytest.raises(TrackingError, match=r"writing the metrics of step 4 to the MLflow store sqlite:///.*mlflow\.db "
                                            r"failed \(MlflowException: .*no such table: metrics\); metrics in the "
                                            r"store: up to step 3\. Check the store"):
        t.flush()
    with pytest.raises(TrackingError, match="up to step 3"):
        t.log(5, {"loss": 5.0})
    with pytest.raises(TrackingError, match="up to step 3"):
        t.finish("FINISHED")
    assert _client(store).get_run(t.run_id).info.status == "FAILED"
    assert not any(th.name == "fp4moe-mlflow" for th in threading.enumerate())


def _two_steps_then_the_store_goes_away(tmp_path, store, pending, **kw) -> Tracker:
    """A tracker with ``pending`` that logged steps 1-2 into ``store``, whose folder (``tmp_path/mlruns``) then moves
    to ``tmp_path/away`` (SQLite refuses to write to a moved database)."""
    t = Tracker(store, "tracker_test", enabled=True, pending=pending, **kw)
    t.start("run", {}, {}, resume_run_id=None)
    for step in (1, 2):
        t.log(step, {"loss": float(step)})
    t.flush()
    (tmp_path / "mlruns").rename(tmp_path / "away")
    return t


def test_a_store_that_goes_away_keeps_the_rest_in_the_pending_file_until_it_is_back(tmp_path, store, caplog,
                                                                                   capsys):
    """The store's folder moves away after step 2 (SQLite refuses to write to a moved database): one warning line,
    steps 3-5, a tag and the run's end go to the pending file (a last line cut short by a kill is skipped); once the
    store is back, ``python -m fp4moe.train.metrics FILE`` logs them into the run and removes the file."""
    pending, folder = tmp_path / "ckpt" / PENDING_FILE, tmp_path / "mlruns"
    t = _two_steps_then_the_store_goes_away(tmp_path, store, pending)
    with caplog.at_level(logging.WARNING, logger="fp4moe.train"):
        for step in (3, 4, 5):
            t.log(step, {"loss": float(step)})
        t.set_tags({"stopped_by_signal": "15"})
        t.flush()
        said = [r.getMessage() for r in caplog.records if r.name == "fp4moe.train"]
        assert len(said) == 1
        t.finish("KILLED")
    first, last = [r.getMessage() for r in caplog.records if r.name == "fp4moe.train"]
    assert first.startswith(f"MLflow store {store} failed writing the metrics of step 3 (MlflowException: "
                            "(sqlite3.OperationalError) attempt to write a readonly database); training goes on")
    assert f"kept in {pending} (python -m fp4moe.train.metrics {pending} logs them later)" in first
    assert f"the metrics of steps 3-5 and the end (KILLED) of run {t.run_id} are in {pending}" in last
    assert [json.loads(line)["kind"] for line in pending.read_text().splitlines()] == \
        ["store", "metrics", "metrics", "metrics", "tags", "status"]
    with open(pending, "a") as f:
        f.write('{"kind": "metrics", "run_id": "')                # a kill mid-line

    (tmp_path / "away").rename(folder)
    assert main([str(pending)]) == 0 and not pending.exists()
    assert f"logged 5 records of {pending} into run {t.run_id}" in capsys.readouterr().out
    run = _client(store).get_run(t.run_id)
    assert run.info.status == "KILLED" and run.data.tags["stopped_by_signal"] == "15"
    assert _history(store, t.run_id, "loss") == [(s, float(s)) for s in range(1, 6)]
    assert main([str(pending)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_store_that_comes_back_mid_run_takes_the_pending_file_and_the_writes_go_live_again(tmp_path, store,
                                                                                            caplog):
    """As above, with the store back before the run ends: the writer's next retry (``retry_s=0``: before every write
    while failed) logs what the file kept into the run, removes the file and writes step 5 and the run's end to the
    store itself; while the store's database file is away, a retry creates nothing in its place."""
    pending, folder = tmp_path / "ckpt" / PENDING_FILE, tmp_path / "mlruns"
    t = _two_steps_then_the_store_goes_away(tmp_path, store, pending, retry_s=0)
    with caplog.at_level(logging.INFO, logger="fp4moe.train"):
        for step in (3, 4):
            t.log(step, {"loss": float(step)})
        t.set_tags({"note": "kept"})
        t.flush()
        assert pending.is_file() and not folder.exists()  # the retries before step 4 and the tag made no new store
        (tmp_path / "away").rename(folder)
        t.log(5, {"loss": 5.0})
        t.flush()
        assert not pending.exists()
        assert _history(store, t.run_id, "loss") == [(s, float(s)) for s in range(1, 6)]  # before the run ends
        t.finish("FINISHED")
    said = [r.getMessage() for r in caplog.records if r.name == "fp4moe.train"]
    assert len(said) == 2, said
    assert said[0].startswith(f"MLflow store {store} failed writing the metrics of step 3")
    assert said[1] == (f"MLflow store {store} is back: the 3 records (steps 3-4) that {pending} kept are logged into "
                       f"run {t.run_id}, and its writes go to the store again")
    run = _client(store).get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["note"] == "kept"
    assert not pending.exists()


def test_a_pending_file_of_a_run_the_store_lacks_stays(tmp_path, shared, store):
    """Replaying into a store without the file's run: one line naming the run, the store and the fix; the file
    stays. A resumed run's tracker replays before it starts, so it stops there too."""
    pending = tmp_path / PENDING_FILE
    t = Tracker(shared, "tracker_test", enabled=True)
    t.start("run", {}, {}, resume_run_id=None)
    t.finish("FINISHED")
    pending.write_text(json.dumps({"kind": "metrics", "run_id": t.run_id, "step": 1, "time": 0,
                                   "metrics": {"loss": 1.0}}) + "\n")
    with pytest.raises(TrackingUnavailable, match=rf"MLflow store {store} has no run {t.run_id}, which {pending} "
                                                  r"belongs to \(.*\): pass that run's store with --tracking-uri"):
        replay_pending(pending, store)
    with pytest.raises(TrackingUnavailable, match="has no run"):
        Tracker(store, "tracker_test", enabled=True, pending=pending).start("run", {}, {}, resume_run_id=t.run_id)
    assert pending.is_file()
    assert replay_pending(pending, shared) == (1, [t.run_id]) and not pending.exists()


def test_a_pending_file_that_cannot_be_written_stops_the_run(tmp_path, store):
    (tmp_path / "a_file").write_text("")
    t = Tracker(store, "tracker_test", enabled=True, pending=tmp_path / "a_file" / PENDING_FILE)
    t.start("run", {}, {}, resume_run_id=None)
    t.log(1, {"loss": 1.0})
    t.flush()
    (tmp_path / "mlruns").rename(tmp_path / "away")
    t.log(2, {"loss": 2.0})
    with pytest.raises(TrackingError, match=rf"MLflow store {store} failed writing the metrics of step 2 \(.*\), and "
                                            rf"{tmp_path / 'a_file' / PENDING_FILE} cannot keep what it could not take "
                                            r"\(FileExistsError: .*\); metrics in the store: up to step 1"):
        t.flush()
    with pytest.raises(TrackingError):
        t.finish("FINISHED")
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
