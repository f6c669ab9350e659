"""fp4moe.paths is the one place that finds the repository's folders (issue 29, P9): the source holds no other way of
finding them (a property of the source, so the test reads the source), the Hydra ``paths`` group is the one place
conf/ reads the run folders' variables, and the module's answers with and without FP4MOE_HOME / FP4MOE_CONF_DIR,
for a checkout and for a copy outside any checkout; the entry points compose from $FP4MOE_CONF_DIR."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp4moe import paths
from fp4moe.tracking import mlflow_store

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "src" / "fp4moe" / "paths.py"

# Ways of finding a folder that belong in fp4moe.paths only: a path walked up from a module's own file, a join onto
# a folder named like the repository's, an environment variable of the repository's folders read.
FORBIDDEN = {
    "a folder above the module's own file": re.compile(r"__file__\)?(\.resolve\(\)|\.absolute\(\))?\.parents\["),
    "a join onto conf/, mlruns/, results/ or logs/": re.compile(r"/\s*[\"'](conf|mlruns|results|logs)[\"']"),
    "FP4MOE_HOME or FP4MOE_CONF_DIR read": re.compile(r"(environ|getenv)\W+(get\()?\s*[\"'](FP4MOE_HOME|FP4MOE_CONF_DIR)"),
}
# conf/: the run folders' variables, read by the paths group only
CONF_VARS = re.compile(r"oc\.env:(FP4MOE_ROOT|FP4MOE_DATA_DIR|FP4MOE_CKPT_DIR)\b")


def offences(text: str) -> list[str]:
    """The names of the FORBIDDEN patterns ``text`` (a module's source) matches."""
    return [what for what, pattern in FORBIDDEN.items() if pattern.search(text)]


@pytest.fixture
def clean_env(monkeypatch):
    for var in (paths.HOME_VAR, paths.CONF_VAR):
        monkeypatch.delenv(var, raising=False)


def test_the_source_finds_the_folders_in_one_place():
    """No module of src/ or kernels/ but fp4moe/paths.py walks up from its own file to the repository, joins onto
    conf/ mlruns/ results/ logs/, or reads FP4MOE_HOME / FP4MOE_CONF_DIR; the check catches each way it replaced."""
    found = {str(p.relative_to(ROOT)): offences(p.read_text())
             for p in sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]) if p != MODULE}
    assert {k: v for k, v in found.items() if v} == {}
    for old in ('CONF_DIR = Path(os.environ.get("FP4MOE_CONF_DIR", Path(__file__).resolve().parents[2] / "conf"))',
                'ROOT = Path(__file__).resolve().parents[3]', 'store = repo_root() / "mlruns"',
                'if home := os.environ.get("FP4MOE_HOME"):'):
        assert offences(old), old


def test_conf_reads_the_run_folders_variables_in_the_paths_group():
    """FP4MOE_ROOT, FP4MOE_DATA_DIR and FP4MOE_CKPT_DIR are read by conf/paths/default.yaml and no other config file;
    the data and train groups interpolate ${paths.*}."""
    readers = {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")
               if CONF_VARS.search(p.read_text())}
    assert readers == {"paths/default.yaml"}
    assert set(CONF_VARS.findall((ROOT / "conf/paths/default.yaml").read_text())) == {
        "FP4MOE_ROOT", "FP4MOE_DATA_DIR", "FP4MOE_CKPT_DIR"}


def test_in_a_checkout(clean_env):
    """Without the variables: every folder is the checkout's, the one this test file is in."""
    assert paths.source_root() == paths.repo_root() == ROOT
    assert paths.conf_dir() == ROOT / "conf" and (paths.conf_dir() / "train.yaml").is_file()
    assert (paths.results_dir(), paths.mlruns_dir(), paths.logs_dir()) == (ROOT / "results", ROOT / "mlruns",
                                                                           ROOT / "logs")
    assert paths.package_parent() == Path(sys.modules["fp4moe"].__file__).resolve().parents[1]


