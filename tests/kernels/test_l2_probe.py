"""tools/device/l2_bandwidth.py on the CPU: the probe's kernel sums (interpreted) equal torch's, and the grouped
wgrad's L2 -> SM operand bytes it reports follow the tile arithmetic."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tool_module import load_tool

tool = load_tool("tools/device/l2_bandwidth.py")


def test_window_sums_equal_torchs():
    g = torch.Generator().manual_seed(0)
    for programs, reps in ((3, 1), (2, 3)):
        x = tool.values(programs * 2 * tool.BLOCK, "cpu", g)
        assert torch.equal(tool.window_sums(x, programs, reps), tool.reference_sums(x, programs, reps))
    with pytest.raises(ValueError, match="multiple of 2048"):
        tool.window_sums(tool.values(3 * 1000, "cpu"), 3, 1)


def test_wgrad_operand_bytes_by_tile():
    """Per 128-token block of an expert (tokens padded to 128) every BN x BK output tile loads (BN + BK) x 128 FP8
    bytes from L2; at the 64x128 tile fc1's (N 4096, K 7168) add up to 64 x 56 tiles x 192 x 128 B per block."""
    run = {"counts": [128, 0, 5], "rows": [
        {"gemm": "fc1 wgrad", "N": 4096, "K": 7168, "candidate": "dense F.scaled_mm (M x N x K)", "ms": 1.0},
        {"gemm": "fc1 wgrad", "N": 4096, "K": 7168, "candidate": "current 64x128 w4 s3", "ms": 2.0}]}
    rows = {r["tile"]: r for r in tool.wgrad_traffic(run)}
    blocks = 1 + 0 + 1
    assert rows["64x128"]["l2_to_sm_gb"] * 1e9 == blocks * 64 * 56 * 192 * 128
    assert rows["128x256"]["l2_to_sm_gb"] * 1e9 == blocks * 32 * 28 * 384 * 128
    r = rows["64x128"]
    assert r["gb_s_at_wgrad_ms"] == pytest.approx(r["l2_to_sm_gb"] / 2e-3) and r["gb_s_at_dense_ms"] == pytest.approx(
        2 * r["gb_s_at_wgrad_ms"])
    assert json.dumps(tool.wgrad_traffic(json.loads(tool.WGRAD_RUN.read_text())))   # the recorded run reads


def test_traffic_table_takes_the_named_runs_times(capsys):
    """``--traffic --wgrad-run RUN`` (no GPU) prints the table at that run's times, not the default run's: the H100's
    wgrad beside the H100's probe."""
    h100 = tool.ROOT / "results/moe_layer/wgrad_current_h100_2026-12-05_49fc0f7.json"
    run = json.loads(h100.read_text())
    current = next(r["ms"] for r in run["rows"] if r["gemm"] == "fc1 wgrad" and r["candidate"].startswith("current"))
    assert tool.main(["--traffic", "--wgrad-run", str(h100)]) == 0
    out = capsys.readouterr().out
    row = next(r for r in tool.wgrad_traffic(run) if r["gemm"] == "fc1 wgrad" and r["tile"] == "64x128")
    assert row["wgrad_ms"] == current and str(h100) in out
    assert f"| fc1 wgrad | 64x128 | 23.7 | {row['gb_s_at_wgrad_ms']:.0f} |" in out
    default = next(r for r in tool.wgrad_traffic(json.loads(tool.WGRAD_RUN.read_text()))
                   if r["gemm"] == "fc1 wgrad" and r["tile"] == "64x128")
    assert default["wgrad_ms"] != current



def test_every_pass_loads_from_memory_in_the_compiled_kernel():
    """Compiled for sm_90 (Triton's ptxas; a subprocess with TRITON_INTERPRET=0, as this session interprets), the
    probe's loads sit inside the passes loop at 2, 5 and 10 steps per window (5: the default buffer on 132 SMs, where
    the pass count as a compile-time constant let the compiler unroll the passes and load each address once: an H100
    run reported 23 TB/s), and the check does find the hoisted loads of the probe's first form (``ROTATE=False``, the
    same addresses every pass: the H100 run of 2026-12-05 reported 27 TB/s from it)."""
    out = subprocess.run([sys.executable, str(tool.__file__), "--sass-check"], capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="0"), timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "window_sum_kernel: True" in out.stdout and "ROTATE=False (the first form): False" in out.stdout
