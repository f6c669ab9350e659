"""fp4moe.analysis.throughput_calibration: the measured rate sets as results/scale/h200_constants.yaml gives them, the checks
against the H200 runs the manifest names (what each check reads of its archive), and results/scale/throughput.md
recomputed from them. The model's own arithmetic: tests/scale/test_throughput_model.py. About 30 s (the document)."""
from __future__ import annotations

import math
from dataclasses import asdict, replace

import pytest

from fp4moe.analysis import manifest
from fp4moe.analysis import throughput_calibration as T
from fp4moe.runs.archive import load
from fp4moe.scale.throughput import BLOCK_OF, SCOPES, time_per_token


@pytest.fixture(scope="module")
def constants():
    return manifest.constants("throughput")["throughput"]


def test_rate_sets_are_the_constants_file(constants):
    """Today's set is the 2026-11-30 one with the fields the file changes; the two derived fields are computed from
    what was read (weight quantization: seconds / parameters; SwiGLU: the kernels' ms / the elements they write)."""
    old, now = asdict(T.measured_rates(T.OLD)), asdict(T.measured_rates(T.NOW))
    raw_old, raw_now = constants["rates"][T.OLD], constants["rates"][T.NOW]
    assert raw_now["base"] == T.OLD
    changed = {k for k in now if now[k] != old[k]}
    assert changed == set(raw_now) - {"base", "sources", "attention_source", "swiglu_kernel_ms",
                                      "swiglu_elements"} | {"swiglu_s_per_elem"}
    w = raw_old["weight_quant"]
    per_param = w["seconds"] / math.prod(w["parameters"])
    assert old["weight_quant_s_per_param"] == now["weight_quant_s_per_param"] == per_param
    per = dict(now["swiglu_s_per_elem"])
    for rec, ms in raw_now["swiglu_kernel_ms"].items():
        assert per[rec] == tuple(sum(ms[d]) * 1e-3 / raw_now["swiglu_elements"] for d in ("forward", "backward"))
    assert old["swiglu_s_per_elem"] == () and old["glue_expert_swiglu_ms"] > 0   # the SwiGLU in the glue then
    assert all(len(row) == 3 for s in (T.OLD, T.NOW) for row in T.rate_set(s).sources)


def test_todays_conversions_match_todays_profile():
    """Check 1 with today's constants: the conversion kernels predicted from the kernel benchmarks alone (bytes /
    GB/s) against the micro-batch 32 profiles, within 3 % for both recipes; the measured inputs agree exactly."""
    rows = {(g, r): (p, m) for g, r, p, m in T.profile_check(T.NOW)}
    for rec in ("fp8", "mxfp4"):
        p, m = rows[("conversion kernels (+ weight quantization)", rec)]
        assert abs(p / m - 1) < 0.03, (rec, p, m)
        for g in ("fused SwiGLU kernels (measured input)", "torch glue (measured input)"):
            assert rows[(g, rec)][0] == pytest.approx(rows[(g, rec)][1], rel=1e-9)


def test_check_1_reads_the_cells_the_manifest_names():
    """The archive beside today's profiles holds 30-step cells under three host-thread settings, profiles and memory
    traces: Check 1 takes the 30-step attn_ln_mlp cells of the settings the manifest's tags name, two runs each, and
    their mean."""
    entry, use = manifest.load().one("throughput", "profile_cells")
    every = T.measured_runs(entry.file)
    chosen = T.uses_runs("profile_cells")
    assert chosen == T.measured_runs(entry.file, params=use.get("params"), tags=use.get("tags"))
    for rec in ("fp8", "mxfp4"):
        cell = (rec, "attn_ln_mlp", 32)
        assert len(chosen[cell]) == 2 < len(every[cell])
        assert set(chosen[cell]) < set(every[cell])
    fp8_tags = use.get("tags")["fp8"]
    runs = [r for r in load(entry.file)["runs"] if r["params"].get("train.steps") == "30"
            and (r["tags"]["recipe"], r["tags"]["recompute"], r["params"]["parallel.micro_batch"]) ==
            ("fp8", "attn_ln_mlp", "32") and all(r["tags"].get(k) == v for k, v in fp8_tags.items())]
    assert sorted(chosen[("fp8", "attn_ln_mlp", 32)]) == sorted(r["metrics"]["summary/tgs_median"][-1][1] for r in runs)
    tgs = T.profile_tgs_now()
    assert tgs["fp8"] == sum(chosen[("fp8", "attn_ln_mlp", 32)]) / 2


