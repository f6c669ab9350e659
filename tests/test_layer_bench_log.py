"""MoE layer benchmark JSON -> MLflow (fp4moe.tracking.layer_bench_log): real runs in a local store, idempotent."""
from __future__ import annotations

import json

import pytest

from fp4moe.tracking import layer_bench_log as L


def _doc(tmp_path, name="moe_layer_h200_ep2_2026-11-30_abc1234.json"):
    doc = {"env": {"date": "2026-11-30", "commit": "abc1234", "gpu": "h200", "world_size": 2, "command": "x"},
           "shape": {"hidden": 7168, "tokens": 4096},
           "recipes": [{"recipe": r, "ms_per_iter": ms, "tokens_per_s": 4096 / ms * 1e3, "peak_gib": None,
                        "saved_bytes": 10} for r, ms in (("bf16", 30.0), ("fp8", 35.0), ("mxfp4", 37.0))]}
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def test_log_and_relog(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    p = _doc(tmp_path)
    assert L.log_file(p, uri) == (3, 0)
    assert L.log_file(p, uri) == (0, 3)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(L.EXPERIMENT)
    runs = {r.data.params["recipe"]: r for r in client.search_runs([exp.experiment_id])}
    assert sorted(runs) == ["bf16", "fp8", "mxfp4"]
    assert runs["fp8"].data.metrics["ms_per_iter"] == 35.0 and runs["fp8"].data.params["world_size"] == "2"
    assert "peak_gib" not in runs["fp8"].data.metrics  # None: not logged


def test_shapes_of_one_commit_are_separate_benchmarks(tmp_path):
    """Two files of one date / commit / GPU / EP at two token counts are two benchmarks (two ids, both logged);
    a default-shape file keeps the id it had before the shape was part of it."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    a = _doc(tmp_path)
    doc = json.loads(a.read_text())
    doc["shape"]["tokens"] = 8192
    b = tmp_path / "moe_layer_h200_ep2_t8192_2026-11-30_abc1234.json"
    b.write_text(json.dumps(doc))
    assert L.log_file(a, uri) == (3, 0) and L.log_file(b, uri) == (3, 0)
    env = doc["env"]
    import hashlib

    old = hashlib.sha256(f"{env['date']}|{env['commit']}|{env['gpu']}|{env['world_size']}".encode()).hexdigest()[:16]
    assert L.layer_bench_id(env, dict(L.DEFAULT_SHAPE)) == L.layer_bench_id(env) == old
    assert L.layer_bench_id(env, {"tokens": 8192}) != old


def test_a_variant_of_one_commit_is_its_own_benchmark(tmp_path):
    """The same date / commit / GPU / shape with --fp8-weight-cache is another benchmark: both files are logged (the
    second was skipped as 'already there' before), told apart by the variant param; the default path keeps its id."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    a = _doc(tmp_path)
    doc = json.loads(a.read_text())
    doc["env"]["fp8_weight_cache"] = True
    b = tmp_path / "moe_layer_h200_ep2_wcache_2026-11-30_abc1234.json"
    b.write_text(json.dumps(doc))
    assert L.log_file(a, uri) == (3, 0) and L.log_file(b, uri) == (3, 0)
    assert L.layer_bench_id(doc["env"]) != L.layer_bench_id(json.loads(a.read_text())["env"])
    from fp4moe.report.store import load
    from fp4moe.report.tables import f4_rows

    rows = f4_rows([r for r in load(uri).runs if r.experiment == L.EXPERIMENT])
    assert sorted(r["variant"] for r in rows) == ["", "fp8_weight_cache"]


def test_two_runs_of_one_day_and_commit_are_two_benchmarks_the_newest_measured_last(tmp_path):
    """Two files of one day, commit, GPU and variant (the benchmark run twice, or on two machines) with their
    ``measured_at``: both are logged (without it the second shared the first's id and was skipped as 'already
    there'), and the report's newest is the one measured last even when it is logged first (make reproduce-table logs
    files by name); a file without ``measured_at`` keeps its id and sorts before them, and one written as the second
    run of its day and commit before ``measured_at`` existed takes the time in its name."""
    from fp4moe.report import render
    from fp4moe.report.store import load
    from fp4moe.report.tables import f4_rows

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    old = _doc(tmp_path)
    early, late = (json.loads(old.read_text()) for _ in range(2))
    early["env"]["measured_at"], late["env"]["measured_at"] = "2026-11-30T09:00:05Z", "2026-11-30T17:30:00Z"
    late["recipes"][0]["tokens_per_s"] = 1.0  # tell the two apart
    a = tmp_path / "moe_layer_h200_ep2_2026-11-30_abc1234_173000.json"
    b = tmp_path / "moe_layer_h200_ep2_2026-11-30_abc1234_090005.json"
    a.write_text(json.dumps(late))
    b.write_text(json.dumps(early))
    ids = {L.layer_bench_id(d["env"]) for d in (json.loads(old.read_text()), early, late)}
    assert len(ids) == 3
    assert L.log_file(a, uri) == (3, 0) and L.log_file(b, uri) == (3, 0) and L.log_file(old, uri) == (3, 0)
    rows = f4_rows([r for r in load(uri).runs if r.experiment == L.EXPERIMENT])
    assert sorted(r["date"] for r in rows) == ["2026-11-30", "2026-11-30T09:00:05Z", "2026-11-30T17:30:00Z"]
    newest, rest = render._f4_latest(rows)
    assert [r["date"] for r in newest] == ["2026-11-30T17:30:00Z"] and newest[0]["tokens_per_s_bf16"] == 1.0
    assert len(rest) == 2
    # a file of before measured_at, a second run of its day and commit (_HHMMSS, the local time it was written)
    second = tmp_path / "moe_layer_h200_ep2_2026-11-30_abc1234_083201.json"
    second.write_text(old.read_text())
    assert L.load(second)["env"]["measured_at"] == "2026-11-30T08:32:01" and "measured_at" not in L.load(old)["env"]
    assert L.log_file(second, uri) == (3, 0)


def test_targets_read_each_recipes_fastest_gemm_backend(tmp_path):
    """A benchmark with fp8@deepgemm / mxfp4@deepgemm entries: the F4 targets read each recipe's fastest entry
    (fp8@deepgemm over bf16; mxfp4's fastest over fp8's fastest), the plain recipes' ratios stay as they were, and the
    report names the entries; without backend entries the fastest is the recipe itself."""
    from fp4moe.report import render
    from fp4moe.report.store import load
    from fp4moe.report.tables import f4_rows

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    a = _doc(tmp_path)
    doc = json.loads(a.read_text())
    doc["env"]["commit"] = "def5678"
    doc["recipes"] += [{"recipe": r, "ms_per_iter": ms, "tokens_per_s": 4096 / ms * 1e3, "saved_bytes": 10}
                       for r, ms in (("fp8@deepgemm", 25.0), ("mxfp4@deepgemm", 26.0))]
    b = tmp_path / "moe_layer_h200_ep2_2026-11-30_def5678.json"
    b.write_text(json.dumps(doc))
    assert L.log_file(a, uri) == (3, 0) and L.log_file(b, uri) == (5, 0)
    rows = {r["commit"]: r for r in f4_rows([r for r in load(uri).runs if r.experiment == L.EXPERIMENT])}
    plain, dg = rows["abc1234"], rows["def5678"]
    assert (plain["fp8_best"], plain["mxfp4_best"]) == ("fp8", "mxfp4")
    assert plain["tokens_per_s_fp8_best_over_bf16"] == pytest.approx(30 / 35)
    assert (dg["fp8_best"], dg["mxfp4_best"]) == ("fp8@deepgemm", "mxfp4@deepgemm")
    assert dg["tokens_per_s_fp8_best_over_bf16"] == pytest.approx(30 / 25)
    assert dg["tokens_per_s_mxfp4_best_over_fp8_best"] == pytest.approx(25 / 26)
    assert dg["tokens_per_s_fp8_over_bf16"] == pytest.approx(30 / 35)  # the plain recipe's ratio is kept
    text = "\n".join(render._f4_targets([plain, dg]))
    assert "1.200 (fp8@deepgemm, mxfp4@deepgemm) missed" in text and "0.857 missed" in text
    # a bf16 entry with a kernel switch (bf16+gsum) faster than plain bf16: fp8's fastest is read against it
    doc["env"]["commit"] = "0a1b2c3"
    doc["recipes"].append({"recipe": "bf16+gsum", "ms_per_iter": 28.0, "tokens_per_s": 4096 / 28.0 * 1e3,
                           "saved_bytes": 10})
    c = tmp_path / "moe_layer_h200_ep2_2026-11-30_0a1b2c3.json"
    c.write_text(json.dumps(doc))
    assert L.log_file(c, uri) == (6, 0)
    gs = {r["commit"]: r for r in f4_rows([r for r in load(uri).runs if r.experiment == L.EXPERIMENT])}["0a1b2c3"]
    assert (gs["bf16_best"], gs["fp8_best"]) == ("bf16+gsum", "fp8@deepgemm")
    assert gs["tokens_per_s_fp8_best_over_bf16"] == pytest.approx(28 / 25)
    assert gs["tokens_per_s_fp8_over_bf16"] == pytest.approx(30 / 35)
    assert "1.120 (bf16+gsum, fp8@deepgemm, mxfp4@deepgemm) missed" in "\n".join(render._f4_targets([gs]))


def test_bad_files(tmp_path):
    bad = tmp_path / "moe_layer_x.json"
    bad.write_text("{}")
    with pytest.raises(L.LayerBenchFileError, match="no 'env' key"):
        L.load(bad)
    with pytest.raises(L.LayerBenchFileError, match="no such file"):
        L.expand([tmp_path / "missing.json"])
    assert L.main([str(bad)]) == 1


def test_repo_results_load():
    """Every layer benchmark file committed under results/moe_layer/ is readable, and is a benchmark of its own (no
    two share an id: make reproduce-table would log only the first)."""
    from fp4moe.paths import results_dir

    from fp4moe.bench.moe_layer import _recipe_entries

    files = L.expand([results_dir() / "moe_layer"])
    assert files, "no results/moe_layer/moe_layer_*.json in the repo"
    for f in files:
        doc = L.load(f)
        # each row's label as the benchmark's --recipes spells it (a preset, @ a grouped_gemm value, + modifiers such as
        # +fused, which needs the file's --main-grads): the benchmark's own parser takes it (it exits on an unknown
        # preset, backend or modifier); fp8 and mxfp4 in each
        entries = [e for r in doc["recipes"] for e in _recipe_entries(r["recipe"], doc["env"].get("main_grads"))]
        names = {recipe.name for _, recipe, _, _ in entries}
        assert {"fp8", "mxfp4"} <= names <= {"bf16", "fp8", "mxfp4"}, f
    ids = [L.layer_bench_id(d["env"], d["shape"]) for d in map(L.load, files)]
    assert len(set(ids)) == len(files)
