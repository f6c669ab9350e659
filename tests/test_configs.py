"""The Hydra config tree (conf/) composes, passes fp4moe.config.check, and says what the paper's setups say.

Fast (no torch): every experiment is composed through Hydra's compose API, as the trainer and launcher will.
"""
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fp4moe.config import ConfigError, check, derived, param_counts, parse_pipeline_layout
from fp4moe.analysis.paper_t1 import GPU_GIB
from fp4moe.recipe import Recipe
from fp4moe.settings import Settings

CONF = Path(__file__).resolve().parents[1] / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
PAPER = OmegaConf.load(CONF / "paper" / "numbers.yaml")


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    # Paper-scale experiments read the user's corpus from the environment; check() refuses it unset.
    monkeypatch.setenv("FP4MOE_CORPUS", "/nonexistent/corpus.jsonl")
    for var in ("FP4MOE_SLURM_PARTITION", "FP4MOE_SLURM_ACCOUNT", "NCCL_IB_HCA", "FP4MOE_SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(var, raising=False)


def _compose(*overrides, hydra_cfg=False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra_cfg)


def _sweep(cfg):
    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    return {k: [v.strip() for v in str(vals).split(",")] for k, vals in params.items()}


def _cells(name):
    sweep = _sweep(_compose(f"experiment={name}", hydra_cfg=True))
    cells = [[]]
    for key, values in sweep.items():
        cells = [c + [f"{key}={v}"] for c in cells for v in values]
    return cells


# Every paper experiment that trains has scaled-down twins on 1 GPU, 2 GPUs and CPU, sweeping the same cells.
# (F3/F4 are the kernel and layer benchmarks: they need a GPU and take parallel=single_gpu or two_gpu_ep2.)
TWINS = {"paper_t1": ("proxy_t1_1gpu", "proxy_t1_2gpu", "tiny_t1_cpu"),
         "paper_t2": ("proxy_t2_1gpu", "proxy_t2_2gpu", "tiny_t2_cpu"),
         "paper_f5": ("proxy_f5_1gpu", "proxy_f5_2gpu", "tiny_f5_cpu")}


def test_experiments_exist():
    assert set(EXPERIMENTS) >= {"paper_t1", "paper_t2", "paper_f3", "paper_f4", "paper_f5", "tiny_cpu",
                                *(t for twins in TWINS.values() for t in twins)}


def _paper_cells_of(sweep: dict) -> dict:
    """A sweep with its recompute groups replaced by the paper scope each stands for (their ``paper_scope``): the
    twins run megatron's core attention, experiment=paper_t1 the whole-block reading, for the same paper cells."""
    out = dict(sweep)
    if "recompute" in out:
        out["recompute"] = [_compose(f"recompute={r}").recompute.paper_scope for r in out["recompute"]]
    return out


@pytest.mark.parametrize("paper", sorted(TWINS))
def test_twins_sweep_the_papers_cells_on_one_gpu_two_gpus_and_cpu(paper):
    want = _paper_cells_of(_sweep(_compose(f"experiment={paper}", hydra_cfg=True)))
    ref = _compose(f"experiment={paper}")
    for twin, (world, device) in zip(TWINS[paper], ((1, "cuda"), (2, "cuda"), (1, "cpu"))):
        cfg = _compose(f"experiment={twin}", hydra_cfg=True)
        assert _paper_cells_of(_sweep(cfg)) == want, twin
        assert (int(cfg.parallel.world_size), cfg.cluster.nodes) == (world, 1), twin
        assert (cfg.cluster.gpu is not None) == (device == "cuda"), twin
        if paper == "paper_t2":  # T1 sweeps the scope; T2 fixes one, F5's twins do not recompute
            assert cfg.recompute.paper_scope == ref.recompute.paper_scope, twin
        elif paper == "paper_f5":
            assert cfg.recompute.name == "none", twin


def test_eight_gpu_twin_sweeps_t1_with_ep8():
    """Issue 7's proxy on one 8-GPU host: T1's cells, EP8 x DP8, 4 of the proxy's 32 experts per GPU."""
    cfg = _compose("experiment=proxy_t1_8gpu", hydra_cfg=True)
    assert _paper_cells_of(_sweep(cfg)) == _paper_cells_of(_sweep(_compose("experiment=paper_t1", hydra_cfg=True)))
    p = cfg.parallel
    assert (int(p.world_size), int(p.expert), int(p.data), cfg.cluster.gpus_per_node, cfg.cluster.nodes) == (8, 8, 8, 8, 1)
    assert int(cfg.model.moe.num_experts) // int(p.expert) == 4
    assert check(_compose("experiment=proxy_t1_8gpu"))["world_size"] == 8


def test_root_composes_and_checks():
    cfg = _compose()
    d = check(cfg)
    assert d["world_size"] == 1 and cfg.model.name == "tiny_cpu"


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_sweep_cell_composes_and_checks(name):
    for cell in _cells(name):
        cfg = _compose(f"experiment={name}", *cell)
        OmegaConf.resolve(cfg)  # every interpolation resolves
        check(cfg)
        Recipe.from_config(cfg.precision)


def test_paper_t1():
    cfg = _compose("experiment=paper_t1", hydra_cfg=True)
    d = check(cfg)
    setup = PAPER.t1.setup
    assert d["world_size"] == setup.nodes * setup.gpus_per_node == 256
    assert cfg.cluster.gpus_per_node == 8 and cfg.cluster.nodes == 32 and setup.gpu_memory_gb == 80
    assert cfg.cluster.gpu_memory_gb == round(GPU_GIB, 2)  # the 80 GB GPU's 81559 MiB, in GiB
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size) == (61, 7168, 128, 18432)
    assert (m.mla.q_lora_rank, m.mla.kv_lora_rank, m.mla.qk_head_dim, m.mla.qk_pos_emb_head_dim, m.mla.v_head_dim) \
        == (1536, 512, 128, 64, 128)
    assert (m.moe.first_k_dense, m.moe.num_experts, m.moe.shared_experts, m.moe.router_topk, m.moe.ffn_hidden_size) \
        == (3, 256, 1, 8, 2048)
    assert (m.moe.score_function, m.moe.topk_scaling_factor, m.vocab_size) == ("sigmoid", 2.5, 129280)
    # the lab's runs (sister artifact): no MTP layer, no group-limited routing, a frozen expert bias
    assert (m.mtp_num_layers, m.moe.num_groups, m.moe.bias_update_rate) == (0, None, 0.0)
    p = cfg.parallel
    assert (p.tensor, p.pipeline, p.expert, p.data, p.context) == (1, 32, 8, 8, 1)
    assert (p.micro_batch, p.global_batch, p.seq_length) == (1, 15360, 4096)
    assert cfg.optimizer.name == "offload" and cfg.optimizer.distributed and cfg.optimizer.cpu_offload
    assert cfg.optimizer.overlap_grad_reduce
    assert cfg.precision.scope == "all_linears" and cfg.precision.recompute_cache_fp4 is False
    stages = parse_pipeline_layout(p.pipeline_layout)
    assert len(stages) == 32 and stages[0] == "E" and stages[-1] == "tL" and all(s == "tt" for s in stages[1:-1])
    # the 9-cell sweep, one multirun, precisions x the recompute groups standing for the paper's scopes
    assert cfg.hydra.mode.name == "MULTIRUN"
    sweep = _sweep(cfg)
    assert sweep["precision"] == list(PAPER.t1.recipes)
    assert [_compose(f"recompute={r}").recompute.paper_scope for r in sweep["recompute"]] == list(PAPER.t1.scopes)
    assert len(_cells("paper_t1")) == 9
    assert d["grad_accum_steps"] == 15360 // (1 * 8) and d["experts_per_rank"] == 32


