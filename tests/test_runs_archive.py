"""fp4moe.runs.archive: a store's runs written to JSON and loaded into another store give the same params, tags
and metric histories; loading twice adds nothing; bad input is a clear error and leaves nothing half-imported."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("mlflow")

from fp4moe.runs import archive  # noqa: E402


def _store_with_runs(tmp_path):
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    uri = f"sqlite:///{tmp_path / 'src.db'}"
    c = MlflowClient(tracking_uri=uri)
    exp = c.create_experiment("proxy_t1_1gpu")
    ids = []
    for recipe, oom in (("fp8", True), ("mxfp4", False)):
        r = c.create_run(exp, run_name=f"cell {recipe}", start_time=1_000 + len(ids))
        c.log_batch(r.info.run_id,
                    params=[Param("parallel.micro_batch", "34"), Param("precision.name", recipe)],
                    tags=[RunTag("recipe", recipe), RunTag("recompute", "attn_ln_mlp"), RunTag("model", "proxy_h200"),
                          RunTag("hardware", "1 x NVIDIA H200 (140 GiB)")] + ([RunTag("outcome", "OOM")] if oom else []),
                    metrics=[Metric("loss", 10.0 - s / 3, 5_000 + s, s) for s in range(1, 6)]
                    + [Metric("summary/tgs_median", 71029.9, 6_000, 5)])
        c.set_terminated(r.info.run_id, status="FAILED" if oom else "FINISHED", end_time=9_000)
        ids.append(r.info.run_id)
    return uri, ids


def _runs(uri):
    from fp4moe.report.store import load

    return {r.tags[archive.ARCHIVED_ID] if archive.ARCHIVED_ID in r.tags else r.run_id: r
            for r in load(uri).runs}


def test_export_then_import_round_trips_and_is_idempotent(tmp_path):
    from mlflow import MlflowClient

    uri, ids = _store_with_runs(tmp_path)
    out = tmp_path / "results" / "proxy_t1.json"
    assert archive.export(uri, out, note="H200, commit abc, bash tools/device/h200_p3.sh t1cells") == 2
    doc = json.loads(out.read_text())
    assert doc["format"] == archive.FORMAT and doc["note"].startswith("H200")
    target = f"sqlite:///{tmp_path / 'dst.db'}"
    assert archive.import_files(archive.expand([out.parent]), target, log=lambda s: None) == (2, 0)
    assert archive.import_files([out], target, log=lambda s: None) == (0, 2)   # nothing twice
    src, dst = _runs(uri), _runs(target)
    assert sorted(dst) == sorted(ids)
    cs, cd = MlflowClient(tracking_uri=uri), MlflowClient(tracking_uri=target)
    for rid in ids:
        a, b = src[rid], dst[rid]
        assert (a.experiment, a.name, a.status, a.start_time, a.params, a.metrics) == \
               (b.experiment, b.name, b.status, b.start_time, b.params, b.metrics)
        assert {k: v for k, v in b.tags.items() if not k.startswith("fp4moe.")} == a.tags
        assert b.tags[archive.ARCHIVE_FILE] == "proxy_t1.json"
        hist = lambda c, r: [(m.step, m.value, m.timestamp) for m in sorted(c.get_metric_history(r, "loss"),  # noqa: E731
                                                                            key=lambda m: m.step)]
        assert hist(cs, rid) == hist(cd, b.run_id) and len(hist(cs, rid)) == 5
    # archived again from the second store, the original id is kept: a third store still de-duplicates by it
    again = tmp_path / "again.json"
    archive.export(target, again, note="re-archived")
    third = f"sqlite:///{tmp_path / 'third.db'}"
    archive.import_files([out], third, log=lambda s: None)
    assert archive.import_files([again], third, log=lambda s: None) == (0, 2)


def test_import_takes_its_target_as_export_takes_a_store(tmp_path, capsys):
    """``import --uri`` takes a folder or a ``.db`` file as ``export`` and the report do (before, a folder went to
    MLflow as a file store, which refuses to open: a traceback)."""
    uri, ids = _store_with_runs(tmp_path)
    out = tmp_path / "proxy_t1.json"
    archive.export(uri, out, note="H200")
    folder, db = tmp_path / "store", tmp_path / "other" / "runs.db"
    folder.mkdir()
    for target in (folder, db):
        assert archive.main(["import", str(out), "--uri", str(target)]) == 0
        assert capsys.readouterr().out.endswith("imported 2 runs, 0 already there\n")
    assert sorted(_runs(f"sqlite:///{folder / 'mlflow.db'}")) == sorted(_runs(f"sqlite:///{db}")) == sorted(ids)
    assert sorted(p.name for p in folder.iterdir()) == ["mlflow.db"]


def test_bad_input_is_a_clear_error_and_nothing_is_half_imported(tmp_path):
    uri, _ = _store_with_runs(tmp_path)
    other = tmp_path / "results"
    other.mkdir()
    (other / "kernels.json").write_text(json.dumps({"env": {}}))   # another kind of results file: left alone
    assert archive.expand([other]) == []
    with pytest.raises(archive.ArchiveError, match="not a runs archive"):
        archive.load(other / "kernels.json")
    with pytest.raises(archive.ArchiveError, match="no such file"):
        archive.expand([tmp_path / "missing.json"])
    with pytest.raises(archive.ArchiveError, match="no MLflow store"):
        archive.export(tmp_path / "nowhere.db", tmp_path / "x.json", note="")
    with pytest.raises(archive.ArchiveError, match="no runs in experiments"):
        archive.export(uri, tmp_path / "x.json", note="", experiments=["absent"])
    notes = tmp_path / "notes.db"  # a file that is not an SQLite database: SQLAlchemy's traceback before
    notes.write_text("not a database\n")
    with pytest.raises(archive.ArchiveError, match=f"^{notes}: MLflow store .* cannot be read as an SQLite database"):
        archive.export(notes, tmp_path / "x.json", note="")
    assert not (tmp_path / "x.json").exists()
    # a file that is not an archive is refused before the target store is opened: no new empty store is left behind
    assert archive.main(["import", str(other / "kernels.json"), "--uri", f"sqlite:///{tmp_path / 'new.db'}"]) == 2
    assert not (tmp_path / "new.db").exists()
    out = tmp_path / "a.json"
    archive.export(uri, out, note="")
    doc = json.loads(out.read_text())
    doc["runs"][1]["metrics"]["loss"][2][1] = "not a number"
    out.write_text(json.dumps(doc))
    target = f"sqlite:///{tmp_path / 'dst.db'}"
    with pytest.raises(ValueError):
        archive.import_files([out], target, log=lambda s: None)
    from fp4moe.report.store import load

    assert [r.tags[archive.ARCHIVED_ID] for r in load(target).runs] == [doc["runs"][0]["run_id"]]
    assert archive.main(["import", str(other / "kernels.json"), "--uri", target]) == 2


def test_several_stores_go_into_one_archive(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    uri_a, ids_a = _store_with_runs(tmp_path / "a")
    uri_b, ids_b = _store_with_runs(tmp_path / "b")
    out = tmp_path / "seed.json"
    assert archive.main(["export", uri_a, str(tmp_path / "b" / "src.db"), str(out), "--note", "one seed"]) == 0
    doc = json.loads(out.read_text())
    assert sorted(r["run_id"] for r in doc["runs"]) == sorted(ids_a + ids_b)
    target = f"sqlite:///{tmp_path / 'dst.db'}"
    assert archive.import_files([out], target, log=lambda s: None) == (4, 0)
    # one store of the list missing: an error, and no archive
    with pytest.raises(archive.ArchiveError, match="no MLflow store"):
        archive.export([uri_a, tmp_path / "nowhere.db"], tmp_path / "x.json", note="")
    assert not (tmp_path / "x.json").exists()


def test_withdrawn_metrics_stay_in_the_file_and_are_not_imported(tmp_path, capsys):
    uri, ids = _store_with_runs(tmp_path)
    out = tmp_path / "f5.json"
    archive.export(uri, out, note="H200")
    before = json.loads(out.read_text())["runs"]
    assert archive.main(["withdraw", str(out), "--metric", "summary/tgs_median",
                         "--reason", "leak inflated it"]) == 0
    assert "withdrawn in 2 runs" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["runs"] == before  # the measured values are kept as they were
    assert doc["withdrawn_metrics"] == [{"keys": ["summary/tgs_median"], "reason": "leak inflated it"}]
    target = f"sqlite:///{tmp_path / 'dst.db'}"
    archive.import_files([out], target, log=lambda s: None)
    for r in _runs(target).values():
        assert "summary/tgs_median" not in r.metrics and "loss" in r.metrics
        assert r.tags[archive.WITHDRAWN] == "summary/tgs_median: leak inflated it"
    # a metric no run has (a typo) and an empty reason are errors; the file is unchanged by them
    assert archive.main(["withdraw", str(out), "--metric", "summary/peak_mem_gb", "--reason", "x"]) == 2
    assert "no run has metric(s) ['summary/peak_mem_gb']" in capsys.readouterr().err
    with pytest.raises(archive.ArchiveError, match="--reason"):
        archive.withdraw(out, ["loss"], "  ")
    assert json.loads(out.read_text()) == doc


def test_xz_archive_is_the_same_archive_compressed(tmp_path):
    uri, ids = _store_with_runs(tmp_path)
    folder = tmp_path / "results"
    plain, packed = folder / "a.json", folder / "b.json.xz"
    archive.export(uri, plain, note="H200")
    archive.export(uri, packed, note="H200")
    assert packed.read_bytes()[:6] == b"\xfd7zXZ\x00"
    strip = lambda d: {k: v for k, v in d.items() if k != "exported_utc"}  # noqa: E731
    assert strip(archive.load(packed)) == strip(archive.load(plain))
    assert archive.expand([folder]) == [plain, packed] and archive.expand([packed]) == [packed]
    target = f"sqlite:///{tmp_path / 'dst.db'}"
    assert archive.import_files([packed], target, log=lambda s: None) == (2, 0)
    assert archive.import_files([plain], target, log=lambda s: None) == (0, 2)  # the same runs
    assert archive.main(["withdraw", str(packed), "--metric", "loss", "--reason", "r"]) == 0
    assert archive.withdrawn(archive.load(packed)) == {"loss": "r"}
    with pytest.raises(archive.ArchiveError, match=r"\.json\.xz"):
        archive.export(uri, tmp_path / "c.xz", note="")
    assert not (tmp_path / "c.xz").exists()
    (folder / "broken.json.xz").write_bytes(packed.read_bytes()[:100])
    with pytest.raises(archive.ArchiveError, match="cannot read"):
        archive.load(folder / "broken.json.xz")
    # a damaged archive in a folder is not skipped: importing the folder names it
    assert archive.expand([folder]) == [plain, packed, folder / "broken.json.xz"]
    assert archive.main(["import", str(folder), "--uri", target]) == 2


def test_export_names_the_checkout_portably_and_the_store_keeps_its_paths(tmp_path, monkeypatch):
    """Archives go into results/: the trainer's absolute paths (data, checkpoints, store) become ``<repo>/...`` in
    params, tags and the note; metrics and the store itself are untouched, and the report still names the corpus build."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    from fp4moe.report.tables import data_label

    repo = tmp_path / "checkout"
    monkeypatch.setenv("FP4MOE_HOME", str(repo))
    uri = f"sqlite:///{tmp_path / 'src.db'}"
    c = MlflowClient(tracking_uri=uri)
    r = c.create_run(c.create_experiment("proxy_f5_1gpu"), run_name="f5 mxfp4")
    prefix = f"{repo}/data/code_docs/hf-f525a8e40ed2/train"
    c.log_batch(r.info.run_id, params=[Param("data.dataset_prefix", prefix), Param("data.name", "code_docs"),
                                       Param("tracking.uri", f"sqlite:///{repo}/logs/device/mlflow.db")],
                tags=[RunTag("recipe", "mxfp4"), RunTag("env.FP4MOE_CKPT_DIR", f"{repo}/checkpoints")],
                metrics=[Metric("loss", 2.5, 5_000, 1)])
    out = repo / "results" / "f5.json.xz"
    archive.export(uri, out, note=f"H200; python -m fp4moe.runs.archive export {repo}/logs/device/mlflow.db")
    doc = archive.load(out)
    run = doc["runs"][0]
    assert doc["note"] == "H200; python -m fp4moe.runs.archive export <repo>/logs/device/mlflow.db"
    assert run["params"] == {"data.dataset_prefix": "<repo>/data/code_docs/hf-f525a8e40ed2/train",
                             "data.name": "code_docs", "tracking.uri": "sqlite:///<repo>/logs/device/mlflow.db"}
    assert run["tags"]["env.FP4MOE_CKPT_DIR"] == "<repo>/checkpoints" and run["tags"]["recipe"] == "mxfp4"
    assert run["metrics"] == {"loss": [[1, 2.5, 5_000]]}
    assert str(repo) not in json.dumps(doc)
    assert data_label(run["params"]) == data_label({"data.dataset_prefix": prefix, "data.name": "code_docs"}) \
        == "code_docs (hf-f525a8e40ed2)"
    assert c.get_run(r.info.run_id).data.params["data.dataset_prefix"] == prefix


