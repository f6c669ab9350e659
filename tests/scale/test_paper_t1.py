"""fp4moe.scale.paper_t1: the paper's T1 cells under three gradient / optimizer setups, and the readings (layout x
attention recompute x setup) against the paper's fit / OOM pattern. Arithmetic only."""
from dataclasses import replace

import pytest

from fp4moe.config import parse_pipeline_layout
from fp4moe.scale import paper_t1 as pt
from fp4moe.scale.memory import compose_cfg, per_gpu_memory, per_stage_memory


def test_paper_cells_come_from_numbers_yaml():
    paper = pt.paper_cells()
    assert len(paper) == 9
    assert [k for k, v in paper.items() if v is not None] == [
        ("attn_ln_experts", "bf16"), ("attn_ln_experts", "fp8"), ("attn_ln_experts", "mxfp4"),
        ("attn_ln_mlp", "mxfp4"), ("mla_up_proj", "mxfp4")]
    assert paper["attn_ln_experts", "fp8"] == 74.20 and paper["mla_up_proj", "mxfp4"] == 70.11


def test_cells_are_the_models_most_loaded_and_last_ranks():
    rows = pt.cells()
    assert len(rows) == 3 * 9
    for r in rows[:9] + rows[-9:]:
        cfg = compose_cfg("dsv3_671b", "paper_671b", r.scope, r.recipe)
        a = pt.SETUPS[r.setup]
        b = per_gpu_memory(cfg, a)
        assert (r.peak_gib, r.peak_rank, r.in_flight) == (b.total_gb, b.pipeline_rank, b.in_flight)
        assert r.last_rank_gib == per_stage_memory(cfg, a)[-1].total_gb
        assert r.matches_paper == ((r.peak_gib <= 80) == (r.paper_pct is not None))


def test_setups_change_only_gradients_and_optimizer():
    """Per pipeline rank: BF16 main grads halve the gradient bytes; offloading drops the optimizer bytes; nothing
    else moves."""
    cfg = compose_cfg("dsv3_671b", "paper_671b", "attn_ln_experts", "fp8")
    default, bf16, off = (per_stage_memory(cfg, a) for a in pt.SETUPS.values())
    for d, b, o in zip(default, bf16, off):
        assert d.grads_bytes == 2 * b.grads_bytes and b.optimizer_bytes == d.optimizer_bytes
        assert b.total_bytes == d.total_bytes - b.grads_bytes
        assert o.optimizer_bytes == 0 and o.total_bytes == b.total_bytes - b.optimizer_bytes


def test_layouts_place_every_layer_on_256_gpus():
    """Each layout: PP stages holding the 61 layers, the MTP layer and the loss once, on TP1 x PP x DP = 256 GPUs with
    EP inside DP; PP32 EP8 is conf/parallel/paper_671b.yaml itself."""
    for name, over in pt.LAYOUTS.items():
        p = pt.layout_cfg(name, "attn_ln_mlp", "fp8").parallel
        stages = parse_pipeline_layout(p.pipeline_layout)
        assert len(stages) == p.pipeline and p.pipeline * p.data == p.world_size == 256
        assert p.data % p.expert == 0 and name == f"PP{p.pipeline} EP{p.expert}"
        joined = "".join(stages)
        assert (joined.count("t"), joined.count("m"), joined.count("L"), joined[0]) == (61, 1, 1, "E")
    assert pt.LAYOUTS["PP32 EP8"] == {}


def test_capacity_window_by_hand():
    """Fits where the model is at or below C, OOM above: consistent iff max(paper-fit cells) < min(paper-OOM cells)."""
    paper = {("a", "x"): 60.0, ("b", "x"): None, ("c", "x"): 70.0}
    ok = pt.reading({("a", "x"): 50.0, ("b", "x"): 90.0, ("c", "x"): 75.0}, paper)
    assert ok.window == (75.0, 90.0) and ok.consistent and ok.errors == (-10.0, 5.0)
    bad = pt.reading({("a", "x"): 50.0, ("b", "x"): 74.0, ("c", "x"): 75.0}, paper)
    assert bad.window == (75.0, 74.0) and not bad.consistent
    tie = pt.reading({("a", "x"): 50.0, ("b", "x"): 75.0, ("c", "x"): 75.0}, paper)
    assert not tie.consistent   # a cell at C fits: the OOM cell must be above every fitting one
    assert pt.reading({("a", "x"): 50.0, ("c", "x"): 75.0}, {("a", "x"): 60.0, ("c", "x"): 70.0}).window[1] == float("inf")


@pytest.fixture(scope="module")
def reads():
    return pt.readings()


def test_readings_are_the_model_under_each_layout_attention_and_setup(reads):
    assert len(reads) == len(pt.LAYOUTS) * len(pt.ATTENTION) * len(pt.SETUPS)
    paper = pt.paper_cells()
    for r in (reads[0], reads[-1]):
        a = replace(pt.SETUPS[r.setup], attn_recompute=pt.ATTENTION[r.attention])
        pcts = {k: 100 * per_gpu_memory(pt.layout_cfg(r.layout, *k), a).total_gb / 80 for k in paper}
        assert r == pt.reading(pcts, paper, r.layout, r.attention, r.setup)
    # the default reading is the first table's: PP32 EP8, core attention, megatron's default setup
    first = pt.cells()[:9]
    assert reads[0].window[0] == max(c.pct for c in first if c.paper_pct is not None)


def test_only_the_whole_block_attention_reading_orders_the_cells_as_the_paper(reads):
    """What results/scale/paper_t1.md concludes, as computed: no core-attention reading is consistent, every
    whole-block one is; recomputing the whole block saves memory in the paper's fitting attn_ln_* cells and changes
    nothing at mla_up_proj (no attention recompute there)."""
    assert not any(r.consistent for r in reads if r.attention == "core attention")
    assert all(r.consistent for r in reads if r.attention == "whole self-attention")
    core = {(r.layout, r.setup): r for r in reads if r.attention == "core attention"}
    for r in reads:
        if r.attention == "whole self-attention":
            *attn_ln, mla = zip(r.errors, core[r.layout, r.setup].errors)   # paper_cells' order of its fits
            assert all(w < c for w, c in attn_ln) and mla[0] == mla[1]


def test_committed_table_is_current(reads):
    assert (pt.ROOT / pt.DEFAULT_OUT).read_text() == pt.render(pt.cells(), reads)
