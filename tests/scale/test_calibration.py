"""fp4moe.scale.calibration recomputed from the committed H200 runs archives (results/train_proxy/): every number
of results/scale/calibration.md, exactly. A change to the memory model or to the archives changes these numbers and
fails here; update them only together with the table (``python -m fp4moe.scale.calibration``) and say why.

Fast: JSON + arithmetic (no torch).
"""
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fp4moe.scale import calibration as cal
from fp4moe.scale.memory import GB, compose_cfg, per_gpu_memory

# (recipe, scope, micro-batch, global batch): (measured saved B, predicted saved B, measured peak GiB or None (OOM),
#                                             predicted peak B first principles, predicted peak B with transient)
EXPECTED = {
    ("bf16", "none", 8, 8): (17736046668, 17736046592, 44.20464038848877, 31722938368, 47310807040),
    ("bf16", "none", 16, 16): (35463704652, 35463704576, 78.2340955734253, 52673918976, 83849656320),
    ("bf16", "attn_ln_experts", 8, 8): (11821030172, 11821030144, 35.82877159118652, 27689329152, 43277197824),
    ("bf16", "attn_ln_experts", 16, 16): (23633670940, 23633670912, 61.46587371826172, 44606700032, 75782437376),
    ("bf16", "attn_ln_experts", 30, 30): (44305792284, 44305792256, 106.30586910247803, 74212099072, 132666606592),
    ("bf16", "attn_ln_experts", 34, 34): (50212112668, 50212112640, 119.12412738800049, 82670784512, 148919226368),
    ("bf16", "attn_ln_mlp", 8, 8): (15595903004, 15595902976, 41.22416400909424, 30910554112, 46498422784),
    ("bf16", "attn_ln_mlp", 16, 16): (31183417372, 31183417344, 72.27220058441162, 51049150464, 82224887808),
    ("bf16", "attn_ln_mlp", 34, 34): (66255324700, 66255324672, None, 96360992256, 162609434112),
    ("bf16", "mla_up_proj", 8, 8): (15584368716, 15584368640, 42.20288944244385, 30109179904, 45697048576),
    ("bf16", "mla_up_proj", 16, 16): (31164543052, 31164542976, 74.23034381866455, 49449547776, 80625285120),
    ("bf16", "mla_up_proj", 34, 34): (66219935308, 66219935232, None, 92965375488, 159213817344),
    ("bf16", "full", 8, 8): (2953478144, 2953478144, 21.534017086029053, 21098762240, 36686630912),
    ("bf16", "full", 16, 16): (5906956288, 5906956288, 32.04843854904175, 31431858176, 62607595520),
    ("fp8", "none", 8, 8): (19460208716, 19460867584, 56.95963525772095, 33447759360, 60815923917),
    ("fp8", "none", 16, 16): (38892564556, 38894034432, 103.54872465133667, 56104248832, 110840577946),
    ("fp8", "attn_ln_experts", 8, 8): (12972890140, 12972890112, 36.6063494682312, 29032176128, 56400340685),
    ("fp8", "attn_ln_experts", 16, 16): (25937391644, 25937391616, 62.88308572769165, 47285957120, 102022286234),
    ("fp8", "attn_ln_experts", 30, 30): (48625269276, 48625269248, None, 79230073856, 181860690944),
    ("fp8", "attn_ln_experts", 34, 34): (55107520028, 55107520000, None, 88356964352, 204671663718),
    ("fp8", "attn_ln_mlp", 8, 8): (16767989788, 16768648704, 53.22335386276245, 32232721920, 59600886477),
    ("fp8", "attn_ln_mlp", 16, 16): (33508126748, 33509596672, 96.07303667068481, 53674173952, 108410503066),
    ("fp8", "attn_ln_mlp", 34, 34): (71175665180, 71176729600, None, 101917441024, 218232140390),
    ("fp8", "mla_up_proj", 8, 8): (17298045004, 17298703872, 36.852816104888916, 31826136576, 59194301133),
    ("fp8", "mla_up_proj", 16, 16): (34572431436, 34573901312, 63.37148427963257, 52864148992, 107600478106),
    ("fp8", "mla_up_proj", 34, 34): (73442031180, 73443095552, None, 100199676928, 216514376294),
    ("fp8", "full", 8, 8): (2953478144, 2953478144, 28.89555263519287, 21575485952, 48943650509),
    ("fp8", "full", 16, 16): (5906956288, 5906956288, 46.648685455322266, 32378868224, 87115197338),
    ("mxfp4", "none", 8, 8): (11173271628, 11173271552, 42.503188610076904, 25158066176, 45478177997),
    ("mxfp4", "none", 16, 16): (22338154572, 22338154496, 74.82587432861328, 39544174592, 80184398234),
    ("mxfp4", "attn_ln_experts", 8, 8): (6038394908, 6038394880, 30.10231876373291, 21447417856, 41767529677),
    ("mxfp4", "attn_ln_experts", 16, 16): (12068401180, 12068401152, 50.013107776641846, 32122877952, 72763101594),
    ("mxfp4", "attn_ln_experts", 30, 30): (22620912156, 22620912128, 108.88462162017822, 50804933120, 127005352448),
    ("mxfp4", "attn_ln_experts", 34, 34): (25635915292, 25635915264, 122.02977895736694, 56142663168, 142503138406),
    ("mxfp4", "attn_ln_mlp", 8, 8): (6523623452, 6523623424, 36.122543811798096, 22168838144, 42488949965),
    ("mxfp4", "attn_ln_mlp", 16, 16): (13038858268, 13038858240, 48.12086296081543, 33565718528, 74205942170),
    ("mxfp4", "attn_ln_mlp", 30, 30): (24440519196, 24440519168, 107.02976274490356, 53510259200, 129710678528),
    ("mxfp4", "attn_ln_mlp", 34, 34): (27698136604, 27698136576, 119.92760562896729, 59208699392, 145569174630),
    ("mxfp4", "mla_up_proj", 8, 8): (9026050124, 9026050048, 30.44225835800171, 23547650048, 43867761869),
    ("mxfp4", "mla_up_proj", 16, 16): (18047905868, 18047905792, 50.662353515625, 36326488064, 76966711706),
    ("mxfp4", "mla_up_proj", 34, 34): (38347081292, 38347081216, None, 65078873600, 151439348838),
    ("mxfp4", "full", 8, 8): (2953478144, 2953478144, 30.25944232940674, 19024941056, 39345052877),
    ("mxfp4", "full", 16, 16): (5906956288, 5906956288, 43.95249080657959, 27284215808, 67924439450),
    ("bf16", "none", 8, 32): (17736046668, 17736046592, 47.08082866668701, 34798243840, 50386112512),
    ("fp8", "none", 8, 32): (19461425228, 19460867584, 59.86916208267212, 36523064832, 63891229389),
    ("mxfp4", "none", 8, 32): (11173271628, 11173271552, 45.424192905426025, 28233371648, 48553483469),
}
TRANSIENTS = {'bf16': 475704.0, 'fp8': 835210.1, 'mxfp4': 620120.6}   # B/token, measured: slope of (peak - first principles) from micro-batch 8 to 16, scope none
WITHIN_5_PCT = [('bf16', 'none', 8, 8), ('bf16', 'none', 16, 16), ('bf16', 'mla_up_proj', 8, 8), ('bf16', 'mla_up_proj', 16, 16), ('fp8', 'none', 8, 8), ('fp8', 'none', 16, 16), ('fp8', 'attn_ln_mlp', 8, 8), ('mxfp4', 'none', 8, 8), ('mxfp4', 'none', 16, 16), ('bf16', 'none', 8, 32), ('fp8', 'none', 8, 32), ('mxfp4', 'none', 8, 32)]