def test_one_run_is_in_one_archive(tmp_path):
    """A store and a store that imported its runs (or one store twice) cannot go into one archive, and archives that
    share a run are refused before anything is imported: the report compares runs within an archive, so a run in two
    would be read under one of them only."""
    uri, ids = _store_with_runs(tmp_path)
    first = tmp_path / "first.json"
    archive.export(uri, first, note="")
    imported = f"sqlite:///{tmp_path / 'imported.db'}"
    archive.import_files([first], imported, log=lambda s: None)
    for stores in ([uri, imported], [uri, uri]):
        with pytest.raises(archive.ArchiveError, match=rf"run ({ids[0]}|{ids[1]}) \(cell \w+\) is in both .*one run, one archive"):
            archive.export(stores, tmp_path / "both.json", note="")
        assert not (tmp_path / "both.json").exists()
    second = tmp_path / "second.json"
    archive.export(imported, second, note="the same runs, archived again")
    target = f"sqlite:///{tmp_path / 'dst.db'}"
    with pytest.raises(archive.ArchiveError, match=f"is in both {first} and {second}: one run, one archive"):
        archive.import_files([first, second], target, log=lambda s: None)
    from fp4moe.report.store import load

    assert load(target).runs == []   # refused before anything was imported
    assert archive.main(["import", str(first), str(tmp_path / "." / first.name), "--uri", target]) == 0
    assert sorted(_runs(target)) == sorted(ids)   # one file named twice: imported once


