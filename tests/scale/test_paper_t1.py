"""fp4moe.scale.paper_t1: the paper's T1 cells under three gradient / optimizer setups. Arithmetic only."""
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


def test_committed_table_is_current():
    assert (pt.ROOT / pt.DEFAULT_OUT).read_text() == pt.render(pt.cells())