def test_recompute_labels_match_paper_rows():
    """Each paper scope has a recompute group of its own name (the core-attention reading) and the one paper_t1
    sweeps (the whole-block reading): both say which paper cell they stand for."""
    for scope, row in PAPER.t1.scopes.items():
        cfg = _compose(f"recompute={scope}")
        assert cfg.recompute.paper_label == row.label
        assert cfg.recompute.name == cfg.recompute.paper_scope == scope
    for name in ("attn_block_ln_experts", "attn_block_ln_mlp"):
        r = _compose(f"recompute={name}").recompute
        assert r.paper_scope in PAPER.t1.scopes and "self_attention" in r.fp4moe_modules
    for name in ("none", "full"):
        assert _compose(f"recompute={name}").recompute.paper_scope is None


def test_paper_t2():
    cfg = _compose("experiment=paper_t2", hydra_cfg=True)
    d = check(cfg)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.moe.num_experts, m.moe.router_topk, m.moe.shared_experts,
            m.moe.ffn_hidden_size) == (60, 5120, 160, 6, 2, 1536)
    assert d["world_size"] == 256
    assert _sweep(cfg) == {"precision": ["bf16", "fp8", "mxfp4_mlp_shared", "mxfp4"]}
    # the lab's DeepSeek-V2 layout (sister artifact): PP16 EP8, 2 layers on the first and the last stage
    p = cfg.parallel
    assert (p.pipeline, p.expert, p.data, p.global_batch) == (16, 8, 16, 8192)
    assert [s.count("t") for s in parse_pipeline_layout(p.pipeline_layout)] == [2] + [4] * 14 + [2]
    assert cfg.recompute.name == "attn_block_ln_experts" and cfg.optimizer.name == "offload"
    first = Recipe.from_config(_compose("precision=mxfp4_mlp_shared").precision)
    assert first.name == "mxfp4" and not first.dispatch_fp4 and not first.expert_input_fp4 and first.save_fp4


