"""fp4moe.analysis.calibration recomputed from the H200 runs archives results/manifest.yaml names: each cell is a run
of those archives, its measured numbers as the archive logged them; the saved activations agree with the model to the
byte up to what the model does not hold (the router's scalars, fp8's real routing padding); every measured peak is
within 5 %, for the code the manifest says the run measured; results/scale/calibration.md is what they give today.

About 30 s (the document; the MLflow round trip of --check when mlflow is installed): JSON + arithmetic, no torch.
"""
import json
from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from fp4moe.analysis import calibration as cal
from fp4moe.analysis import manifest
from fp4moe.runs.archive import load, withdrawn
from fp4moe.scale import memory
from fp4moe.scale.memory import GB, compose_cfg, per_gpu_memory

# Unmodelled constants per micro-batch: fp32 scalars of the router / aux loss (76 B; 28 B when attention and norms
# are recomputed; 12 B when the whole attention block is). fp8 differs by the real routing's padding of the FP8
# column copies (the model: expected padding).
SCALARS = {"none": 76, "mla_up_proj": 76, "attn_ln_experts": 28, "attn_ln_mlp": 28, "full": 0,
           "attn_block_ln_experts": 12, "attn_block_ln_mlp": 12}


@pytest.fixture(scope="module")
def cells():
    return cal.load_cells()


@pytest.fixture(scope="module")
def rows(cells):
    return cal.table(cells)


@pytest.fixture(scope="module")
def fits():
    return cal.fit_rows()


def _runs(archive):
    """The runs of an archive as the table reads them: each run's metrics without the withdrawn ones."""
    doc = load(archive.path)
    gone = withdrawn(doc)
    return [({k: v for k, v in r["metrics"].items() if k not in gone}, r) for r in doc["runs"]]


def test_cells_are_the_runs_of_the_manifests_archives(cells):
    """One cell per run of the manifest's one-GPU archives that logged its saved bytes, with the commit and the code
    the manifest gives its archive; the measured numbers are the archive's own (saved bytes at the first step, the
    peak at the last); OOM runs have no peak."""
    archives = cal.archives("one_gpu")
    entries = manifest.load().inputs("calibration", "one_gpu")
    assert [a.commit for a in archives] == [e.commit for e, _ in entries] and all(a.path.is_file() for a in archives)
    want = []
    for a in archives:
        for m, r in _runs(a):
            if m.get("saved_activation_bytes_per_micro_batch"):
                oom = r["tags"].get("outcome") == "OOM"
                peak = m.get("summary/peak_mem_allocated_gb")
                want.append((a.name, a.commit, r["tags"]["recipe"], r["tags"]["recompute"],
                             int(m["saved_activation_bytes_per_micro_batch"][0][1]),
                             None if oom or not peak else float(peak[-1][1]), "OOM" if oom else "ok"))
    got = [(c.archive, c.commit, c.recipe, c.scope, c.saved_bytes, c.peak_gib, c.outcome) for c in cells]
    assert sorted(got, key=repr) == sorted(want, key=repr) and len(got) > 200
    code = {a.name: a.code for a in archives}
    assert all(c.code == code[c.archive] for c in cells)
    assert any(c.outcome == "OOM" for c in cells)   # OOM runs that got past the forward: their saved bytes count


