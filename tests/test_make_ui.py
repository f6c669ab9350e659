"""``make mlflow-ui`` and ``make notebooks`` (checked with ``make -n -B``: nothing installed or started): they install
their optional extra into .venv on first use and open the project's MLflow store, the one fp4moe.tracking.mlflow_store logs to."""
from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from fp4moe.tracking.mlflow_store import tracking_uri

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _make_n(target: str, **env: str) -> list[str]:
    e = {k: v for k, v in os.environ.items()
         if k not in ("MLFLOW_TRACKING_URI", "FP4MOE_HOME", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return subprocess.run(["make", "--no-print-directory", "-n", "-B", "-C", str(ROOT), target], capture_output=True,
                          text=True, env={**e, **env}, check=True, timeout=30).stdout.splitlines()


def _ui_line(uri: str) -> str:
    # one worker, no job runner: four supervised workers never came up on two cores (tests/mlflow_server.py runs it)
    return ("MLFLOW_DISABLE_TELEMETRY=true MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false .venv/bin/mlflow ui "
            f"--backend-store-uri '{uri}' --host 127.0.0.1 --port 5000 --workers 1")


def test_mlflow_ui_opens_the_projects_store(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("FP4MOE_HOME", raising=False)
    lines = _make_n("mlflow-ui")
    assert ".venv/bin/python -m pip install -q --no-compile -e '.[ui]'" in lines  # the extra, on first use
    # the checkout's store (not asked of tracking_uri(), which would create mlruns/ in the checkout)
    assert lines[-1] == _ui_line(f"sqlite:///{ROOT}/mlruns/mlflow.db")
    monkeypatch.setenv("FP4MOE_HOME", str(tmp_path))  # the same rule as the Python side's, FP4MOE_HOME included
    assert _make_n("mlflow-ui", FP4MOE_HOME=str(tmp_path))[-1] == _ui_line(tracking_uri())
    other = "sqlite:////srv/team/mlruns/mlflow.db"
    assert f"--backend-store-uri '{other}'" in _make_n("mlflow-ui", MLFLOW_TRACKING_URI=other, UI_PORT="5001")[-1]
    server = _make_n("mlflow-ui", MLFLOW_TRACKING_URI="http://mlflow.lab:5000")
    assert len(server) == 1 and "is an MLflow server" in server[0]  # its own UI: nothing to start


def test_notebooks_open_jupyterlab_on_the_store(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("FP4MOE_HOME", str(tmp_path))  # tracking_uri() creates the store's folder: not in the checkout
    lines = _make_n("notebooks", FP4MOE_HOME=str(tmp_path))
    assert ".venv/bin/python -m pip install -q --no-compile -e '.[notebooks]'" in lines
    assert lines[-1].startswith(f"MLFLOW_TRACKING_URI='{tracking_uri()}' .venv/bin/jupyter lab "
                                "--ServerApp.root_dir=notebooks ")
    assert lines[-1].endswith(" --allow-root") == (os.geteuid() == 0)  # as root JupyterLab refuses to start without


def test_the_ui_extra_is_the_full_mlflow_of_the_pinned_skinny():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    skinny = [d for d in project["dependencies"] if d.startswith("mlflow-skinny==")]
    assert project["optional-dependencies"]["ui"] == [skinny[0].replace("mlflow-skinny", "mlflow")]
    assert any(d.startswith("jupyterlab==") for d in project["optional-dependencies"]["notebooks"])
