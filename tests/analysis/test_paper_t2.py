"""fp4moe.analysis.paper_t2: the paper's T2 (the 236B ablation) as experiment=paper_t2 runs it, under T1's assumption
set, every recompute scope and both readings of "attention". Arithmetic only."""
import pytest

from fp4moe.analysis import manifest
from fp4moe.analysis import paper_t2 as p2
from fp4moe.analysis.paper_t1 import paper_setup
from fp4moe.scale.memory import experiment_cfg, per_stage_memory


@pytest.fixture(scope="module")
def rows():
    return p2.rows()


def test_paper_rows_come_from_numbers_yaml():
    assert p2.paper_rows() == {"mxfp4_mlp_shared": (-6.9, -11.0), "mxfp4": (-7.2, -11.0)}


def test_rows_are_the_models_most_loaded_gpu(rows):
    """One row per scope (the experiment's first), each the model's peak for experiment=paper_t2 with that recompute
    group and recipe."""
    assert [r.scope for r in rows] == [s for s, _ in p2.SCOPES]
    assert rows[0].scope == experiment_cfg("paper_t2").recompute.name
    r = rows[-1]
    for rec in p2.RECIPES:
        stages = per_stage_memory(experiment_cfg("paper_t2", f"precision={rec}", f"recompute={r.scope}"), paper_setup())
        assert r.peak_gib[rec] == max(b.total_gb for b in stages)


def test_changes_and_distance_by_hand():
    r = p2.Row("none", "", {"bf16": 40.0, "fp8": 50.0, "mxfp4_mlp_shared": 45.0, "mxfp4": 44.0})
    assert r.change("mxfp4", "fp8") == pytest.approx(-12.0)
    assert r.change("mxfp4", "fp8", points=True) == pytest.approx(-600 / (81559 / 1024))   # (44 - 50) / 81559 MiB
    assert r.change("mxfp4", "bf16") == pytest.approx(10.0)
    paper = {"mxfp4_mlp_shared": (-10.0, 12.0), "mxfp4": (-12.0, 10.0)}
    assert r.distance(paper) == pytest.approx(0.5)                              # |12.5 - 12|: mlp_shared vs bf16


def test_the_two_fp4_rows_differ_only_where_the_experts_are_recomputed(rows):
    """mxfp4_mlp_shared keeps the experts' dispatched rows in BF16 where their recompute checkpoint holds them
    (attn_*_ln_experts); elsewhere fp4moe.recipe cannot tell the two rows apart (the saved-input FP4 covers experts)."""
    for r in rows:
        diff = r.peak_gib["mxfp4_mlp_shared"] - r.peak_gib["mxfp4"]
        assert diff > 5.0 if r.scope.endswith("ln_experts") else abs(diff) < 0.1


def test_what_it_says(rows):
    """FP8 peaks above BF16 where the experts are recomputed (attn_*_ln_experts: their checkpoint keeps the BF16
    dispatched rows under both), as in the paper's T1; T2's summaries need BF16 above FP8, which the model gives only
    in rows that keep the experts' activations (TE's FP8 experts save half of BF16's bytes there)."""
    above = [r for r in rows if r.peak_gib["fp8"] > r.peak_gib["bf16"]]
    assert all(r in above for r in rows if r.scope.endswith("ln_experts"))
    text = p2.render(rows)
    assert f"FP8 peaks above BF16 in {len(above)} of {len(rows)} rows" in text
    below = [r for r in rows if r not in above]
    assert below and all(not r.scope.endswith("ln_experts") and r.scope != "full" for r in below)
    assert "which needs BF16 above FP8: in the model, the rows " in text


def test_committed_table_is_current(rows):
    assert manifest.load().output("paper_t2").read_text() == p2.render(rows)


def test_cli_writes_the_table(rows, tmp_path):
    out = tmp_path / "sub" / "t2.md"
    assert p2.main(["--out", str(out)]) == 0
    assert out.read_text() == p2.render(rows) and not list(out.parent.glob("*.tmp"))
