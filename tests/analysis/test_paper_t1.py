"""fp4moe.analysis.paper_t1: the paper's T1 cells as experiment=paper_t1 runs them, under the model's assumption set,
how each assumption moves them, and the lab's own measurements beside them. Arithmetic only (Hydra compose, no
torch)."""
from dataclasses import replace

import pytest

from fp4moe.analysis import manifest
from fp4moe.analysis import paper_t1 as pt
from fp4moe.analysis.outside_torch_measured import measured
from fp4moe.scale.memory import (GB, LAB_STACK, MemoryAssumptions, experiment_cfg, mean_total_bytes,
                                per_stage_memory)


@pytest.fixture(scope="module")
def base():
    return pt.cells()


@pytest.fixture(scope="module")
def variants(base):
    """{variant name: its nine cells} of every VARIANTS row."""
    return {v.name: pt.variant_cells(v, base) for v in pt.VARIANTS}


@pytest.fixture(scope="module")
def sister():
    return pt.sister_check()


def test_paper_cells_come_from_numbers_yaml():
    paper = pt.paper_cells()
    assert len(paper) == 9
    assert [k for k, v in paper.items() if v is not None] == [
        ("attn_ln_experts", "bf16"), ("attn_ln_experts", "fp8"), ("attn_ln_experts", "mxfp4"),
        ("attn_ln_mlp", "mxfp4"), ("mla_up_proj", "mxfp4")]
    assert paper["attn_ln_experts", "fp8"] == 74.20 and paper["mla_up_proj", "mxfp4"] == 70.11


def test_the_paper_scopes_are_the_experiments_sweep():
    """Each of the paper's scopes maps to the recompute group experiment=paper_t1 sweeps for it (its paper_scope):
    the whole-block reading of "attention"; the core-attention reading is the variant."""
    assert pt.sweep_recompute() == {"attn_ln_experts": "attn_block_ln_experts", "attn_ln_mlp": "attn_block_ln_mlp",
                                    "mla_up_proj": "mla_up_proj"}
    assert set(pt.CORE_ATTENTION) == set(pt.SCOPES) and pt.CORE_ATTENTION["attn_ln_mlp"] == "attn_ln_mlp"


def test_cells_are_the_models_most_loaded_gpu_of_the_experiment(base):
    assert [(c.scope, c.recipe) for c in base] == [(s, r) for s in pt.SCOPES for r in pt.RECIPES]
    for c in (base[0], base[-1]):
        stages = per_stage_memory(experiment_cfg("paper_t1", f"precision={c.recipe}", f"recompute={c.recompute}"),
                                  pt.paper_setup())
        top = max(stages, key=lambda b: b.total_bytes)
        assert (c.total_gib, c.allocated_gib, c.rank, c.in_flight) == (top.total_gb, top.allocated_gb,
                                                                        top.pipeline_rank, top.in_flight)
        assert c.mean_gib == mean_total_bytes(stages) / GB < c.total_gib
        assert c.parts["deepep"] == top.deepep_bytes / GB > 0   # paper_setup: the lab's DeepEP dispatcher
        assert c.parts["optimizer"] == 0 < c.parts["optimizer_host"]   # optimizer=offload


def test_cell_outcome_and_error_by_hand():
    """% of the 80 GB GPU's 81559 MiB (79.65 GiB): a cell at 80 GiB does not fit."""
    parts = {}
    assert pt.GPU_GIB == 81559 / 1024
    fits = pt.Cell("s", "r", "g", 60.0, 0.65 * pt.GPU_GIB, 50.0, 40.0, 3, 29, parts)
    assert fits.pct == pytest.approx(65.0) and fits.fits and fits.matches_paper
    assert fits.error_pp == pytest.approx(5.0)
    over = pt.Cell("s", "r", "g", 60.0, 80.0, 79.5, 60.0, 3, 29, parts)
    assert not over.fits and not over.matches_paper and over.error_pp is None
    oom = pt.Cell("s", "r", "g", None, 81.0, 80.5, 60.0, 3, 29, parts)
    assert oom.matches_paper and oom.error_pp is None
    # at the edge: the allocated peak within the model's measured error of the GPU less the memory outside PyTorch
    lo, hi = pt.PEAK_ERR_RANGE
    room = pt.GPU_GIB - 8.0
    assert not pt.Cell("s", "r", "g", 60.0, 8.0 + room * (1 + lo) * 0.99, room * (1 + lo) * 0.99, 1, 3, 29,
                       parts).at_edge
    assert pt.Cell("s", "r", "g", None, 8.0 + room, room, 1, 3, 29, parts).at_edge
    assert not pt.Cell("s", "r", "g", None, 8.0 + room * (1 + hi) * 1.01, room * (1 + hi) * 1.01, 1, 3, 29,
                       parts).at_edge


def test_variants_change_what_they_name(base, variants):
    """A variant changes the model for its own reason only: core attention raises the attention-recomputing cells and
    leaves mla_up_proj as it is; a precision key of mxfp4 leaves bf16 and fp8 as they are; x1.5 outside PyTorch adds
    half of each cell's outside bytes and nothing allocated; without TE's FP8 weight copies bf16 stays as it is and the
    FP8 cells lose them."""
    by = variants
    core = by[pt.VARIANTS[0].name]
    for b, c in zip(base, core):
        assert (c.total_gib > b.total_gib) if b.scope != "mla_up_proj" else c == b
    caches = next(rs for name, rs in by.items() if "recompute caches" in name)
    assert all(c == b for b, c in zip(base, caches) if b.recipe != "mxfp4")
    assert all(c.total_gib < b.total_gib for b, c in zip(base, caches) if b.recipe == "mxfp4")
    cache = next(rs for name, rs in by.items() if "fp8_weight_workspaces" in name)  # FP8 copies: none under bf16
    assert all(c == b if b.recipe == "bf16" else c.allocated_gib == pytest.approx(
        b.allocated_gib - b.parts["fp8_weight_cache"]) for b, c in zip(base, cache))
    big = next(rs for name, rs in by.items() if name.startswith("outside-PyTorch memory x 1.5"))
    for b, c in zip(base, big):
        assert c.allocated_gib == b.allocated_gib
        assert c.total_gib - c.allocated_gib == pytest.approx(1.5 * (b.total_gib - b.allocated_gib), abs=1e-6)


