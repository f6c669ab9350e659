"""Repository foundation: the paper-numbers config against the paper's tables, MLflow tracking, the CLI."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fp4moe.reproduce import pipeline
from fp4moe.tracking import mlflow_store

REPO = Path(__file__).resolve().parents[1]
NUMBERS = REPO / "conf" / "paper" / "numbers.yaml"
SOURCES = {"abstract", "secondary-summary", "sister-artifact"}   # conf/paper/numbers.yaml header


def _env_with_src() -> dict[str, str]:
    """Environment for a child Python that finds the packages with or without an install."""
    paths = [str(REPO / "src"), str(REPO / "kernels"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


# --- conf/paper/numbers.yaml holds the paper's tables ---------------------------------------------


@pytest.fixture(scope="module")
def numbers():
    # Imported here, not at the top: `make test-gpu` collects this file on the GPU image, which has
    # neither omegaconf nor mlflow (none of these tests is selected there).
    from omegaconf import OmegaConf

    return OmegaConf.load(NUMBERS)


T1_MEASURED = [  # (scope, recipe, TGS, peak memory % of 80 GB), the paper's T1
    ("attn_ln_experts", "bf16", 1122, 68.29),
    ("attn_ln_experts", "fp8", 1157, 74.20),
    ("attn_ln_experts", "mxfp4", 1156, 59.40),
    ("attn_ln_mlp", "mxfp4", 1248, 60.62),
    ("mla_up_proj", "mxfp4", 1302, 70.11),
]
T1_OOM = [(s, r) for s in ("attn_ln_mlp", "mla_up_proj") for r in ("bf16", "fp8")]


@pytest.mark.parametrize(("scope", "recipe", "tgs", "mem_pct"), T1_MEASURED)
def test_t1_measured_cells(numbers, scope, recipe, tgs, mem_pct):
    cell = numbers.t1.cells[scope][recipe]
    assert (cell.tgs, cell.peak_memory_pct, cell.oom) == (tgs, pytest.approx(mem_pct), False)


@pytest.mark.parametrize(("scope", "recipe"), T1_OOM)
def test_t1_light_scopes_are_oom_for_bf16_and_fp8(numbers, scope, recipe):
    cell = numbers.t1.cells[scope][recipe]
    assert cell.oom is True and cell.tgs is None and cell.peak_memory_pct is None


def test_t1_has_every_scope_and_recipe(numbers):
    assert set(numbers.t1.cells) == set(numbers.t1.scopes)
    for scope in numbers.t1.cells.values():
        assert set(scope) == set(numbers.t1.recipes) == {"bf16", "fp8", "mxfp4"}


def test_headline_agrees_with_t1(numbers):
    head, cells = numbers.headline, numbers.t1.cells
    assert head.source == "abstract"
    assert (head.tgs_fp8, head.tgs_mxfp4) == (1157, 1302)
    assert (head.tgs_fp8, head.tgs_mxfp4) == (cells.attn_ln_experts.fp8.tgs,
                                              cells.mla_up_proj.mxfp4.tgs)
    same_scope = cells.attn_ln_experts
    drop_pp = same_scope.mxfp4.peak_memory_pct - same_scope.fp8.peak_memory_pct
    assert head.peak_memory_change_pp == pytest.approx(drop_pp) == pytest.approx(-14.8)
    gb = numbers.t1.setup.gpu_memory_gb
    assert head.peak_memory_change_gb == pytest.approx(drop_pp / 100 * gb, abs=0.05)
    assert head.tgs_change_pct == pytest.approx(100 * (1302 / 1157 - 1), abs=0.05)


def test_t2_f3_f4_f5(numbers):
    assert numbers.t2.rows.mlp_and_shared_experts.peak_memory_change_vs_fp8_pct == -6.9
    assert numbers.t2.rows.all_moe.peak_memory_change_vs_fp8_pct == -7.2
    assert {r.peak_memory_change_vs_bf16_pct for r in numbers.t2.rows.values()} == {-11.0}
    assert (numbers.f3.fused_speedup_min, numbers.f3.fused_speedup_max) == (1.6, 1.9)
    assert (numbers.f4.expert_grouped_linear_speedup_min,
            numbers.f4.expert_grouped_linear_speedup_max) == (1.43, 1.53)
    f4 = numbers.f4
    assert (f4.dense_linear_overhead_min, f4.dense_linear_overhead_max) == (0.33, 0.36)
    assert dict(numbers.f5.loss_deviation_vs_bf16_pct) == {"fp8": 0.29, "mxfp4": 0.61}


def test_every_number_has_a_source(numbers):
    """Each number sits under a mapping (itself or an ancestor) whose `source` is a known label."""
    unlabelled = []

    def walk(node, path, source):
        if isinstance(node, dict):
            source = node.get("source", source)
            if "source" in node:
                assert node["source"] in SOURCES, f"{path}: source {node['source']!r}"
            for key, child in node.items():
                walk(child, f"{path}.{key}", source)
        elif isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, f"{path}[{i}]", source)
        elif isinstance(node, (int, float)) and not isinstance(node, bool) and source is None:
            unlabelled.append(path)

    from omegaconf import OmegaConf

    walk(OmegaConf.to_container(numbers), "numbers", None)
    assert not unlabelled, f"numbers without a source label: {unlabelled}"


# --- fp4moe.tracking.mlflow_store --------------------------------------------------------------------


@pytest.fixture
def git_repo(tmp_path, monkeypatch):
    """A one-commit git repo as FP4MOE_HOME, so the run's commit tag is known; returns its sha."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "pyproject.toml").write_text("[project]\nname = 'x'\n")

    def git(*args):
        return subprocess.run(["git", "-C", str(home), "-c", "user.name=t", "-c",
                               "user.email=t@example.invalid", *args],
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", "pyproject.toml")
    git("commit", "-q", "-m", "init")
    monkeypatch.setenv("FP4MOE_HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return git("rev-parse", "HEAD")


def test_default_uri_is_sqlite_under_repo(git_repo):
    uri = mlflow_store.tracking_uri()
    db = Path(os.environ["FP4MOE_HOME"]) / "mlruns" / "mlflow.db"
    assert uri == f"sqlite:///{db}" and db.parent.is_dir()


def test_log_run_round_trip(git_repo, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("FP4MOE_FUSED_SWIGLU_FP4", "1")  # kernel switches outside the config are recorded
    monkeypatch.setenv("FP4MOE_TILES", "x" * 6000)
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")

    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    artifact = tmp_path / "table.csv"
    artifact.write_text("a,b\n1,2\n")
    run_id = mlflow_store.log_run(
        "unit", "run-1", params={"recipe": "mxfp4", "m": 4096},
        metrics={"tgs": 1234.5, "skipped": None}, tags={"purpose": "test"},
        artifacts=[artifact], uri=uri,
    )
    run = MlflowClient(tracking_uri=uri).get_run(run_id)
    assert run.info.run_name == "run-1" and run.info.status == "FINISHED"
    assert run.data.params == {"recipe": "mxfp4", "m": "4096"}
    assert run.data.metrics == {"tgs": 1234.5}
    tags = run.data.tags
    assert tags["mlflow.source.git.commit"] == git_repo
    assert tags["purpose"] == "test" and tags["host"] == socket.gethostname()
    assert tags["python"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}")
    assert "torch" in tags
    assert tags["env.FP4MOE_FUSED_SWIGLU_FP4"] == "1" and tags["env.FP4MOE_TILES"] == "x" * mlflow_store.MAX_TAG_CHARS
    assert tags["env.TORCHINDUCTOR_COMPILE_THREADS"] == "1" and "env.HOME" not in tags
    names = [a.path for a in MlflowClient(tracking_uri=uri).list_artifacts(run_id)]
    assert names == ["table.csv"]
    assert (tmp_path / "store" / "artifacts").is_dir()  # artifacts beside the db, not in the cwd


def test_log_batched_sends_more_than_one_call_holds_in_as_few_calls_as_the_limits_allow(tmp_path):
    """250 params, 150 tags and 2500 metrics (over MLflow's per-call limits of 100 / 100 / 1000) all reach a real
    sqlite store, in three log_batch calls (the metrics' count decides), each within the limits."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("batched")).info.run_id
    sizes = []
    real = client.log_batch

    def counting(rid, metrics=(), params=(), tags=()):
        sizes.append((len(metrics), len(params), len(tags)))
        return real(rid, metrics=metrics, params=params, tags=tags)

    client.log_batch = counting
    mlflow_store.log_batched(client, run_id, params=[Param(f"p{i}", str(i)) for i in range(250)],
                             tags=[RunTag(f"t{i}", str(i)) for i in range(150)],
                             metrics=[Metric("loss", float(s), 0, s) for s in range(2500)])
    assert sizes == [(1000, 100, 100), (1000, 100, 50), (500, 50, 0)]
    run = client.get_run(run_id)
    assert len(run.data.params) == 250 and sum(k.startswith("t") for k in run.data.tags) == 150
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(2500))


def test_log_table_one_run_per_row(git_repo, tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rows = [
        {"scope": "attn_ln_mlp", "recipe": "fp8", "tgs": None, "mem_pct": None},
        {"scope": "attn_ln_mlp", "recipe": "mxfp4", "tgs": 10.0, "mem_pct": 60.5},
    ]
    ids = mlflow_store.log_table("table", rows, key_cols=["scope", "recipe"],
                                 metric_cols=["tgs", "mem_pct"], common_params={"gpu": "cpu"},
                                 tags={"kind": "unit"}, uri=uri)
    client = MlflowClient(tracking_uri=uri)
    runs = [client.get_run(i) for i in ids]
    assert [r.info.run_name for r in runs] == ["scope=attn_ln_mlp/recipe=fp8",
                                               "scope=attn_ln_mlp/recipe=mxfp4"]
    assert runs[0].data.params == {"scope": "attn_ln_mlp", "recipe": "fp8", "gpu": "cpu"}
    assert runs[0].data.metrics == {}
    assert runs[1].data.metrics == {"tgs": 10.0, "mem_pct": 60.5}
    assert runs[1].data.tags["kind"] == "unit"
    with pytest.raises(KeyError, match="lacks columns"):
        mlflow_store.log_table("table", [{"scope": "x"}], ["scope"], ["tgs"], uri=uri)


def test_check_reachable_closed_port_names_the_uri():
    with socket.socket() as sock:  # bind a free port, then close it: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    with pytest.raises(mlflow_store.TrackingUnavailable, match=f"127.0.0.1:{port}") as info:
        mlflow_store.check_reachable(uri)
    assert "MLFLOW_TRACKING_URI" in str(info.value)


def test_check_reachable_local_store(tmp_path):
    mlflow_store.check_reachable(f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(mlflow_store.TrackingUnavailable, match="not writable"):
        mlflow_store.check_reachable(f"sqlite:///{blocker / 'mlflow.db'}")


def test_a_default_store_under_a_file_is_one_error_not_a_traceback(tmp_path, monkeypatch):
    """FP4MOE_HOME under a file: tracking_uri() used to raise NotADirectoryError making the default store's folder
    (a traceback from every entry point); it names the store and check_reachable says what is wrong, with the fix."""
    (tmp_path / "a_file").write_text("")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("FP4MOE_HOME", str(tmp_path / "a_file" / "home"))
    uri = mlflow_store.tracking_uri()
    assert uri == f"sqlite:///{tmp_path / 'a_file' / 'home' / 'mlruns' / 'mlflow.db'}"
    with pytest.raises(mlflow_store.TrackingUnavailable, match=r"is not writable: .*a_file is not a writable folder\. "
                                                               r"Fix its permissions, or point MLFLOW_TRACKING_URI "
                                                               r"\(or FP4MOE_HOME\) elsewhere"):
        mlflow_store.check_reachable(uri)


def test_a_file_store_is_refused_with_the_sqlite_uri_to_use(tmp_path, monkeypatch):
    """MLFLOW_TRACKING_URI=./mlruns (MLflow 2's default: a file store) used to pass the check and then end the trainer
    in MLflow's MlflowException traceback (MLflow 3 refuses file stores); now TrackingUnavailable names the SQLite URI
    for the same folder. MLFLOW_ALLOW_FILE_STORE=true (MLflow's own opt-out) lets it through, and MLflow opens it."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    for uri in (str(tmp_path / "mlruns"), f"file://{tmp_path / 'mlruns'}"):
        with pytest.raises(mlflow_store.TrackingUnavailable) as err:
            mlflow_store.check_reachable(uri)
        assert str(err.value).startswith(f"MLflow store {uri} is a file store (a folder of files), which MLflow 3 no "
                                         f"longer opens: point MLFLOW_TRACKING_URI (or tracking.uri) at "
                                         f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}, "), err.value
    with pytest.raises(Exception, match="filesystem tracking backend"):  # what the check stands in front of
        from mlflow import MlflowClient

        MlflowClient(tracking_uri=str(tmp_path / "mlruns")).search_experiments()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow_store.check_reachable(str(tmp_path / "mlruns"))


def test_portable_names_the_checkout_out_and_home_folders_not_the_machine(tmp_path, monkeypatch):
    """What goes into results/ names the checkout ``<repo>``, the device's output folder ``$OUT`` and the home ``~``;
    only whole folders (a sibling ``checkout2`` is not the checkout), other absolute paths stay."""
    repo, out = tmp_path / "checkout", tmp_path / "checkout" / "out"
    monkeypatch.setenv("FP4MOE_HOME", str(repo))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("OUT", str(out))
    text = (f"python -m fp4moe_kernels.bench.conversions --out {repo}/results/kernels sqlite:///{out}/mlflow.db "
            f"{tmp_path}/notes {repo}2/x /elsewhere{repo}/y {repo} /tmp/site")
    assert mlflow_store.portable(text) == ("python -m fp4moe_kernels.bench.conversions --out <repo>/results/kernels "
                                           "sqlite:///$OUT/mlflow.db ~/notes ~/checkout2/x "
                                           f"/elsewhere{repo}/y <repo> /tmp/site")
    monkeypatch.setenv("OUT", "relative/out")   # not a folder of this machine: left alone
    assert mlflow_store.portable(f"{out}/a relative/out") == "<repo>/out/a relative/out"


def test_import_tracking_is_cheap():
    code = "import sys, fp4moe.tracking.mlflow_store; print('mlflow' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=_env_with_src(), check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == ["False", "False"]


# --- python -m fp4moe.reproduce -------------------------------------------------------------------


def test_reproduce_help_exits_zero():
    proc = subprocess.run([sys.executable, "-m", "fp4moe.reproduce", "--help"], env=_env_with_src(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m fp4moe.reproduce" in proc.stdout


def test_reproduce_refuses_a_store_it_cannot_use_before_running_anything(tmp_path, capsys, monkeypatch):
    """A tracking server that does not answer, or a file that is not an MLflow store: one line naming the store and
    the fix, exit 2, before any part runs (it used to run the minute-long self-check and then print a traceback per
    part, each failing on the store). --no-tracking --no-report need no store."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with socket.socket() as sock:  # a free port, closed again: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    not_a_store = tmp_path / "notes.db"
    not_a_store.write_text("not a database\n")
    for where, said in ((f"http://127.0.0.1:{port}", f"MLflow tracking server http://127.0.0.1:{port} is not reachable"),
                        (str(not_a_store), f"{not_a_store} cannot be read as an SQLite database")):
        assert pipeline.main(["--skip-bench", "--tracking-uri", where]) == 2
        out, err = capsys.readouterr()
        assert out == ""  # nothing ran: not even the hardware line
        assert err.startswith("reproduce: MLflow ") and said in err and err.count("\n") == 1, err
        assert "--tracking-uri (or $MLFLOW_TRACKING_URI) names the store" in err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    assert pipeline.store_unusable(uses_store=False) is None
    assert "is not reachable" in pipeline.store_unusable()


def test_reproduce_refuses_a_slurm_profile_it_cannot_use_before_running_anything(tmp_path, capsys, monkeypatch):
    """make reproduce-table SLURM=<profile>: a profile that does not exist, or a machine without Slurm's commands,
    used to fail in the Slurm step after the minute-long self-check and the archives; now one line, exit 2, first.
    --no-train (no Slurm step) does not ask."""
    store = ["--skip-bench", "--tracking-uri", str(tmp_path / "store")]
    assert pipeline.main([*store, "--slurm", "slurm_h10"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("reproduce: --slurm slurm_h10: needs conf/cluster/slurm_h10.yaml and "
                                 "conf/hydra/launcher/slurm_h10.yaml; Slurm profiles here: slurm_h100, slurm_h200, "
                                 "slurm_local (make reproduce-table SLURM=<profile>)\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch, no srun
    assert pipeline.main([*store, "--slurm", "slurm_local"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("reproduce: --slurm slurm_local: Slurm's commands (sbatch, srun) are not on "
                                        "PATH") and err.count("\n") == 1
    assert pipeline.slurm_unusable("slurm_local").endswith("leave out --slurm (SLURM=) to run the cells here")
    assert not (tmp_path / "store").exists()


BENCH_JSON = {  # the shape of fp4moe_kernels.bench.conversions's JSON output, trimmed
    "env": {"date": "2026-11-30T00:00:00Z", "commit": "abc123", "gpu": "NVIDIA H200",
            "torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0",
            "command": "python -m fp4moe_kernels.bench.conversions"},
    "copy_gbps": 4000.0,
    "rows": [{"shape": "dense", "kernel": "bf16_to_fp4_row", "impl": "fp4moe", "ms": 0.125,
              "bytes": 1000, "gbps": 8.0, "pct_copy": 0.2, "note": "", "extra": {}}],
}


def _fake_bench(monkeypatch, tmp_path, body: str, name: str = "fake_bench") -> str:
    """A module ``name`` standing in for fp4moe_kernels.bench.conversions (the real one needs a GPU), run as reproduce runs the
    benchmark: ``python -m name ARGV`` in a child process, ``body`` its code with ``argv``, ``out`` (the --out
    folder) and ``BENCH`` (BENCH_JSON) defined; it counts its calls in ``calls.txt`` beside it."""
    folder = tmp_path / "fake_modules"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(
        "import json, sys\nfrom pathlib import Path\nargv = sys.argv[1:]\n"
        "out = Path(argv[argv.index('--out') + 1]) if '--out' in argv else None\n"
        f"BENCH = {BENCH_JSON!r}\n"
        f"with open({str(folder / 'calls.txt')!r}, 'a') as f: f.write(' '.join(argv) + '\\n')\n" + body)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p))
    return name


def _calls(tmp_path) -> list[str]:
    path = tmp_path / "fake_modules" / "calls.txt"
    return path.read_text().splitlines() if path.exists() else []


WRITES_JSON = ("out.mkdir(parents=True, exist_ok=True)\n"
               "(out / 'kernels_h200.json').write_text(json.dumps(BENCH))\n")


def test_reproduce_logs_what_the_benchmark_wrote(monkeypatch, tmp_path):
    from mlflow import MlflowClient

    bench = _fake_bench(monkeypatch, tmp_path, WRITES_JSON)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert pipeline.run_bench(["--out", str(tmp_path / "res")], track=True, module=bench)
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("kernels").experiment_id])
    [run] = [r for r in runs if r.data.tags["kind"] == "row"]
    [summary] = [r for r in runs if r.data.tags["kind"] == "summary"]
    assert run.data.params["gpu"] == "NVIDIA H200"
    assert run.data.params["kernel"] == "bf16_to_fp4_row"
    assert run.data.metrics["time_us"] == pytest.approx(125.0)
    assert summary.data.metrics["copy_gbps"] == 4000.0


def test_reproduce_without_mlflow_prints_the_log_command(monkeypatch, tmp_path, capsys):
    bench = _fake_bench(monkeypatch, tmp_path, WRITES_JSON)
    real_find_spec = pipeline.importlib.util.find_spec
    monkeypatch.setattr(pipeline.importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real_find_spec(name, *a))
    assert pipeline.run_bench(["--out", str(tmp_path / "res")], track=True, module=bench)
    out = capsys.readouterr().out
    assert "NOT logged" in out
    assert f"python -m fp4moe.tracking.bench_log {tmp_path / 'res' / 'kernels_h200.json'}" in out


def test_reproduce_lists_what_is_missing_by_issue(capsys):
    pipeline.print_not_yet_implemented()
    out = capsys.readouterr().out
    missing, known = out.split("KNOWN DISAGREEMENTS")
    assert "[P6, issue 7]" in missing
    for label, issue in (("P2", 3), ("P3", 4), ("P4", 5), ("P5", 6)):
        assert f"[{label}, issue {issue}]" not in missing  # done (docs/results.md, By issue)
    assert "results/scale/paper_t1.md" in known and "results/scale/paper_t2.md" in known


def test_reproduce_fails_when_the_benchmark_fails(monkeypatch, tmp_path):
    bench = _fake_bench(monkeypatch, tmp_path, "sys.exit(1)\n")
    assert not pipeline.run_bench(["--out", str(tmp_path)], track=False, module=bench)
    assert len(_calls(tmp_path)) == 1


HEAD = "0123456789abcdef0123456789abcdef01234567"


def _result(folder: Path, name: str, **env) -> Path:
    """A benchmark JSON in ``folder`` with BENCH_JSON's env updated by ``env``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(json.dumps({**BENCH_JSON, "env": {**BENCH_JSON["env"], **env}}))
    return path


def test_a_benchmark_result_is_reusable_only_for_its_gpu_commit_and_default_command(tmp_path):
    find = lambda head=HEAD, **m: pipeline.reusable_result(tmp_path, "kernels_*.json", "fp4moe_kernels.bench.conversions",
                                                           head, **{"gpu": "NVIDIA H200", **m})
    assert find() is None  # nothing there
    _result(tmp_path, "kernels_other_options.json", commit=HEAD,
            command="python -m fp4moe_kernels.bench.conversions --out /x --tokens 1024")
    _result(tmp_path, "kernels_other_commit.json", commit="fedcba9876543210", command="python -m fp4moe_kernels.bench.conversions")
    h100 = _result(tmp_path, "kernels_other_gpu.json", commit=HEAD, gpu="NVIDIA H100 80GB HBM3",
                   command="python -m fp4moe_kernels.bench.conversions")
    (tmp_path / "kernels_broken.json").write_text("{not json")
    assert find() is None
    short = _result(tmp_path, "kernels_short_sha.json", commit=HEAD[:7],
                    command="python -m fp4moe_kernels.bench.conversions --out /root/results/kernels --commit 0123456")
    assert find() == short
    assert find(gpu="NVIDIA H100 80GB HBM3") == h100
    assert find(head=None) is None  # outside git nothing identifies the code
    assert find(head="f" + HEAD[1:]) is None


def test_a_layer_result_is_reusable_only_at_the_default_shape(tmp_path):
    from fp4moe.tracking.layer_bench_log import DEFAULT_SHAPE

    cmd = "python -m fp4moe.bench.moe_layer --out /w/results/moe_layer"
    odd = _result(tmp_path, "moe_layer_h200_ep1_t8192.json", commit=HEAD[:7], gpu="h200", world_size=1, command=cmd)
    odd.write_text(json.dumps({**json.loads(odd.read_text()), "shape": {**DEFAULT_SHAPE, "tokens": 8192}}))
    find = lambda: pipeline.reusable_result(tmp_path, "moe_layer_*.json", "fp4moe.bench.moe_layer", HEAD,
                                            shape=DEFAULT_SHAPE, gpu="h200", world_size=1)
    assert find() is None
    ok = _result(tmp_path, "moe_layer_h200_ep1.json", commit=HEAD[:7], gpu="h200", world_size=1, command=cmd)
    ok.write_text(json.dumps({**json.loads(ok.read_text()), "shape": dict(DEFAULT_SHAPE)}))
    assert find() == ok


def test_reproduce_reuses_this_gpus_kernel_result_at_this_commit_and_logs_it(monkeypatch, tmp_path):
    """A rerun of make reproduce-table on the same GPU and commit logs the file already measured instead of measuring
    again; other options or --rerun measure again."""
    from mlflow import MlflowClient

    head = mlflow_store.code_commit()
    if head is None:
        pytest.skip("not a git checkout: no commit to match results against")
    bench = _fake_bench(monkeypatch, tmp_path, WRITES_JSON)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    res = tmp_path / "res"
    old = _result(res, "kernels_h200_2026-11-30_x.json", commit=head, command=f"python -m {bench} --out {res}")
    assert pipeline.run_bench(["--out", str(res)], track=True, gpu="NVIDIA H200", module=bench)
    assert _calls(tmp_path) == []
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("kernels").experiment_id])
    assert {r.data.tags["kind"] for r in runs} == {"row", "summary"}  # the reused file is logged, not lost
    assert pipeline.run_bench(["--out", str(res)], track=False, gpu="NVIDIA H100 80GB HBM3", module=bench)
    assert len(_calls(tmp_path)) == 1  # another GPU: measured
    assert pipeline.run_bench(["--out", str(res), "--tokens", "1024"], track=False, gpu="NVIDIA H200",
                              module=bench)
    assert len(_calls(tmp_path)) == 2  # other options: measured
    assert pipeline.run_bench(["--out", str(res)], track=False, rerun=True, gpu="NVIDIA H200", module=bench)
    assert len(_calls(tmp_path)) == 3 and old.exists()


def test_reproduce_reuses_this_gpus_layer_result_at_this_commit(monkeypatch, tmp_path):
    from fp4moe.tracking.layer_bench_log import DEFAULT_SHAPE

    head = mlflow_store.code_commit()
    if head is None:
        pytest.skip("not a git checkout: no commit to match results against")
    monkeypatch.setenv("FP4MOE_HOME", str(tmp_path))
    bench = _fake_bench(monkeypatch, tmp_path, "sys.exit(0)\n", name="fake_layer_bench")
    path = _result(tmp_path / pipeline.RESULTS_LAYER, "moe_layer_h200_ep1_2026-12-02_x.json", commit=head[:7],
                   gpu="h200", world_size=1, command=f"python -m {bench} --out /w/results/moe_layer")
    path.write_text(json.dumps({**json.loads(path.read_text()), "shape": dict(DEFAULT_SHAPE)}))
    assert pipeline.run_layer_bench("NVIDIA H200", track=False, module=bench)
    assert _calls(tmp_path) == []
    assert pipeline.run_layer_bench("NVIDIA H200", track=False, rerun=True, module=bench)
    assert _calls(tmp_path) == [f"--out {tmp_path / pipeline.RESULTS_LAYER}"]


def test_the_commit_to_match_can_be_named(monkeypatch):
    """A copy of the tree without its history (the lent GPU machines) names its commit in FP4MOE_COMMIT, as the
    benchmarks record it."""
    monkeypatch.setenv("FP4MOE_COMMIT", "548760d")
    assert mlflow_store.code_commit() == mlflow_store.code_commit(short=True) == "548760d"
    assert pipeline._same_commit("548760d", "548760dabc") and not pipeline._same_commit("5487", "5487")


def test_reproduce_runs_the_self_check_in_a_child_with_its_own_arguments(monkeypatch, capsys):
    """make reproduce-table ARGS...: the kernel self-check runs as its own process (python -m
    fp4moe_kernels.selfcheck, under the Triton interpreter on CPU), with its own (empty) argument list."""
    monkeypatch.setattr(sys, "argv", ["python -m fp4moe.reproduce", "--skip-bench", "--no-report"])
    assert pipeline.run_selfcheck()
    assert "kernel self-check: passed" in capsys.readouterr().out


def test_the_gpu_probe_runs_in_a_child(monkeypatch):
    """reproduce asks for the GPUs in a child process (this one must hold no GPU memory while the trainer cells run):
    on this CPU machine it finds none and plans the CPU cells."""
    import torch

    from fp4moe.reproduce import train_runs

    train_runs.gpu_probe.cache_clear()
    probe = train_runs.gpu_probe()
    assert probe["count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if not probe["count"]:
        assert probe["name"] is None
        cells, notes = train_runs.plan()
        assert cells == train_runs._cpu_plan() and notes == []
