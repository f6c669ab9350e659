"""fp4moe.tracking.bench_log: a kernel-benchmark JSON into MLflow, once (CPU, temporary sqlite store)."""

from __future__ import annotations

import json

import pytest

from fp4moe.tracking import bench_log

ENV = {
    "date": "2026-11-30T12:00:00Z", "commit": "0123456789abcdef0123456789abcdef01234567",
    "gpu": "NVIDIA H200", "gpu_count": 1, "torch": "2.11.0+cu130", "triton": "3.6.0",
    "cuda": "13.0", "python": "3.12.3", "command": "python -m fp4moe_kernels.bench.conversions --no-peers",
    "timing": "cuda-graph",
}
ROWS = [  # hand-written, not measured: the numbers only need to round-trip
    {"shape": "256x7168", "kernel": "bf16_to_fp4_row", "impl": "fp4moe", "ms": 0.002,
     "bytes": 4644864, "gbps": 2322.4, "pct_copy": 60.5, "note": "", "extra": {}},
    {"shape": "256x7168", "kernel": "fp4_row_to_fp8_row", "impl": "fp4moe", "ms": 0.0015,
     "bytes": 2924544, "gbps": 1949.7, "pct_copy": 50.8, "note": "", "extra": {}},
    {"shape": "256x7168", "kernel": "fp4_row_to_fp8_row", "impl": "torch eager (unfused)",
     "ms": 0.25, "bytes": 2924544, "gbps": 11.7, "pct_copy": 0.3, "note": "", "extra": {}},
    {"shape": "256x2048 ragged 4e", "kernel": "fp4_row_to_fp8_col", "impl": "fp4moe", "ms": 0.004,
     "bytes": 1000000, "gbps": 250.0, "pct_copy": 6.5, "note": "tiny shape", "extra": {}},
]
PAYLOAD = {"env": ENV, "copy_gbps": 3840.0, "rows": ROWS, "summary": [], "notes": ["no torchao"],
           "sweep": []}


