"""tools/device/load_pairs.py: the equal-load table of ``h200_p3.sh t1load`` from real MLflow stores (one per GPU):
per cell both runs, their mean and spread, and the ratio to the reference cell's mean at the same micro-batch."""
from __future__ import annotations

from pathlib import Path

import pytest

from tool_module import load_tool

pytest.importorskip("mlflow")

ROOT = Path(__file__).resolve().parents[1]
load_pairs = load_tool("tools/device/load_pairs.py")


def _store(path: Path, runs) -> str:
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    c = MlflowClient(tracking_uri=f"sqlite:///{path}")
    exp = c.create_experiment("proxy_t1_1gpu")
    for recipe, scope, mb, tgs, peak in runs:
        r = c.create_run(exp).info.run_id
        metrics = [Metric("summary/tgs_median", tgs, 0, 16), Metric("summary/peak_mem_allocated_gb", peak, 0, 16)]
        c.log_batch(r, params=[Param("parallel.micro_batch", str(mb))],
                    tags=[RunTag("recipe", recipe), RunTag("recompute", scope)], metrics=metrics)
    return str(path)


def test_equal_load_table(tmp_path, capsys):
    gpu0 = _store(tmp_path / "gpu0.db", [("fp8", "attn_ln_mlp", 32, 170000.0, 79.6),
                                         ("mxfp4", "attn_ln_mlp", 32, 166000.0, 44.0),
                                         ("mxfp4", "mla_up_proj", 64, 168000.0, 93.2)])
    gpu1 = _store(tmp_path / "gpu1.db", [("fp8", "attn_ln_mlp", 32, 172000.0, 79.7),
                                         ("mxfp4", "attn_ln_mlp", 32, 165000.0, 44.1),
                                         ("mxfp4", "mla_up_proj", 64, 169000.0, 93.3)])
    assert load_pairs.main([gpu0, gpu1]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| fp8 | attn_ln_mlp | 32 | 2 | 170000, 172000 | 171000 | 1.18 | 79.70 | 1.000 |"
    assert lines[3] == "| mxfp4 | attn_ln_mlp | 32 | 2 | 166000, 165000 | 165500 | 0.61 | 44.10 | 0.968 |"
    # no fp8 attn_ln_mlp at 64: no ratio, unless the reference's micro-batch is given
    assert lines[4].endswith("| 93.30 | - |")
    assert load_pairs.main([gpu0, gpu1, "--ref-mb", "32"]) == 0
    assert capsys.readouterr().out.splitlines()[4].endswith(f"| {168500 / 171000:.3f} |")


def test_missing_store_is_a_clear_error(tmp_path, capsys):
    assert load_pairs.main([str(tmp_path / "nope.db")]) == 2
    assert "no such MLflow store" in capsys.readouterr().err