# Unmodelled constants per micro-batch: fp32 scalars of the router / aux loss (76 B; 28 B when attention and norms
# are recomputed). fp8 differs by the real routing's padding of the FP8 column copies (the model: expected padding).
SCALARS = {"none": 76, "mla_up_proj": 76, "attn_ln_experts": 28, "attn_ln_mlp": 28, "full": 0}


@pytest.fixture(scope="module")
def cells():
    return cal.load_cells()


@pytest.fixture(scope="module")
def rows(cells):
    return cal.table(cells, cal.measured_transients(cells))


def test_cells_are_the_runs_we_have(cells):
    assert [(c.recipe, c.scope, c.micro_batch, c.global_batch) for c in cells] == list(EXPECTED)
    assert sum(c.outcome == "OOM" for c in cells) == 7 and sum(c.peak_gib is not None for c in cells) == 39


def test_measured_transients(cells):
    assert {k: round(v, 1) for k, v in cal.measured_transients(cells).items()} == TRANSIENTS


def test_saved_bytes_exact(rows):
    for r in rows:
        c = r.cell
        meas, pred, peak, fp, calibrated = EXPECTED[(c.recipe, c.scope, c.micro_batch, c.global_batch)]
        assert (c.saved_bytes, r.pred_saved_bytes) == (meas, pred)
        if c.recipe == "fp8" and c.scope != "full":
            assert abs(r.saved_err_pct) < 0.005      # expert padding of real routing, see SCALARS
        else:
            assert c.saved_bytes - r.pred_saved_bytes == SCALARS[c.scope]


