"""fp4moe.train.host_env: cluster.env reaches the trainer process before torch loads (allocator, OpenMP, inductor
thread counts), a variable the user set wins, a bad thread count is refused, and where torch was imported first
the thread counts still take effect through torch's own knobs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fp4moe.config import ConfigError
from fp4moe.train.host_env import THREAD_COUNTS, apply_cluster_env, cluster_env

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
KEYS = ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_DEVICE_MAX_CONNECTIONS") + THREAD_COUNTS


def _workstation(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=["cluster=workstation_1gpu", *overrides])


@pytest.fixture
def clean_env(monkeypatch):
    """The variables unset for the test (monkeypatch restores what was there)."""
    for k in KEYS:
        monkeypatch.setenv(k, "x")
        monkeypatch.delenv(k)
    return monkeypatch


def test_cluster_env_reaches_a_local_run_without_overriding_the_user(clean_env):
    clean_env.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    clean_env.setenv("OMP_NUM_THREADS", "2")
    cfg = _workstation()
    # composed while the user's OMP_NUM_THREADS was set: the config reads it (oc.env), so both agree
    assert OmegaConf.select(cfg, "cluster.env.OMP_NUM_THREADS") == "2"
    clean_env.delenv("OMP_NUM_THREADS")
    cfg = _workstation()
    if "torch" in sys.modules:  # keep this process's torch as it was: the in-process test below covers that path
        clean_env.setattr("fp4moe.train.host_env._apply_to_torch", lambda done: None)
    assert apply_cluster_env(cfg) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                                      "OMP_NUM_THREADS": "4", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert (os.environ["OMP_NUM_THREADS"], os.environ["TORCHINDUCTOR_COMPILE_THREADS"]) == ("4", "1")


def test_cpu_cluster_sets_nothing(clean_env):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train")
    assert cfg.cluster.name == "cpu" and apply_cluster_env(cfg) == {}
    assert not any(k in os.environ for k in KEYS)


@pytest.mark.parametrize("value", ["0", "four", "-2", ""])
def test_a_bad_thread_count_is_refused_by_name(clean_env, value):
    cfg = _workstation(f"cluster.env.OMP_NUM_THREADS='{value}'")
    with pytest.raises(ConfigError, match=r"cluster.env.OMP_NUM_THREADS=.*positive integer"):
        cluster_env(cfg)
    with pytest.raises(ConfigError):
        apply_cluster_env(cfg)
    assert "OMP_NUM_THREADS" not in os.environ  # refused before anything was set


def test_the_trainer_entry_point_refuses_a_bad_thread_count(clean_env):
    r = subprocess.run([sys.executable, "-m", "fp4moe.train", "cluster=workstation_1gpu",
                        "cluster.env.TORCHINDUCTOR_COMPILE_THREADS=0", "hydra.run.dir=/tmp/fp4moe-host-env-test",
                        "hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "cluster.env.TORCHINDUCTOR_COMPILE_THREADS='0': use a positive integer" in r.stderr
    assert "Traceback" not in r.stderr


_PROBE = """
import json, sys
from hydra import compose, initialize_config_dir
from fp4moe.train.host_env import apply_cluster_env
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    cfg = compose("train", overrides=["cluster=workstation_1gpu", "cluster.env.OMP_NUM_THREADS=1"])
if sys.argv[2] == "after":
    import torch
set_ = apply_cluster_env(cfg)
import torch
import torch._inductor.config as ic
print(json.dumps({"set": set_, "torch_threads": torch.get_num_threads(), "compile_threads": ic.compile_threads}))
"""


@pytest.mark.parametrize("order", ["before", "after"])
def test_thread_counts_take_effect_in_torch(clean_env, order):
    """Applied before torch loads (fp4moe.train's entry point) or after (an API caller): torch runs the intra-op
    threads cluster.env asks for (1 here: torch's default is one per core, at least 2 on CI) and inductor compiles
    with 1 worker (its default: one per core up to 32), either way."""
    r = subprocess.run([sys.executable, "-c", _PROBE, str(CONF), order], capture_output=True, text=True,
                       timeout=300, env={k: v for k, v in os.environ.items() if k not in KEYS})
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["set"]["OMP_NUM_THREADS"] == "1" and got["set"]["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert (got["torch_threads"], got["compile_threads"]) == (1, 1)