def test_fp4moe_home_moves_the_outputs_not_the_code(clean_env, monkeypatch, tmp_path):
    """FP4MOE_HOME moves the stores and outputs (and the default MLflow store mlflow_store.tracking_uri creates there);
    conf/ and the committed results the model reads stay the checkout's."""
    monkeypatch.setenv(paths.HOME_VAR, str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert paths.repo_root() == tmp_path.resolve()
    assert (paths.results_dir(), paths.mlruns_dir(), paths.logs_dir()) == (tmp_path / "results", tmp_path / "mlruns",
                                                                           tmp_path / "logs")
    assert mlflow_store.tracking_uri() == f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    assert (tmp_path / "mlruns").is_dir()
    assert paths.source_root() == ROOT and paths.conf_dir() == ROOT / "conf"


def test_fp4moe_conf_dir_relative_and_home(clean_env, monkeypatch, tmp_path):
    """FP4MOE_CONF_DIR is made absolute (Hydra's initialize_config_dir needs that): relative to the working
    directory, ``~`` expanded."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(paths.CONF_VAR, "myconf")
    assert paths.conf_dir() == tmp_path.resolve() / "myconf"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(paths.CONF_VAR, "~/c")
    assert paths.conf_dir() == (tmp_path / "home" / "c").resolve()


def _copy_outside(tmp_path: Path):
    """fp4moe/paths.py copied into ``tmp_path/site`` (an installed package, no checkout above it), imported."""
    (tmp_path / "site" / "fp4moe").mkdir(parents=True)
    copy = tmp_path / "site" / "fp4moe" / "paths.py"
    shutil.copy(MODULE, copy)
    spec = importlib.util.spec_from_file_location("installed_paths", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_installed_outside_a_checkout(clean_env, monkeypatch, tmp_path):
    """A package installed away from any checkout: the root is the checkout the working directory is in, else the
    working directory; FP4MOE_CONF_DIR and FP4MOE_HOME name the folders explicitly."""
    if any((p / "pyproject.toml").is_file() for p in tmp_path.resolve().parents):
        pytest.skip("the temporary folder is inside a project")
    installed = _copy_outside(tmp_path)
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    monkeypatch.chdir(work / "sub")
    assert installed.source_root() == installed.repo_root() == (work / "sub").resolve()
    (work / "pyproject.toml").write_text("")
    assert installed.source_root() == work.resolve() and installed.conf_dir() == work.resolve() / "conf"
    assert installed.package_parent() == (tmp_path / "site").resolve()
    monkeypatch.setenv(paths.CONF_VAR, str(ROOT / "conf"))
    monkeypatch.setenv(paths.HOME_VAR, str(tmp_path / "home"))
    assert installed.conf_dir() == ROOT / "conf" and installed.mlruns_dir() == (tmp_path / "home" / "mlruns").resolve()


@pytest.fixture
def other_conf(tmp_path):
    """A copy of conf/ whose task_name is ``from_the_copy``."""
    conf = tmp_path / "conf_copy"
    shutil.copytree(ROOT / "conf", conf)
    train = conf / "train.yaml"
    text = train.read_text()
    assert "\ntask_name: train\n" in text
    train.write_text(text.replace("\ntask_name: train\n", "\ntask_name: from_the_copy\n"))
    return conf


def _command(args, tmp_path, conf):
    env = {**os.environ, paths.CONF_VAR: str(conf),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "kernels"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def test_entry_points_compose_from_fp4moe_conf_dir(other_conf, tmp_path, monkeypatch):
    """python -m fp4moe.train, python -m fp4moe.launch and fp4moe.data's composition read $FP4MOE_CONF_DIR."""
    r = _command(["fp4moe.train", "--cfg", "job"], tmp_path, other_conf)
    assert r.returncode == 0, r.stderr
    assert "task_name: from_the_copy" in r.stdout.splitlines()
    r = _command(["fp4moe.launch", "dry-run", "--summary"], tmp_path, other_conf)
    assert r.returncode == 0, r.stderr
    assert "task_name: from_the_copy" in r.stdout
    from fp4moe.data.__main__ import compose

    monkeypatch.setenv(paths.CONF_VAR, str(other_conf))
    assert compose([]).task_name == "from_the_copy"
    monkeypatch.delenv(paths.CONF_VAR)
    assert compose([]).task_name == "train"
