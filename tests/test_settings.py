"""The config groups' schemas (fp4moe.settings): every YAML file of train, parallel, cluster, model, optimizer and data
extends its group's dataclass in Hydra's ConfigStore, so composition refuses a key the schema lacks and a value of the
wrong type; ``Settings.from_config`` builds the frozen, typed settings once, each group checking its own ranges.

Fast (no torch): Hydra's compose API, as the trainer and the launcher compose."""
import dataclasses
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fp4moe.config import ConfigError, check
from fp4moe.runs.folder import digest
from fp4moe.settings import (SCHEMAS, BundledCorpus, Cluster, Model, OptimizerSetting, Parallel, Settings, Train,
                             UserCorpus, explain)

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUP_FILES = [(g, p.stem) for g in SCHEMAS for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("FP4MOE_CORPUS", "/nonexistent/corpus.jsonl")
    for var in ("FP4MOE_SLURM_PARTITION", "FP4MOE_SLURM_ACCOUNT", "NCCL_IB_HCA", "FP4MOE_SLURM_CPUS_PER_TASK",
                "FP4MOE_TOKENIZER"):
        monkeypatch.delenv(var, raising=False)


def _compose(*overrides, conf=CONF):
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("group, name", GROUP_FILES)
def test_every_group_file_extends_its_schema(group, name):
    """Each file of the six groups composes into its schema's type and builds its frozen settings."""
    cfg = _compose(f"{group}={name}")
    assert OmegaConf.get_type(cfg[group]) in SCHEMAS[group].values(), f"conf/{group}/{name}.yaml has no schema"
    built = getattr(Settings.from_config(cfg), group)
    assert type(built) is OmegaConf.get_type(cfg[group])


def test_settings_are_frozen_and_typed():
    s = Settings.from_config(_compose("train=short_cpu"))
    assert (type(s.train), type(s.parallel), type(s.cluster), type(s.model), type(s.optimizer), type(s.data)) == \
        (Train, Parallel, Cluster, Model, OptimizerSetting, BundledCorpus)
    assert s.train.steps == 20 and s.train.adamw.lr == 3.0e-4 and s.parallel.etp == 1
    assert s.model.moe.num_experts == 8 and s.model.mla.q_lora_rank == 128 and s.optimizer.grad_bytes == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.train.steps = 5
    assert type(Settings.from_config(_compose("data=code_docs")).data) is UserCorpus


def test_a_config_composed_without_the_schemas_gets_the_same_checks():
    """An archived run's params or a hand-written dict: merged into the schemas first, the same one-line errors."""
    plain = OmegaConf.create(OmegaConf.to_container(_compose(), resolve=True))
    assert OmegaConf.get_type(plain.train) is dict
    assert Settings.from_config(plain) == Settings.from_config(_compose())
    plain.train.steps = "abc"
    with pytest.raises(ConfigError, match=r"^train.steps='abc' is not a number: use a whole number >= 1"):
        Settings.from_config(plain)
    del plain.train.steps
    with pytest.raises(ConfigError, match=r"^train.steps has no value: set it in its YAML file or on the command line"):
        Settings.from_config(plain)
    plain.train.steps, plain.parallel.micro_btach = 3, 2
    with pytest.raises(ConfigError, match=r"^parallel.micro_btach is not a key .*did you mean parallel.micro_batch\?"):
        Settings.from_config(plain)


def test_a_typo_in_a_yaml_file_is_refused_while_composing(tmp_path):
    """Hydra's struct check alone would take any key in a group's file; the schema refuses it, with the fix."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "experiment" / "typo.yaml").write_text("# @package _global_\ntrain:\n  eval_intervall: 5\n")
    with pytest.raises(Exception) as err:  # hydra.errors.ConfigCompositionException
        _compose("experiment=typo", conf=conf)
    assert explain(err.value) == ("train.eval_intervall is not a key of the train schema (fp4moe.settings): did you "
                                  "mean train.eval_interval?")
    (conf / "experiment" / "typo.yaml").write_text("# @package _global_\nparallel:\n  micro_batch: two\n")
    with pytest.raises(Exception) as err:
        _compose("experiment=typo", conf=conf)
    assert explain(err.value).startswith("parallel.micro_batch='two' is not a number: use a whole number >= 1")


def test_the_schemas_leave_the_run_folders_where_they_were():
    """A key a schema adds with null ("not given": fp4moe.settings.ABSENT_WHEN_NULL) is not part of a run folder's
    identity, so the folders of runs started before the schemas existed are found again (digests from 1c177ea)."""
    assert digest(_compose()) == "fb872589a5e8"
    assert digest(_compose("data=user_corpus")) == "7117eae4a7ca"
    assert digest(_compose("model=dsv2_236b")) == "cbc12d0c9553"


def test_a_token_budget_typed_float_keeps_the_folder_of_its_integer_spelling():
    """train.tokens is a float in the schema (3.0e11 is a budget); the T1 convergence runs wrote it as an integer
    before the schemas existed, and their folders stay (fp4moe.settings.WHOLE_WHEN_INTEGRAL; digest from 1c177ea)."""
    cfg = _compose("experiment=proxy_t1_conv_1gpu")
    assert isinstance(cfg.train.tokens, float)
    assert digest(cfg) == "0d8decfb5b23"


def test_check_takes_the_settings_built_once():
    cfg = _compose()
    s = Settings.from_config(cfg)
    assert check(cfg, s) == check(cfg)
