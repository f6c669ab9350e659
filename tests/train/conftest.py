"""Fixtures of the trainer tests: the stand-in data pipeline (byte_data.install, the one place it is swapped in)
and a fresh MLflow SQLite store per test."""
from __future__ import annotations

import pytest

import byte_data


@pytest.fixture(autouse=True)
def byte_text(monkeypatch):
    """fp4moe.train reads tests/fixtures/sonnets.txt as bytes (see byte_data.py for why)."""
    byte_data.install(monkeypatch)


@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    """A fresh MLflow store for the test; returns its URI (also exported as MLFLOW_TRACKING_URI)."""
    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    (tmp_path / "mlruns").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri
