"""tools/device/choose_t1_mb.py: the T1 twin's micro-batch from probe runs in real MLflow stores: a least-squares
line per cell through its probed micro-batches, OOM probes as upper bounds, and the micro-batch whose predicted
fit/OOM pattern matches the paper's T1 in the most cells (ties: the larger)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tool_module import load_tool

pytest.importorskip("mlflow")

ROOT = Path(__file__).resolve().parents[1]
choose_t1_mb = load_tool("tools/device/choose_t1_mb.py")

# peak GiB = a + b * micro-batch per (scope, recipe): heavy scope fits everywhere up to ~30, the lighter scopes only
# for mxfp4 (slopes chosen so that micro-batch 20 matches the paper's 9 cells with 120 GiB usable)
LINES = {("attn_ln_experts", "bf16"): (10, 5.0), ("attn_ln_experts", "fp8"): (10, 5.2), ("attn_ln_experts", "mxfp4"): (10, 3.0),
         ("attn_ln_mlp", "bf16"): (10, 6.0), ("attn_ln_mlp", "fp8"): (10, 7.0), ("attn_ln_mlp", "mxfp4"): (10, 3.5),
         ("mla_up_proj", "bf16"): (10, 6.5), ("mla_up_proj", "fp8"): (10, 6.2), ("mla_up_proj", "mxfp4"): (10, 4.0)}


def _store(path: Path, micro_batches, oom=()) -> str:
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    uri = f"sqlite:///{path}"
    c = MlflowClient(tracking_uri=uri)
    exp = c.create_experiment("proxy_t1_probe")
    for (scope, recipe), (a, b) in LINES.items():
        for mb in micro_batches:
            r = c.create_run(exp).info.run_id
            tags = [RunTag("recipe", recipe), RunTag("recompute", scope)]
            metrics = []
            if (scope, recipe, mb) in oom:
                tags.append(RunTag("outcome", "OOM"))
            else:
                metrics = [Metric("summary/peak_mem_allocated_gb", a + b * mb, 0, 4),
                           Metric("summary/tgs_median", 1000.0 * mb, 0, 4)]
            c.log_batch(r, params=[Param("parallel.micro_batch", str(mb))], tags=tags, metrics=metrics)
    return str(path)


def test_two_point_lines_pick_the_micro_batch_of_the_paper_pattern(tmp_path):
    db = _store(tmp_path / "probe.db", (8, 16))
    cells = choose_t1_mb.read_cells([db])
    assert len(cells) == 9 and all(len(p) == 2 for p in cells.values())
    a, b = choose_t1_mb.line(cells[("attn_ln_mlp", "fp8")])
    assert (round(a, 6), round(b, 6)) == (10.0, 7.0)
    m, score = choose_t1_mb.choose(cells, 120.0)
    # fp8 at the heaviest scope fits while 10 + 5.2 m <= 120 (m <= 21); bf16 / fp8 at the lighter scopes must not
    # fit (m > 18.3 for bf16 attn_ln_mlp, the smallest bound) and mxfp4 must (m <= 27.5): 9 of 9 at 20
    assert (m, score) == (20, 9)
    out = tmp_path / "choice.json"
    assert choose_t1_mb.main([db, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["micro_batch"] == 20


def test_an_oom_probe_bounds_the_cell_and_one_point_is_refused(tmp_path):
    db = _store(tmp_path / "probe.db", (8, 16), oom={("attn_ln_experts", "mxfp4", 16)})
    cells = choose_t1_mb.read_cells([db])
    assert choose_t1_mb.predict(cells[("attn_ln_experts", "mxfp4")], 16) is None     # OOM at 16: not at >= 16
    one = _store(tmp_path / "one.db", (8,))
    with pytest.raises(SystemExit, match="one micro-batch only"):
        choose_t1_mb.predict(choose_t1_mb.read_cells([one])[("attn_ln_mlp", "bf16")], 20)
