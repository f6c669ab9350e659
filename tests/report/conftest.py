"""Fixtures of the report tests: one small MLflow store per session (slow to create), an empty one."""
import pytest

import fixture_store


@pytest.fixture(scope="session")
def report_store(tmp_path_factory):
    return fixture_store.build(tmp_path_factory.mktemp("report_store"))


@pytest.fixture
def empty_store(tmp_path):
    return f"sqlite:///{tmp_path / 'empty' / 'mlflow.db'}"