def test_peaks_exact(rows, cells):
    tr = cal.measured_transients(cells)
    for r in rows:
        c = r.cell
        meas, pred, peak, fp, calibrated = EXPECTED[(c.recipe, c.scope, c.micro_batch, c.global_batch)]
        cfg = OmegaConf.create(c.cfg)
        assert c.peak_gib == peak
        assert per_gpu_memory(cfg, cal.FIRST_PRINCIPLES).total_bytes == fp
        assert per_gpu_memory(cfg, cal.calibrated(c.recipe, tr)).total_bytes == calibrated
        assert r.pred_peak_gib == calibrated / GB
    assert [(r.cell.recipe, r.cell.scope, r.cell.micro_batch, r.cell.global_batch) for r in rows
            if r.within_target] == WITHIN_5_PCT


def test_f5_runs_check_the_fp32_accumulators(rows):
    # 4 micro-batches per step: + 4 B per parameter of FP32 accumulators, nothing else changes
    by = {(r.cell.recipe, r.cell.scope, r.cell.micro_batch, r.cell.global_batch): r for r in rows}
    for rec in ("bf16", "fp8", "mxfp4"):
        one, four = by[(rec, "none", 8, 8)], by[(rec, "none", 8, 32)]
        n = per_gpu_memory(OmegaConf.create(four.cell.cfg), cal.FIRST_PRINCIPLES)
        assert round((four.pred_peak_fp_gib - one.pred_peak_fp_gib) * GB) == 4 * (n.dense_params + n.expert_params)


def test_cfg_from_params_is_the_composed_config(cells):
    c = next(x for x in cells if (x.recipe, x.scope, x.micro_batch) == ("mxfp4", "attn_ln_mlp", 34))
    ref = compose_cfg("proxy_h200", "single_gpu", "attn_ln_mlp", "mxfp4")
    ref.precision.scope = "all_linears"
    ref.parallel.micro_batch = ref.parallel.global_batch = 34
    assert per_gpu_memory(ref).total_bytes == per_gpu_memory(OmegaConf.create(c.cfg)).total_bytes


def test_committed_table_is_current(rows, cells):
    path = cal.ROOT / cal.DEFAULT_OUT
    text = path.read_text()
    m = re.search(r"on (\d{4}-\d{2}-\d{2}) at commit (\w+)", text)
    assert m, "calibration.md has no date/commit header"
    assert cal.render(rows, cal.measured_transients(cells), date=m.group(1), commit=m.group(2)) == text