def test_every_precision_file_is_its_own_recipe_in_results():
    """The name results give each precision file's runs (``Recipe.tag``: the trainer's MLflow tag ``recipe``) is the
    file's own: mxfp4_mlp_shared is the mxfp4 family but never files its runs under mxfp4."""
    files = sorted(p.stem for p in (CONF / "precision").glob("*.yaml"))
    recipes = {f: Recipe.from_config(_compose(f"precision={f}").precision) for f in files}
    assert {f: r.tag for f, r in recipes.items()} == {f: f for f in files}
    assert recipes["mxfp4_mlp_shared"].name == "mxfp4" and recipes["mxfp4_mlp_shared"] != recipes["mxfp4"]


def test_paper_f5_steps():
    cfg = _compose("experiment=paper_f5", hydra_cfg=True)
    d = check(cfg)
    setup = PAPER.f5.setup
    assert cfg.train.steps is None and cfg.train.tokens == setup.tokens_b * 1e9   # steps are derived, not written
    assert (cfg.parallel.global_batch, cfg.parallel.seq_length) == (setup.global_batch_seqs, setup.seq_len)
    assert (cfg.parallel.expert, cfg.parallel.pipeline, cfg.parallel.micro_batch) == (4, 1, 5)
    # 160e9 / (4800 * 4096) = 8138.02: ceil gives 8139 steps (8138 steps would be 409,600 tokens short of 160B).
    assert d["tokens_per_step"] == 4800 * 4096 == 19_660_800
    assert d["steps"] == math.ceil(160e9 / (4800 * 4096)) == 8139
    assert 8138 * 19_660_800 < 160e9 <= 8139 * 19_660_800
    assert d["warmup_steps"] == math.ceil(37.7e9 / 19_660_800)
    assert (cfg.train.adamw.lr, cfg.train.adamw.min_lr) == (4.2e-4, 4.2e-5)
    assert cfg.optimizer.name == "distributed"
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.mla.kv_lora_rank, m.mla.q_lora_rank, m.moe.num_experts, m.moe.router_topk,
            m.moe.shared_experts, m.moe.ffn_hidden_size, m.moe.first_k_dense) == (28, 2048, 512, None, 64, 6, 2, 1408, 0)
    assert _sweep(cfg) == {"precision": ["bf16", "fp8", "mxfp4"]}


def test_train_defaults():
    t = _compose().train
    assert list(t.adamw.betas) == [0.9, 0.95] and t.adamw.weight_decay == 0.1 and t.adamw.grad_clip == 1.0
    assert t.schedule.name == "cosine" and t.schedule.warmup_steps > 0


# Tolerances: DeepSeek quotes totals to 3 significant figures (671B, 236B) and activated counts to 2 (37B, 21B).
# Our count follows megatron-core's modules (embedding + untied head, MLA with latent norms, RMSNorms, routers)
# without the router bias buffers and with MTP counted apart (DeepSeek-V3's 671B excludes its 11.6B MTP module).
# Totals land within 0.2 %; activated counts include the 0.9B / 0.5B input-embedding lookup, which DeepSeek may
# not count (37.55B with it, 36.6B without): 2 % covers that ambiguity and the 2-figure rounding.
@pytest.mark.parametrize("name,total_b,active_b", [("dsv3_671b", 671, 37), ("dsv2_236b", 236, 21)])
def test_param_counts(name, total_b, active_b):
    c = param_counts(OmegaConf.load(CONF / "model" / f"{name}.yaml"))
    assert abs(c["total"] / (total_b * 1e9) - 1) < 0.015
    assert abs(c["active"] / (active_b * 1e9) - 1) < 0.02
    assert abs(c["active"] - c["embedding"] / 2 - active_b * 1e9) / (active_b * 1e9) < 0.02