def test_saved_bytes_exact(rows):
    """The model's saved bytes per micro-batch are the measured ones less the router's fp32 scalars it does not hold;
    fp8 within 0.1 % (the FP8 column copies padded to 128 rows per expert as the real routing falls; the model takes
    the expected (128 - 1) / 2 rows); one code version, which packed MLA's RoPE frequencies [4096, 1, 1, 64] fp32 of
    the 4 layers' up-projection checkpoints to MXFP4 too (the bug fixed after it; the model counts them exact), saved
    exactly that much less under mxfp4 mla_up_proj."""
    rope = 4096 * 64 * 4 - (4096 * 64 // 2 + 4096 * 64 // 32)
    packed = set()
    for r in rows:
        c = r.cell
        diff = c.saved_bytes - r.pred_saved_bytes
        if c.recipe == "fp8" and c.scope != "full":
            assert abs(r.saved_err_pct) < 0.1
        elif diff == SCALARS[c.scope] - 4 * rope:
            packed.add((c.commit, c.recipe, c.scope))
        else:
            assert diff == SCALARS[c.scope], (c.archive, c.recipe, c.scope, c.micro_batch)
    assert len({commit for commit, _, _ in packed}) == 1 and {x[1:] for x in packed} == {("mxfp4", "mla_up_proj")}
    (commit,) = {commit for commit, _, _ in packed}
    assert all("RoPE" in e.what for e, _ in manifest.load().inputs("calibration", "one_gpu")
               if e.commit == commit and "probe" in e.path)


def test_whole_block_scopes_save_what_the_model_says(rows):
    """Recomputing the whole MLA block instead of the core attention changes the saved bytes by exactly what the model
    says: bf16 and mxfp4 to the router's scalars, and fp8 by the same FP8 padding excess as the core-attention scope
    at the same micro-batch (seed and data fix the routing, so the same copies are padded)."""
    excess = {}
    for r in rows:
        c = r.cell
        if c.micro_batch == 32 and c.scope in ("attn_ln_experts", "attn_ln_mlp", "attn_block_ln_experts",
                                                "attn_block_ln_mlp"):
            excess.setdefault((c.recipe, c.scope), set()).add(c.saved_bytes - r.pred_saved_bytes - SCALARS[c.scope])
    for recipe in ("bf16", "fp8", "mxfp4"):
        for part in ("experts", "mlp"):
            if (recipe, f"attn_block_ln_{part}") not in excess:
                continue
            assert excess[(recipe, f"attn_block_ln_{part}")] == excess[(recipe, f"attn_ln_{part}")]
            assert len(excess[(recipe, f"attn_ln_{part}")]) == 1
    assert excess[("fp8", "attn_block_ln_experts")] == {24 * 2**20}
    assert excess[("mxfp4", "attn_block_ln_mlp")] == {0}


def test_peaks_within_target_for_the_code_measured(rows):
    """Every measured peak within 5 % of the model for the code the manifest says its archive measured; the predicted
    peak and phase are memory.per_gpu_memory's for that code, the 'now' column FIRST_PRINCIPLES' (one GPU: the
    most loaded stage is the only one); checked on a sample of the rows (every one: the committed table)."""
    assert all(r.within_target for r in rows if r.cell.peak_gib is not None)
    for r in rows[::25]:
        cfg = OmegaConf.create(r.cell.cfg)
        b = per_gpu_memory(cfg, replace(r.cell.code, expert_rows_factor=r.cell.rows_factor_max or 1.0))
        assert (b.allocated_gb, b.peak_phase) == (r.pred_peak_gib, r.pred_phase)
        now = per_gpu_memory(cfg, replace(cal.FIRST_PRINCIPLES, expert_rows_factor=r.cell.rows_factor_max or 1.0))
        assert now.allocated_gb == r.pred_peak_now_gib


def test_the_removed_wastes_change_only_what_they_should(rows):
    """Today's code (no dead expert-backward buffers, no BF16 norm input beside its MXFP4 cache) predicts the same
    peak for bf16, lower ones for fp8 and mxfp4 (more for mxfp4: it also dropped the decoded H and, under attn_ln_*,
    the BF16 norm inputs), for the runs of the code that kept them (the manifest's ``code``); the same for the runs
    of later code."""
    old = [r for r in rows if r.cell.code.expert_backward_keeps_dead]
    assert old and all(r.cell.code.norm_cache_keeps_bf16 for r in old)
    # every archive measured dispatchers that kept their recomputed graph (but those whose code says otherwise):
    # under full recompute today's code frees the later MoE layers' inputs and input gradients (two layers after the
    # first MoE layer: 2 inputs + 1 gradient [T, H] bf16, the other gradient being the first layer's output
    # gradient, counted anyway; less where the deepest MoE layer's backward is not the largest phase without them)
    th = lambda c: 2 * c.micro_batch * 4096 * 2048
    drops = lambda r: not r.cell.code.dispatcher_keeps_recompute_graph
    assert all(r.pred_peak_now_gib == r.pred_peak_gib for r in rows if r not in old and r.cell.scope != "full")
    assert all(r.pred_peak_now_gib == r.pred_peak_gib for r in rows if drops(r))
    for r in rows:
        if r not in old and r.cell.scope == "full" and not drops(r):
            assert 0 < (r.pred_peak_gib - r.pred_peak_now_gib) * GB <= 3 * th(r.cell)
    for r in old:
        c = r.cell
        if c.recipe == "bf16" and c.scope != "full":
            assert r.pred_peak_now_gib == r.pred_peak_gib
        else:
            assert r.pred_peak_now_gib < r.pred_peak_gib
    drop = {(r.cell.recipe, r.cell.scope): (r.pred_peak_gib - r.pred_peak_now_gib) / (r.cell.micro_batch * 4096)
            for r in old if r.cell.micro_batch == 16}
    # per token, in [R, H] bf16 buffers (R = 8 T, H = 2048): fp8 1.5 (the old peak at fc1's dgrad, with the dead
    # buffers) less fc1's weight gradient dW1 (4096 B per token at micro-batch 16), live at fc1's wgrad, the peak
    # now; mxfp4 2.5 less x's FP8 column copy [H, Mp] + scales, rebuilt at fc1's wgrad, its peak now (0.52), less dW1;
    # + 2 x 4 layers x [T, H] (1.0) under attn_ln_*
    u = 8 * 2 * 2048 / GB
    dw1 = 2 * 32 * 2 * 1024 * 2048 / (16 * 4096) / GB
    assert drop[("fp8", "none")] == pytest.approx(1.5 * u - dw1, rel=2e-3)
    assert drop[("mxfp4", "none")] == pytest.approx(1.98 * u - dw1, rel=1e-3)
    assert drop[("mxfp4", "attn_ln_mlp")] == pytest.approx(drop[("mxfp4", "none")] + u)


def test_dispatcher_fix_lowered_the_measured_peaks_as_predicted(rows):
    """The trainer that drops megatron's dispatcher probabilities after each MoE forward: the full-recompute peaks
    measured on the first archive of its code (the manifest's first ``code`` without
    ``dispatcher_keeps_recompute_graph``) sit below the newest older code's by what the model says, within 10 %."""
    fix = next(a.name for a in cal.archives("one_gpu") if not a.code.dispatcher_keeps_recompute_graph)
    new = {(r.cell.recipe, r.cell.micro_batch): r for r in rows if r.cell.archive == fix and r.cell.scope == "full"}
    assert len(new) >= 2
    for (recipe, mb), r in new.items():
        before = [o for o in rows if (o.cell.recipe, o.cell.scope, o.cell.micro_batch) == (recipe, "full", mb)
                  and o.cell.code.dispatcher_keeps_recompute_graph and not o.cell.code.expert_backward_keeps_dead]
        o = before[-1]  # the newest code measured before
        measured = o.cell.peak_gib - r.cell.peak_gib
        predicted = o.pred_peak_gib - r.pred_peak_gib
        assert predicted > 0 and measured == pytest.approx(predicted, rel=0.1)


def test_fp32_accumulators_count_from_the_second_micro_batch(cells):
    # 4 micro-batches per step: + 4 B per parameter of FP32 accumulators, nothing else changes
    c = next(x for x in cells if (x.recipe, x.scope, x.micro_batch) == ("mxfp4", "none", 16))
    one = OmegaConf.create(c.cfg)
    four = OmegaConf.create(c.cfg)
    four.parallel.global_batch = 4 * int(one.parallel.micro_batch)
    n = per_gpu_memory(four, cal.FIRST_PRINCIPLES)
    diff = n.allocated_bytes - per_gpu_memory(one, cal.FIRST_PRINCIPLES).allocated_bytes
    assert diff == 4 * (n.dense_params + n.expert_params)
    # megatron's DDP (today's trainer) keeps its FP32 gradient buffer from the start: one micro-batch or four alike
    assert per_gpu_memory(one, cal.DDP_CODE).grads_bytes == per_gpu_memory(four, cal.DDP_CODE).grads_bytes == \
        4 * (n.dense_params + n.expert_params)


def test_withdrawn_peaks_are_not_read(tmp_path):
    """An archive's withdrawn metrics (e.g. peaks of a run that leaked memory) are not read: its cells load with
    their saved bytes and no peak."""
    archive = cal.archives("nccl")[0]
    doc = load(archive.path)
    doc["withdrawn_metrics"] = [{"keys": ["summary/peak_mem_allocated_gb"], "reason": "a test"}]
    path = tmp_path / "withdrawn.json"
    path.write_text(json.dumps(doc))
    cells = cal.load_cells([path])
    assert cells and all(c.peak_gib is None and c.saved_bytes > 0 for c in cells)
    assert len(cells) == len(cal.load_cells([archive]))


def test_cfg_from_params_is_the_composed_config(cells):
    c = next(x for x in cells if (x.recipe, x.scope, x.micro_batch) == ("mxfp4", "attn_ln_mlp", 64))
    ref = compose_cfg("proxy_h200", "single_gpu", "attn_ln_mlp", "mxfp4")
    ref.precision.scope = "all_linears"
    ref.parallel.micro_batch = ref.parallel.global_batch = 64
    assert per_gpu_memory(ref).allocated_bytes == per_gpu_memory(OmegaConf.create(c.cfg)).allocated_bytes


def test_committed_table_is_current(rows, fits):
    """results/scale/calibration.md is what the manifest's inputs give today (cal.document; regenerate it with
    python -m fp4moe.analysis.calibration; its header keeps the date and commit it names)."""
    import re

    text = manifest.load().output("calibration").read_text()
    m = re.search(r"on (\d{4}-\d{2}-\d{2}) at commit (\w+)", text)
    assert m, "calibration.md has no date/commit header"
    nccl = cal.table(cal.load_cells(cal.archives("nccl")))
    assert cal.render(rows, date=m.group(1), commit=m.group(2), nccl_rows=nccl, fits=fits,
                      layer=cal.layer_rows()) == text


def _old_nccl():
    """The NCCL archive outside the 5 % check (older code)."""
    (a,) = [a for a in cal.archives("nccl") if not a.checked]
    return a


def test_pipeline_saved_bytes_are_summed_over_the_stages():
    """Under PP the trainer logs the whole model's saved bytes (summed over the stages); the table sums the model's
    stages the same way, and they agree (the older NCCL archive's PP2 runs, outside the 5 % check). Under EP the model
    takes the rows GPU 0's experts received from the run's all-to-all metrics, and the saved bytes agree too; bf16
    (megatron's dispatcher) logged none then, and balanced routing falls 7.7 % short."""
    rows = cal.table(cal.load_cells([_old_nccl()]))
    assert not any(r.checked for r in rows)
    pp = [r for r in rows if int(r.cell.cfg["parallel"]["pipeline"]) == 2]
    ep = {r.cell.recipe: r for r in rows if int(r.cell.cfg["parallel"]["expert"]) == 2}
    assert len(pp) == 2 and set(ep) == {"bf16", "fp8", "mxfp4"}
    assert all(abs(r.saved_err_pct) < 0.05 and r.cell.rows_factor_first == 1.0 for r in pp)
    for rec in ("fp8", "mxfp4"):
        c = ep[rec].cell
        assert 1.15 < c.rows_factor_first < c.rows_factor_max < 1.25 and abs(ep[rec].saved_err_pct) < 0.15
    assert ep["bf16"].cell.rows_factor_first is None and ep["bf16"].saved_err_pct < -7


def _nccl_checked(sharded: bool):
    """The checked NCCL archives whose runs log their optimizer state (the trainer shards it) or do not."""
    out = []
    for a in cal.archives("nccl"):
        if a.checked and all(("summary/optimizer_state_bytes" in m) == sharded for m, _ in _runs(a)):
            out.append(a)
    return out


def test_nccl_runs_of_todays_code_are_checked():
    """The NCCL runs of today's code that kept the optimizer state replicated: every recipe logs its routed rows
    (bf16 too), the saved bytes agree within 0.15 % (EP: GPU 0's experts' rows; PP: summed over the stages) and every
    peak is within 5 %, with the optimizer state replicated over DP as fp4moe.train kept it (the runs' configs said
    distributed_optimizer=true; the trainer of that code never sharded)."""
    (archive,) = _nccl_checked(sharded=False)
    rows = cal.table(cal.load_cells([archive]))
    assert len(rows) == 6 and all(r.checked and r.within_target for r in rows)
    assert all(r.cell.cfg["parallel"]["distributed_optimizer"] is False for r in rows)
    ep = [r for r in rows if int(r.cell.cfg["parallel"]["expert"]) == 2]
    assert {r.cell.recipe for r in ep} == {"bf16", "fp8", "mxfp4"}
    assert all(1.1 < r.cell.rows_factor_first < 1.2 and abs(r.saved_err_pct) < 0.15 for r in ep)
    # with the sharded optimizer the model would predict 0.92 GiB less than each step began with
    cfg = OmegaConf.create(ep[0].cell.cfg)
    cfg.parallel.distributed_optimizer = True
    gap = (per_gpu_memory(OmegaConf.create(ep[0].cell.cfg), cal.FIRST_PRINCIPLES).optimizer_bytes
           - per_gpu_memory(cfg, cal.FIRST_PRINCIPLES).optimizer_bytes) / GB
    assert gap == pytest.approx(0.92, abs=0.01)


def test_distributed_optimizer_runs_match_the_model():
    """The NCCL runs with the distributed optimizer (EP2 x DP2, micro-batch 16): the runs log their sharded optimizer
    state, which is the model's optimizer_bytes up to the padding of the shard buckets; both peaks are within 5 %;
    every step began 0.92 GB lower than the replicated runs, which is test_nccl_runs_of_todays_code_are_checked's
    prediction."""
    (archive,) = _nccl_checked(sharded=True)
    (replicated,) = _nccl_checked(sharded=False)
    rows = cal.table(cal.load_cells([archive]))
    assert {r.cell.recipe for r in rows} == {"fp8", "mxfp4"} and all(r.checked and r.within_target for r in rows)
    runs, old = load(archive.path)["runs"], load(replicated.path)["runs"]

    def last(r, k):
        return r["metrics"][k][-1][1]

    for r in rows:
        cfg = OmegaConf.create(r.cell.cfg)
        assert cfg.parallel.distributed_optimizer is True
        model = per_gpu_memory(cfg, cal.FIRST_PRINCIPLES).optimizer_bytes
        run = next(x for x in runs if x["params"]["precision.name"] == r.cell.recipe)
        held = last(run, "summary/optimizer_state_bytes")
        assert model <= held < model * 1.001  # buckets padded to the DP group size
        before = next(x for x in old if x["params"]["precision.name"] == r.cell.recipe
                      and x["params"]["parallel.micro_batch"] == "16" and x["params"]["recompute.name"] == "attn_ln_mlp")
        start_drop = last(before, "summary/mem_allocated_at_step_start_gb") - last(run, "summary/mem_allocated_at_step_start_gb")
        assert start_drop == pytest.approx(0.92, abs=0.01)


def test_expert_rows_factor_scales_only_the_experts_tensors():
    """MemoryAssumptions.expert_rows_factor: the experts' saved tensors and backward buffers follow the received rows;
    the rest of the layer (and the local permutation index) does not."""
    cfg = compose_cfg("proxy_h200", "single_gpu", "none", "fp8")
    one = {t.name: t.bytes for t in memory.layer_saved_tensors(cfg, "moe", None, cal.FIRST_PRINCIPLES)}
    more = {t.name: t.bytes for t in memory.layer_saved_tensors(
        cfg, "moe", None, replace(cal.FIRST_PRINCIPLES, expert_rows_factor=1.5))}
    grows = {n for n in one if more[n] != one[n]}
    assert grows == {"moe.expert_fc1_in", "moe.expert_swiglu_in", "moe.expert_fc2_in", "moe.expert_probs"}
    assert more["moe.expert_swiglu_in"] == 1.5 * one["moe.expert_swiglu_in"]


def test_check_reads_archives_and_mlflow_stores_alike(tmp_path):
    """--check: the same rows from an archive and from an MLflow store holding its runs (what the next H200 session
    runs before archiving); with the archive's own code the rows are the calibration table's."""
    pytest.importorskip("mlflow")
    from fp4moe.runs.archive import import_files

    old = _old_nccl()
    import_files([old.path], uri=f"sqlite:///{tmp_path / 'mlflow.db'}", log=lambda *a: None)
    text_a, rows_a = cal.check([old.path], code=old.code)
    text_s, rows_s = cal.check([tmp_path / "mlflow.db"], code=old.code)
    key = lambda rows: sorted((r.cell.recipe, r.cell.scope, r.cell.micro_batch, r.cell.saved_bytes, r.cell.peak_gib,
                               r.pred_peak_gib) for r in rows)
    assert key(rows_a) == key(rows_s) == key(cal.table(cal.load_cells([old])))
    assert text_a == text_s and text_a.startswith("4 of 5 measured peaks within 5 % of the model for the code")
    assert "| mxfp4 | attn_ln_mlp | EP1 DP1 PP2, 4 x 8 | 8 |" in text_a


def test_routing_is_read_from_rows_where_logged(tmp_path):
    """Runs that log routed rows (every recipe since the trainer counts them) give their routing to the model from
    the rows; older runs from the recipe dispatcher's bytes; bf16 runs before that have none."""
    doc = load(_old_nccl().path)
    run = next(r for r in doc["runs"] if r["tags"]["recipe"] == "bf16" and r["params"]["parallel.expert"] == "2")
    hist = [[s, 0.0, 0] for s in range(1, 17)]
    run["metrics"]["a2a/dispatch_forward_sent_rows"] = [[s, 1000.0, t] for s, _, t in hist]
    run["metrics"]["a2a/dispatch_forward_received_rows"] = [[s, 1100.0 + 10 * s, t] for s, _, t in hist]
    doc["runs"] = [run]
    path = tmp_path / "one.json"
    path.write_text(json.dumps(doc))
    (c,) = cal.load_cells([path])
    # step 1: 1110 / 1000; the largest measured step (the last): 1260 / 1000
    assert c.rows_factor_first == pytest.approx(1.11) and c.rows_factor_max == pytest.approx(1.26)


def test_what_fits_on_one_h200(rows, fits):
    """The model's error on every one-GPU peak lies inside PEAK_ERR_RANGE, and with the measured usable capacity no
    run contradicts the model: every run of the one-GPU archives (OOM ones too) that fit is predicted to fit or at
    the edge, every OOM run is predicted OOM or at the edge; the runs at the edge went OOM."""
    errs = [r.peak_err_pct() / 100 for r in rows if r.peak_err_pct() is not None]
    lo, hi = cal.PEAK_ERR_RANGE
    assert lo <= min(errs) and max(errs) <= hi
    h = cal.h200_memory()
    c = manifest.constants("calibration")["h200_memory"]
    assert h.usable_gib == c["torch_capacity_gib"] - c["non_torch_gib"] and h.commit
    runs = [r for a in cal.archives("one_gpu") for _, r in _runs(a)]
    assert len(fits) == len(runs) > len(rows)
    assert sum(r.measured == "OOM" for r in fits) == sum(r["tags"].get("outcome") == "OOM" for r in runs) > 0
    assert not [r for r in fits if r.contradicts]
    edge = [r for r in fits if r.predicted == "edge"]
    assert edge and all(r.measured == "OOM" for r in edge)
    # the edge runs were predicted below nvidia-smi's memory and went OOM: why the rule takes the usable capacity
    assert all(r.pred_peak_gib < h.nvidia_smi_gib for r in edge)
    # the rule itself: fits / edge / OOM around the usable capacity, by the model's error range
    assert [cal.fit_outcome(p, 100.0) for p in (97.9, 98.1, 101.2, 101.4)] == ["fits", "edge", "edge", "OOM"]


def test_layer_benchmark_saved_bytes():
    """P2's layer benchmark (the manifest's moe_layer files, EP1 and EP2, every recipe): one forward's measured saved
    bytes (the file's) within 1 % of the model's MoE-layer tensors with the measured rows per expert; the routed
    experts' part to the byte (the file's expert_saved_bytes, fp4moe.ops.grouped_experts.expert_saved_bytes of the
    same counts)."""
    from fp4moe.scale.memory import layer_saved_tensors

    files = cal.layer_files()
    rows = cal.layer_rows()
    docs = [json.loads(f.path.read_text()) for f in files]
    assert [(r.file, r.world_size, r.recipe, r.measured) for r in rows] == [
        (f.path.name, int(d["env"]["world_size"]), x["recipe"], int(x["saved_bytes"]))
        for f, d in zip(files, docs) for x in d["recipes"]]
    assert {r.world_size for r in rows} == {1, 2} and all(0 < r.err_pct < 1.0 for r in rows)
    for doc in docs:
        t, k = doc["shape"]["tokens"], doc["shape"]["top_k"]
        for r in doc["recipes"]:
            cfg = compose_cfg("dsv3_671b", "single_gpu", "none", r["recipe"])
            cfg.model.moe.num_experts, cfg.parallel.expert = doc["shape"]["experts"], doc["env"]["world_size"]
            cfg.parallel.micro_batch, cfg.parallel.seq_length = 1, t
            counts = tuple(r["expert_counts"])
            a = replace(cal.FIRST_PRINCIPLES, expert_counts=counts, expert_rows_factor=sum(counts) / (t * k))
            experts = sum(x.bytes for x in layer_saved_tensors(cfg, "moe", "none", a)
                          if x.name.startswith("moe.expert_"))
            assert experts == r["expert_saved_bytes"]
            # without the counts, balanced padding: fp8's column copies differ, the other recipes' bytes do not
            b = replace(a, expert_counts=())
            other = sum(x.bytes for x in layer_saved_tensors(cfg, "moe", "none", b) if x.name.startswith("moe.expert_"))
            assert (other == experts) == (r["recipe"] != "fp8")
    cfg = compose_cfg("dsv3_671b", "single_gpu", "none", "fp8")
    with pytest.raises(ValueError, match="expert_counts: 3 experts"):
        layer_saved_tensors(cfg, "moe", "none", replace(cal.FIRST_PRINCIPLES, expert_counts=(1, 2, 3)))


def test_layer_benchmark_peak():
    """The layer's peak over its base (the manifest's files with ``peak``, four shapes; every recipe) within 0.1 % of
    memory.standalone_moe_layer_peak, in the phase its allocator trace shows (the routed experts' backward); the other
    files' peaks are not modelled."""
    rows = cal.layer_rows()
    names = {f.path.name for f in cal.layer_files() if f.peak}
    peak = [r for r in rows if r.peak_predicted is not None]
    assert {r.file for r in peak} == names and len(peak) == 3 * len(names) == 12
    assert all(r.peak_predicted is None for r in rows if r.file not in names)
    assert all(abs(r.peak_err_pct) < 0.1 and r.phase == r.traced_phase == "backward" for r in peak)
    assert cal.traced_phase(None) == ""
    fwd = {"by_site": [{"where": "fp4moe/moe/layer.py:120 forward"}, {"where": "torch/functional.py:5 silu"}]}
    assert cal.traced_phase(fwd) == "forward"
    assert cal.traced_phase({"by_site": [*fwd["by_site"], {"where": "grouped_wgrad (ops)"}]}) == "backward"
    md = "\n".join(cal.render_layer(rows))
    assert "not modelled (older code)" in md and "| backward / backward |" in md


def test_cfg_from_params_keeps_the_optimizer_group_of_newer_runs():
    """A run that logged the optimizer group (issue 27's trainer) is modelled with it; older runs have none, and the
    model then falls back to parallel.distributed_optimizer (fp4moe.config.OptimizerSetting)."""
    from fp4moe.config import OptimizerSetting

    old = cal.cfg_from_params({"parallel.data": "2", "parallel.distributed_optimizer": "True", "model.name": "x"})
    assert "optimizer" not in old and "train" not in old
    assert OptimizerSetting.from_config(old).distributed
    params = {"optimizer.name": "offload", "optimizer.distributed": "True", "optimizer.main_grads_dtype": "bf16",
              "optimizer.cpu_offload": "True", "optimizer.offload_fraction": "1.0",
              "optimizer.overlap_cpu_optimizer_d2h_h2d": "True", "optimizer.overlap_grad_reduce": "False",
              "optimizer.bucket_size": "None", "train.params_dtype": "bf16"}
    new = cal.cfg_from_params(params)
    s = OptimizerSetting.from_config(new)
    assert (s.name, s.cpu_offload, s.grad_bytes, s.bucket_size) == ("offload", True, 2, None)
    assert new["train"] == {"params_dtype": "bf16"}