def test_layouts_are_the_labs_three():
    """ep16 and ep32 as run_dlc_e2e.sh spells them: PP16 with 1 layer on the last stage, PP8 with 5; each places the
    61 layers and the loss once on 256 GPUs."""
    from fp4moe.config import parse_pipeline_layout

    for name, over in pt.LAYOUTS.items():
        p = experiment_cfg("paper_t1", *over).parallel
        stages = parse_pipeline_layout(p.pipeline_layout)
        joined = "".join(stages)
        assert (len(stages), joined.count("t"), joined.count("L"), joined.count("m")) == (p.pipeline, 61, 1, 0)
        assert p.pipeline * p.data == 256 and name == f"ep{p.expert}"
    assert [s.count("t") for s in parse_pipeline_layout(
        experiment_cfg("paper_t1", *pt.LAYOUTS["ep32"]).parallel.pipeline_layout)] == [8] * 7 + [5]


def test_sister_check_is_the_model_of_the_labs_cells(sister):
    s = sister
    assert [(c.layout, c.ac, c.recipe) for c in s][:4] == [("ep8", "full", "bf16"), ("ep8", "full", "fp8"),
                                                           ("ep8", "sel", "bf16"), ("ep8", "sel", "fp8")]
    full = per_stage_memory(experiment_cfg("paper_t1", "precision=bf16", "recompute=full"), pt.paper_setup())
    assert s[0].total_gib == max(b.total_gb for b in full) and s[0].measured_gb == 39
    oom = [c for c in s if c.measured_gb is None]
    assert oom and all(c.same_outcome == (c.total_gib > pt.GPU_GIB) for c in oom)
    # the monitoring's "GB" in GiB under both readings
    assert s[0].measured_gib("GiB") == 39 and s[0].measured_gib("10^9 B") == pytest.approx(39e9 / 2**30)
    assert oom[0].measured_gib("GiB") is None


def test_setup_label_names_the_assumption_set():
    """The assumption set: the lab's DeepEP buffers and the measured terms outside PyTorch (the manifest's file)."""
    a = pt.paper_setup()
    assert a.deepep_buffers and a.outside_torch_source == measured().source
    assert (a.cuda_context_bytes, a.allocator_gap_bytes) == (measured().cuda_context_bytes,
                                                            measured().allocator_gap_bytes)
    text = pt.setup_label(replace(a, outside_torch_source="results/x.json (H200, measured)"))
    assert text.startswith("`experiment=paper_t1`") and "DeepEP buffers" in text and "results/x.json" in text
    assert "as the lab's code (megatron-core + Transformer Engine + the release's patches" in text
    own = pt.setup_label(MemoryAssumptions())
    assert "DeepEP buffers off" in own and "as fp4moe's code" in own
    assert "the lab's code in part (fp8_any_shape of" in pt.setup_label(MemoryAssumptions(fp8_any_shape=True))


def test_paper_setup_is_the_labs_code_and_names_each_switchs_source(base, variants):
    """paper_setup() turns on every lab's-stack switch; STACK gives each a source in the lab's code; the sensitivity
    table turns each off on its own (and all together), and the section on the lab's code names every switch with its
    source."""
    a = pt.paper_setup()
    assert all(getattr(a, k) for k in LAB_STACK) and a.deepep_buffers
    assert list(pt.STACK) == list(LAB_STACK) and all(len(src) > 40 for _, src in pt.STACK.values())
    names = [v.name for v in pt.VARIANTS]
    for k in LAB_STACK:
        [v] = [v for v in pt.VARIANTS if v.name.endswith(f"({k} off: fp4moe's code)")]
        assert not getattr(v.assumptions(a), k)
        assert all(getattr(v.assumptions(a), o) for o in LAB_STACK if o != k)
    [own] = [v for v in pt.VARIANTS if "all of memory.LAB_STACK off" in v.name]
    assert not any(getattr(own.assumptions(a), k) for k in LAB_STACK)
    stack = "\n".join(pt.render_stack(base, [(v, variants[v.name]) for v in pt.VARIANTS]))
    for k, (label, source) in pt.STACK.items():
        assert f"- `{k}`, {label}: {source}. Adds " in stack


def test_gaps_name_every_cell_off_target(base):
    """The section on what would have to be true lists exactly the cells that miss the paper's outcome or are more
    than TARGET_PP points off, each with the GiB it would take and the model's numbers to measure against."""
    text = "\n".join(pt.render_gaps(base))
    miss = [c for c in base if not c.matches_paper or (c.error_pp is not None and abs(c.error_pp) > pt.TARGET_PP)]
    assert [line.split("**")[1] for line in text.splitlines() if line.startswith("- **")] == [
        f"{c.scope} {c.recipe}" for c in miss]
    assert text.count("The model's numbers to measure against:") == len(miss)


def test_committed_table_is_current(base, variants, sister):
    """results/scale/paper_t1.md is what the model gives today (python -m fp4moe.analysis.paper_t1 writes it)."""
    text = pt.render(base, [(v, variants[v.name]) for v in pt.VARIANTS], sister)
    assert manifest.load().output("paper_t1").read_text() == text
