"""The trainer's run folder (fp4moe.runs.folder, conf/train.yaml ``hydra.run.dir``): one folder per config, so that the
same command finds a stopped run again. Composed through Hydra's compose API, no torch (the runs themselves:
tests/train/test_cli.py::test_ctrl_c_checkpoints_then_the_same_command_resumes)."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from fp4moe.runs import folder

CONF = Path(__file__).resolve().parents[1] / "conf"
BASE = ["train=short_cpu"]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for var in ("FP4MOE_ROOT", "FP4MOE_CKPT_DIR", "FP4MOE_CORPUS", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)


def _compose(*overrides: str):
    """conf/train.yaml with BASE + ``overrides``, the hydra node included (as the Hydra app composes it)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=[*BASE, *overrides], return_hydra_config=True)


def _run_dir(*overrides: str) -> Path:
    """Where ``python -m fp4moe.train BASE + overrides`` puts its run: hydra.run.dir, resolved."""
    return Path(_compose(*overrides).hydra.run.dir)


def _changed(cfg, key: str, value) -> str:
    """The run folder's name of ``cfg`` with ``key`` set to ``value`` (composing each would take 0.3 s)."""
    cfg = cfg.copy()
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, force_add=True)
    return folder.name(cfg)


def test_the_folder_is_named_by_the_groups_and_the_configs_hash():
    cfg = _compose()
    d = Path(cfg.hydra.run.dir)
    task = cfg.copy()
    with open_dict(task):
        del task["hydra"]
    # the resolver sees the whole config, the trainer the task's: one name
    assert d.parent == Path("logs/train/runs") and d.name == folder.name(task)
    readable, digits = d.name.rsplit("-", 1)
    assert readable == "tiny_cpu-mxfp4-none" and len(digits) == 12 and int(digits, 16) >= 0
    # the task's name is the folder above it, not part of the hash
    assert _run_dir("task_name=probe") == Path("logs/probe/runs") / d.name


def test_one_config_spelled_two_ways_and_overrides_that_do_not_change_the_run_share_the_folder(monkeypatch):
    cfg = _compose()
    d = Path(cfg.hydra.run.dir)
    # the defaults spelled out, and an excluded key, through Hydra's command-line parsing
    assert _run_dir("precision=mxfp4", "train.seed=1234", "train.adamw.lr=0.0003", "train.progress_bar=false") == d
    # an after-step hook (train.hooks) watches or stops a run, it does not change what is trained: a run a hook slowed
    # or failed resumes in its folder without it (tests/faults.py)
    assert _run_dir("+train.hooks.fail={factory: faults:fail_at_step, step: 3}") == d
    # a kernel switch spelled as it runs or as written: true / false for 1 / 0, a choice in capitals
    assert _run_dir("kernels.fused_swiglu=false") == _run_dir("kernels.fused_swiglu=0") != d
    assert _run_dir("kernels.dispatch_quantize=ROWS") == _run_dir("kernels.dispatch_quantize=rows") != d
    same = {"train.progress_bar": False, "train.log_interval": 5, "train.checkpoint_interval": 3,
            "train.keep_checkpoints": 5, "train.resume": False, "train.checkpoint_dir": "/elsewhere",
            "tracking.tags.note": "x", "tracking.experiment": "other",
            "train.hooks.slow": {"factory": "faults:sleep_after_step", "seconds": 1},
            "cluster.time_limit_min": 30, "cluster.env.OMP_NUM_THREADS": "2", "data.cache_dir": "/cache",
            "data.dir": "/data", "paths.root": "/somewhere"}
    for key, value in same.items():
        assert _changed(cfg, key, value) == d.name, key
    monkeypatch.setenv("FP4MOE_CKPT_DIR", "/ckpt")  # read into train.checkpoint_dir, which is not the run's
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere/mlflow.db")
    assert folder.name(cfg) == d.name


def test_overrides_that_change_the_run_give_another_folder(monkeypatch):
    cfg = _compose()
    assert _run_dir("precision=bf16").name.startswith("tiny_cpu-bf16-none-")
    changed = {"train.seed": 7, "train.steps": 21, "train.tokens": 10240, "train.adamw.lr": 0.001,
               "train.eval_interval": 5, "train.measure.warmup_steps": 0, "train.profile.steps": [2, 3],
               "train.fp8_weight_cache": True, "train.wgrad_accumulation_fusion": False, "train.params_dtype": "fp32",
               "model.num_layers": 3,
               "parallel.micro_batch": 1, "data.seed": 1, "optimizer.distributed": True,
               "backend.transformer_impl": "transformer_engine", "kernels.dispatch_quantize": "rows",
               "a_new_key": 1}
    names = {key: _changed(cfg, key, value) for key, value in changed.items()}
    assert len({folder.name(cfg), *names.values()}) == len(names) + 1, names
    # an environment variable the config reads counts by its value
    monkeypatch.setenv("FP4MOE_CORPUS", "/corpus/a.jsonl")
    a = _run_dir("data=user_corpus")
    monkeypatch.setenv("FP4MOE_CORPUS", "/corpus/b.jsonl")
    b = _compose("data=user_corpus")
    assert Path(b.hydra.run.dir) != a and _changed(b, "data.path", "/corpus/a.jsonl") == a.name
    # so does a kernel switch's variable (kernels.* defaults to it): an A/B of a switch is two folders
    monkeypatch.setenv("FP4MOE_DISPATCH_QUANTIZE", "rows")
    assert _run_dir() != _run_dir("kernels.dispatch_quantize=tokens")


def test_an_explicit_run_dir_wins_and_multiruns_keep_their_sweep_folders(tmp_path):
    assert _run_dir(f"hydra.run.dir={tmp_path / 'mine'}") == tmp_path / "mine"
    sweep = OmegaConf.to_container(_compose().hydra.sweep, resolve=False)
    assert sweep["dir"].startswith("${paths.log_dir}/${task_name}/multiruns/${now:")
    assert sweep["subdir"] == "${hydra.job.num}_${fp4moe.dirname:${hydra.job.override_dirname}}"


def test_every_excluded_key_is_in_the_config():
    """A misspelt key in EXCLUDED would leave out nothing: each names a key of the composed config."""
    cfg = _compose()
    absent = object()
    assert [k for k in folder.EXCLUDED if OmegaConf.select(cfg, k, default=absent) is absent] == []
    ident = folder.identity(cfg)
    assert "hydra" not in ident and "progress_bar" not in ident["train"] and "seed" in ident["train"]