def test_param_counts_small_models():
    assert abs(param_counts(OmegaConf.load(CONF / "model" / "moe_16b.yaml"))["total"] / 16e9 - 1) < 0.075
    v3 = OmegaConf.load(CONF / "model" / "dsv3_671b.yaml")
    assert param_counts(v3)["mtp"] == 0   # the lab's runs had no MTP layer; DeepSeek-V3's would be 11.6B
    v3.mtp_num_layers = 1
    assert param_counts(v3)["mtp"] > 10e9
    proxy = param_counts(OmegaConf.load(CONF / "model" / "proxy_h200.yaml"))
    assert proxy["total"] * 18 < 40e9   # weights + grads + Adam states leave most of 141 GB to activations


def test_derived_has_no_hardcoded_counts():
    for p in (CONF / "model").glob("*.yaml"):
        cfg = OmegaConf.load(p)
        assert not any("param" in str(k) for k in cfg.keys()), f"{p.name} hard-codes a parameter count"


# ------------------------------------------------------------------------------------------ check() failures

@pytest.mark.parametrize("overrides,message", [
    # 1. world size != nodes x gpus_per_node
    (["experiment=paper_t1", "cluster.nodes=16"], "cluster.nodes=32"),
    # 2. TP*PP*CP*DP != world size
    (["experiment=paper_t1", "parallel.tensor=3"], "tensor x pipeline x context x data"),
    # 3. experts % EP
    (["experiment=paper_t1", "parallel.expert=3"], "not divisible by parallel.expert=3"),
    # 4. EP (x ETP) must divide TP*CP*DP (megatron-core: world_size % (ETP x EP x PP) == 0)
    (["experiment=paper_t1", "parallel.expert=16"], "must divide tensor x context x data"),
    # 5. global batch % (micro x DP)
    (["experiment=paper_f5", "parallel.global_batch=4801"], "not a multiple of micro_batch x data"),
    # 6a. layers over PP without a layout
    (["experiment=paper_t1", "parallel.pipeline_layout=null"], "not divisible by parallel.pipeline"),
    # 6b. an explicit layout that does not fit
    (["experiment=paper_t1", "parallel.pipeline_layout='E|(tt|)*30,tmL'"], "'m' layers"),
    (["parallel.world_size=3", "cluster.gpus_per_node=3", "parallel.pipeline=3", "parallel.pipeline_layout='Ett||L'"],
     "stage(s) [1] hold nothing"),
    # 7. a recompute module megatron-core can only do with TE, on our TE-less backend
    (["recompute=attn_ln_mlp", "recompute.megatron_modules=[core_attn,layernorm]"], "need Transformer Engine"),
    (["recompute=attn_ln_mlp", "recompute.megatron_modules=[moe_act]"], "need Transformer Engine"),
    # 8. precision that Recipe refuses, user corpus without a path
    (["precision=fp8", "precision.dispatch_fp4=true"], "precision:"),   # every Recipe key is in the schema
    (["data=user_corpus", "data.path=null"], "FP4MOE_CORPUS"),
    # 9. a dispatcher fp4moe does not build (DeepEP's 'flex'), or a recipe on another dispatcher than its own a2a
    (["experiment=paper_t1", "parallel.dispatcher=flex"], "needs DeepEP"),
    (["precision=mxfp4", "parallel.dispatcher=allgather"], "brings its own quantized all-to-all"),
])
def test_check_failures(overrides, message):
    cfg = _compose(*overrides)
    with pytest.raises(ConfigError) as err:
        check(cfg)
    assert message in str(err.value), str(err.value)
    assert isinstance(err.value, ValueError)


def test_te_recompute_allowed_with_te_backend():
    check(_compose("recompute=attn_ln_mlp", "recompute.megatron_modules=[core_attn,layernorm]",
                   "backend.transformer_impl=transformer_engine"))


def test_paper_16b_layout_accepts_other_dp():
    cfg = _compose("experiment=paper_f5", "cluster.nodes=8", "parallel.world_size=64", "parallel.data=64")
    assert derived(cfg)["grad_accum_steps"] == 15 and check(cfg)["steps"] == 8139


def test_pipeline_layout_parser_matches_megatron_example():
    # megatron-core docstring: "Ettt|(tt|)*29,m|L" -> [E t t t] + [t t]*29 + [m] + [L]
    assert parse_pipeline_layout("Ettt|(tt|)*29,m|L") == ["Ettt"] + ["tt"] * 29 + ["m", "L"]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_values_win_over_root(name):
    # train.yaml lists _self_ first: an experiment's values (task_name, ...) override the root file's.
    assert _compose(f"experiment={name}").task_name == name


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "precision").glob("*.yaml")))
def test_precision_files_load_as_recipes(name):
    r = Settings.from_config(_compose(f"precision={name}")).precision
    assert isinstance(r, Recipe) and r.name == name.split("_")[0]