def test_measured_ratios_from_the_probe():
    """Check 2: every ratio of two cells the probe (the manifest's, superseded for its peaks only) measured at one
    micro-batch; measured = the ratio of its tokens/s, predicted = the inverse ratio of the model's time per token
    with the rates of that code."""
    entry, _ = manifest.load().one("throughput", "probe")
    assert entry.superseded and "superseded/" in entry.path
    meas = T.measured_tgs()
    rows = T.proxy_ratios()
    old = T.measured_rates(T.OLD)
    pairs = {(r.kind, r.a, r.b, r.micro_batch) for r in rows}
    assert len(pairs) == len(rows) and {r.micro_batch for r in rows} == {8, 16}
    for r in rows[:: max(1, len(rows) // 6)]:
        (ra, sa), (rb, sb), mb = r.a, r.b, r.micro_batch
        assert r.measured == meas[(ra, sa, mb)] / meas[(rb, sb, mb)]
        assert r.predicted == (time_per_token(T.proxy_cfg(rb, sb, mb), old).total
                               / time_per_token(T.proxy_cfg(ra, sa, mb), old).total)
    # every equal-scope pair the probe has is a row
    want = sum((a, s, mb) in meas and (b, s, mb) in meas for mb in (8, 16) for s in SCOPES
               for a, b in (("mxfp4", "fp8"), ("fp8", "bf16"), ("mxfp4", "bf16")))
    assert sum(r.kind == "recipe" for r in rows) == want


def test_block_check_reads_both_archives():
    """Check 3's measured ratios are the archives' means: mxfp4 attn_ln_mlp of the core-attention archive only from
    its runs with the CUDA C++ column kernel (the manifest's tags), over two runs; the whole-block cells once."""
    m = manifest.load()
    core_entry, core_use = m.one("throughput", "core_attention_cells")
    assert len(T.measured_runs(core_entry.file)[("mxfp4", "attn_ln_mlp", 32)]) == 4
    core = T.uses_runs("core_attention_cells")
    assert core_use.get("tags") == {"mxfp4": {"env.FP4MOE_CUDA_COL": "1"}}
    assert len(core[("mxfp4", "attn_ln_mlp", 32)]) == 2 and len(core[("fp8", "attn_ln_mlp", 32)]) == 2
    block = T.uses_runs("attn_block_cells")
    assert sorted(block) == sorted([("bf16", "attn_block_ln_experts", 32), ("fp8", "attn_block_ln_experts", 32),
                                    ("mxfp4", "attn_block_ln_experts", 32), ("fp8", "attn_block_ln_mlp", 32),
                                    ("mxfp4", "attn_block_ln_mlp", 32)])
    rows = {(r.a, r.b): r for r in T.block_check()}
    r = rows[(("mxfp4", "attn_block_ln_mlp"), ("mxfp4", "attn_ln_mlp"))]
    mean = sum(core[("mxfp4", "attn_ln_mlp", 32)]) / 2
    assert r.measured == pytest.approx(block[("mxfp4", "attn_block_ln_mlp", 32)][0] / mean, rel=1e-12)
    assert abs(r.error) < 0.03   # within 3 %, with the block's elementwise work
    gemm_only = {(x.a, x.b): x for x in T.block_check(replace(T.block_rates(), attn_block_glue_ms=(0.0, 0.0)))}
    assert gemm_only[(r.a, r.b)].predicted > r.predicted   # its GEMMs alone: a third of the measured cost
    assert not T.block_rates().dispatch_quantize_per_token and T.measured_rates().dispatch_quantize_per_token


def test_paper_prediction_reads_the_paper_either_way():
    """paper_prediction with the whole MLA block as the paper's "attention" gives the same ratios and paper values as
    with the core attention, and the lighter scope (mla_up_proj) gains more in every case."""
    with pytest.raises(ValueError, match="attention='block'"):
        T.paper_prediction(attention="block")
    core, block = T.paper_prediction(), T.paper_prediction(attention="self_attention")
    assert [c[:2] for c in core] == [b[:2] for b in block]
    cells = T.paper_numbers()
    head = core[-1]
    assert head[1] == cells["mla_up_proj"]["mxfp4"]["tgs"] / cells["attn_ln_experts"]["fp8"]["tgs"]
    up = [i for i, c in enumerate(core) if c[0].startswith("mxfp4: mla_up_proj")][0]
    assert all(b > c for b, c in zip(block[up][2], core[up][2]))


def test_proxy_t1_at_one_micro_batch():
    """The proxy's T1 in the paper's terms (one micro-batch, the scope decides what fits): at 64 on an H200 the
    memory model leaves fp8 only full recompute and mxfp4 every scope; the ratios are the throughput model's tokens/s
    over fp8's full-recompute cell. At 32 every fp8 scope fits; on an 80 GiB GPU no fp8 cell fits, so there is no
    fp8 cell to compare with."""
    cells = {(c.recipe, c.scope): c for c in T.proxy_t1_fixed()}
    assert [s for s in SCOPES if cells[("fp8", s)].fits] == ["full"]
    assert all(cells[("mxfp4", s)].fits for s in SCOPES)
    full = time_per_token(T.proxy_cfg("fp8", "full", 64), T.measured_rates()).total
    for s in SCOPES:
        want = full / time_per_token(T.proxy_cfg("mxfp4", s, 64), T.measured_rates()).total
        assert cells[("mxfp4", s)].vs_fp8_best == pytest.approx(want, rel=1e-12)
        assert cells[("bf16", s)].vs_fp8_best is None
    assert cells[("fp8", "full")].vs_fp8_best == 1.0
    at32 = {(c.recipe, c.scope): c for c in T.proxy_t1_fixed(micro_batch=32)}
    assert all(at32[("fp8", s)].fits for s in SCOPES)
    small = T.proxy_t1_fixed(usable_gib=80.0)
    assert not any(c.fits for c in small if c.recipe == "fp8") and all(c.vs_fp8_best is None for c in small)


def test_proxy_t1_row_measured():
    """The row at 64 the manifest names: every cell ran; each cell's outcome, peak and tokens/s as its archive logged
    them (the last run of a cell); none contradicts the prediction (fit where the model says OOM, or OOM where it
    says fits)."""
    entry, use = manifest.load().one("throughput", "proxy_t1_row")
    assert use.get("predicted_at")   # the commit that held the prediction before the row ran
    m = T.proxy_t1_measured()
    pred = {(c.recipe, c.scope): c for c in T.proxy_t1_fixed()}
    assert set(m) == set(pred)
    last = {}
    for r in load(entry.file)["runs"]:
        if r["params"]["parallel.micro_batch"] == str(T.PROXY_T1_MICRO_BATCH):
            last[r["tags"]["recipe"], r["tags"]["recompute"]] = r
    assert set(last) == set(m)
    for k, c in m.items():
        r = last[k]
        assert c.outcome == ("OOM" if r["tags"].get("outcome") == "OOM" else "ok")
        assert c.steps == int(r["params"]["train.steps"])
        assert c.tgs == (None if c.outcome == "OOM" else r["metrics"]["summary/tgs_median"][-1][1])
        assert (c.peak_gib is None) == (c.tgs is None) == (c.outcome == "OOM")
        assert (c.outcome, pred[k].outcome) not in (("OOM", "fits"), ("ok", "OOM"))


def test_bf16_side_from_its_profile(constants):
    """bf16's glue is its own profile's; its cuBLAS GEMMs (dense and per-expert at bf16_dense) land within 2 % of
    that profile; the fp8 / bf16 ratio of the alternated cells (the manifest's bf16_cells) is under-predicted by the
    GPU idle the model leaves out. The 2026-11-30 constants keep fp8's glue for bf16."""
    now = T.measured_rates()
    per = {g: (p, m) for g, p, m in T.profile_check_bf16()}
    p, m = per["cuBLAS GEMMs (BF16: dense and per-expert)"]
    assert abs(p / m - 1) < 0.02
    glue = per["torch glue (measured input)"]
    assert glue[0] == pytest.approx(glue[1], rel=1e-12) and glue[1] == now.glue_ms_bf16
    cfg = T.proxy_cfg("bf16", "attn_ln_mlp", 32)
    old = T.measured_rates(T.OLD)
    assert time_per_token(cfg, old).terms["glue"] == pytest.approx(
        time_per_token(T.proxy_cfg("fp8", "attn_ln_mlp", 32), old).terms["glue"], rel=1e-12)
    b = T.bf16_tgs_now()
    runs = T.uses_runs("bf16_cells")
    assert b["bf16"] == sum(runs[("bf16", "attn_ln_mlp", 32)]) / len(runs[("bf16", "attn_ln_mlp", 32)])
    pred = time_per_token(cfg, now).total / time_per_token(T.proxy_cfg("fp8", "attn_ln_mlp", 32), now).total
    assert pred < b["fp8"] / b["bf16"]
    idle = T.profile_idle_ms()
    assert idle == constants["profiles"]["bf16"]["idle_ms"] and idle["bf16"] > 5 * idle["fp8"]


def test_committed_table_is_what_the_module_writes():
    """results/scale/throughput.md is what the manifest's inputs give today (regenerate it with
    python -m fp4moe.analysis.throughput_calibration)."""
    assert manifest.load().output("throughput").read_text() == T.markdown()


def test_whole_block_scopes_are_the_models():
    assert set(BLOCK_OF) == {"attn_ln_experts", "attn_ln_mlp"}