@pytest.fixture
def store(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@pytest.fixture
def bench_file(tmp_path):
    folder = tmp_path / "results" / "kernels"
    folder.mkdir(parents=True)
    path = folder / "kernels_h200_2026-11-30.json"
    path.write_text(json.dumps(PAYLOAD, indent=1))
    (folder / "kernels_h200_2026-11-30.md").write_text("# Kernel benchmark: NVIDIA H200\n")
    return path


def _runs(uri):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("kernels")
    return client, ([] if experiment is None else
                    client.search_runs([experiment.experiment_id], max_results=1000))


def test_one_run_per_row_and_a_summary(store, bench_file):
    result = bench_log.log_file(bench_file)
    assert len(result.logged) == len(ROWS) + 1 and result.existing == 0
    client, runs = _runs(store)
    assert len(runs) == len(ROWS) + 1
    assert all(r.info.status == "FINISHED" for r in runs)
    rows = {r.info.run_name: r for r in runs if r.data.tags["kind"] == "row"}
    assert set(rows) == {f"{r['shape']}/{r['kernel']}/{r['impl']}" for r in ROWS}

    for src in ROWS:
        run = rows[f"{src['shape']}/{src['kernel']}/{src['impl']}"]
        params = run.data.params
        assert {k: params[k] for k in ("shape", "kernel", "impl")} == {
            k: src[k] for k in ("shape", "kernel", "impl")}
        assert {k: params[k] for k in ("gpu", "commit", "date", "command")} == {
            k: ENV[k] for k in ("gpu", "commit", "date", "command")}
        assert params["bytes"] == str(src["bytes"])
        assert run.data.metrics == {"time_us": pytest.approx(src["ms"] * 1e3),
                                    "gbps": src["gbps"], "pct_copy": src["pct_copy"]}
        tags = run.data.tags
        assert tags["bench_id"] == result.bench_id
        assert tags["source_file_sha256"] and tags["source_file"] == bench_file.name
        # the benchmark machine's facts, not the logging machine's
        assert tags["mlflow.source.git.commit"] == ENV["commit"]
        assert (tags["torch"], tags["python"]) == (ENV["torch"], ENV["python"])
    assert rows["256x2048 ragged 4e/fp4_row_to_fp8_col/fp4moe"].data.params["note"] == "tiny shape"

    [summary] = [r for r in runs if r.data.tags["kind"] == "summary"]
    assert summary.info.run_name == f"summary {ENV['gpu']} {ENV['date']}"
    assert summary.data.metrics == {"copy_gbps": 3840.0}
    assert summary.data.params["gpu_count"] == "1" and summary.data.params["timing"] == "cuda-graph"
    assert summary.data.params["rows"] == str(len(ROWS))
    assert summary.data.params["notes"] == "no torchao"
    artifacts = sorted(a.path for a in client.list_artifacts(summary.info.run_id))
    assert artifacts == ["kernels_h200_2026-11-30.json", "kernels_h200_2026-11-30.md"]


def test_second_log_adds_nothing(store, bench_file, capsys):
    bench_log.log_file(bench_file)
    again = bench_log.log_file(bench_file)
    assert again.logged == [] and again.existing == len(ROWS) + 1 and again.notes == []
    assert bench_log.main([str(bench_file)]) == 0
    assert "already logged" in capsys.readouterr().out
    assert len(_runs(store)[1]) == len(ROWS) + 1


def test_same_measurement_other_bytes_adds_nothing(store, bench_file, tmp_path):
    bench_log.log_file(bench_file)
    copy = tmp_path / "kernels_h200_copy.json"
    copy.write_text(json.dumps(PAYLOAD))  # same env.date + commit + gpu, other formatting
    again = bench_log.log_file(copy)
    assert again.logged == [] and "other bytes" in again.notes[0]
    assert len(_runs(store)[1]) == len(ROWS) + 1


def test_another_benchmark_run_is_logged(store, bench_file, tmp_path):
    bench_log.log_file(bench_file)
    later = tmp_path / "kernels_h200_later.json"
    later.write_text(json.dumps({**PAYLOAD, "env": {**ENV, "date": "2026-12-01T08:00:00Z"}}))
    assert len(bench_log.log_file(later).logged) == len(ROWS) + 1
    assert len(_runs(store)[1]) == 2 * (len(ROWS) + 1)


def test_interrupted_log_is_completed(store, bench_file):
    bench_log.log_file(bench_file)
    client, runs = _runs(store)
    lost = next(r for r in runs if r.info.run_name == "256x7168/fp4_row_to_fp8_row/fp4moe")
    client.delete_run(lost.info.run_id)
    again = bench_log.log_file(bench_file)
    assert len(again.logged) == 1
    names = sorted(r.info.run_name for r in _runs(store)[1])
    assert len(names) == len(set(names)) == len(ROWS) + 1


def test_cli_takes_a_folder(store, bench_file):
    assert bench_log.main([str(bench_file.parent)]) == 0
    assert len(_runs(store)[1]) == len(ROWS) + 1


def test_bad_input_logs_nothing(store, tmp_path, capsys):
    bad = tmp_path / "kernels_bad.json"
    bad.write_text(json.dumps({"env": {"date": "d"}, "rows": []}))
    with pytest.raises(bench_log.BenchFileError, match="env lacks"):
        bench_log.log_file(bad)
    no_ms = tmp_path / "kernels_no_ms.json"
    row = {k: v for k, v in ROWS[0].items() if k != "ms"}
    no_ms.write_text(json.dumps({**PAYLOAD, "rows": [row]}))
    with pytest.raises(bench_log.BenchFileError, match=r"row 0 lacks \['ms'\]"):
        bench_log.log_file(no_ms)
    assert bench_log.main([str(bad), str(tmp_path / "missing.json")]) == 1
    assert bench_log.main([str(bad)]) == 1
    assert "NOT logged" in capsys.readouterr().out
    assert bench_log.main([str(tmp_path / "empty_dir_that_is_missing")]) == 1
    assert _runs(store)[1] == []