def test_an_archive_that_replaces_another_takes_its_runs_over(tmp_path):
    """Runs merged into a new archive (the old one removed): a store that imported the old one reports them under the
    new name, beside the run they were merged with, as a fresh store would."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    uri_a, ids_a = _store_with_runs(tmp_path / "a")
    uri_b, ids_b = _store_with_runs(tmp_path / "b")
    old = tmp_path / "seed_part.json"
    archive.export(uri_a, old, note="two runs of a seed")
    target = f"sqlite:///{tmp_path / 'dst.db'}"
    assert archive.import_files([old], target, log=lambda s: None) == (2, 0)
    # the merge: the old archive's runs (imported into a store) and the new runs, in one file; the old file goes
    merged_store = f"sqlite:///{tmp_path / 'merge.db'}"
    archive.import_files([old], merged_store, log=lambda s: None)
    merged = tmp_path / "seed.json"
    assert archive.export([merged_store, uri_b], merged, note="the whole seed") == 4
    old.unlink()
    lines = []
    assert archive.import_files([merged], target, log=lines.append) == (2, 2)
    assert sum("now reported as this archive's" in line for line in lines) == 2
    runs = _runs(target)
    assert sorted(runs) == sorted(ids_a + ids_b)
    assert {r.tags[archive.ARCHIVE_FILE] for r in runs.values()} == {"seed.json"}
    lines.clear()
    assert archive.import_files([merged], target, log=lines.append) == (0, 4)   # again: nothing moves
    assert not any("now reported" in line for line in lines)


def test_reproduce_names_archives_that_share_a_run_in_one_line(tmp_path, monkeypatch, capsys):
    """make reproduce-table's archive step: two archives in results/train_proxy/ holding one run fail the step with
    the message (both files and the fix), no traceback, and nothing imported."""
    from fp4moe.reproduce import pipeline

    uri, _ = _store_with_runs(tmp_path)
    home = tmp_path / "home"
    folder = home / pipeline.RESULTS_TRAIN
    folder.mkdir(parents=True)
    archive.export(uri, folder / "a.json.xz", note="")
    archive.export(uri, folder / "b.json.xz", note="the same runs again")
    target = tmp_path / "store.db"
    monkeypatch.setenv("FP4MOE_HOME", str(home))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{target}")
    assert pipeline.load_trainer_archives(track=True) is False
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    failed = [line for line in out.out.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and "a.json.xz and" in failed[0] and "b.json.xz: one run, one archive" in failed[0]
    from fp4moe.report.store import load

    assert load(f"sqlite:///{target}").runs == []
