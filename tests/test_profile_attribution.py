"""tools/profile_attribution.py on excerpts of real torch.profiler traces (H200, the proxy at attention + layernorm +
MLP, micro-batch 32, fp8 and mxfp4, 2026-12-01; tests/data/profile/: 48 kernels each with their launches and the CPU
ops around them, all other events and fields dropped): the per-kernel table attributes each launch to the autograd
function that issued it, and the comparison's times are the traces' own sums."""
from __future__ import annotations

import collections
import json
import re
from pathlib import Path

from tool_module import load_tool

ROOT = Path(__file__).resolve().parents[1]
pa = load_tool("tools/profile_attribution.py")

FP8 = ROOT / "tests/data/profile/h200_fp8_attn_ln_mlp_mb32_excerpt.json"
MXFP4 = ROOT / "tests/data/profile/h200_mxfp4_attn_ln_mlp_mb32_excerpt.json"


def _kernels(path):
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel"]


def test_kernel_rows_sum_the_matching_kernels_and_name_their_callers():
    ev = pa.load(str(MXFP4))
    rows = pa.kernel_rows(ev, "fp4|fp8")
    want = sum(k["dur"] for k in _kernels(MXFP4) if re.search("fp4|fp8", k["name"]))
    assert abs(sum(r[3] for r in rows) - want) < 1e-6 and sum(r[4] for r in rows) == sum(
        1 for k in _kernels(MXFP4) if re.search("fp4|fp8", k["name"]))
    assert [r[3] for r in rows] == sorted((r[3] for r in rows), reverse=True)
    frames = collections.defaultdict(set)
    for r in rows:
        frames[(r[0], r[1])].add(r[2])
    # the same quantizer at the same size is launched by the dispatch (the all-to-all) and by the experts' forward
    # (the SwiGLU input's MXFP4 copy): two rows; the decode of that input by the experts' backward
    assert frames[("bf16_to_fp4_row_kernel", "[524288, 1, 1]")] == {"_QuantizedAllToAll", "GroupedExpertMLP"}
    assert all(f.startswith("GroupedExpertMLPBackward") for f in frames[("fp4_to_bf16_kernel", "[524288, 1, 1]")])
    assert all(not f.startswith("aten::") for r in rows for f in r[2].split(" < "))


def test_compare_rows_are_each_traces_sums_by_name():
    a, b = pa.load(str(FP8)), pa.load(str(MXFP4))
    rows = pa.compare_rows(a, b)
    ta, tb = collections.Counter(), collections.Counter()
    for k in _kernels(FP8):
        ta[k["name"]] += k["dur"]
    for k in _kernels(MXFP4):
        tb[k["name"]] += k["dur"]
    assert {r[0] for r in rows} == set(ta) | set(tb)
    assert all(abs(x - ta.get(n, 0)) < 1e-6 and abs(y - tb.get(n, 0)) < 1e-6 for n, x, y in rows)
    assert [abs(y - x) for _, x, y in rows] == sorted((abs(y - x) for _, x, y in rows), reverse=True)


def test_the_three_modes_print(capsys):
    assert pa.main([str(MXFP4), "--top", "5"]) == 0
    assert "fp4moe kernels (conversions, SwiGLU, sums)" in capsys.readouterr().out
    assert pa.main([str(MXFP4), "--kernels", "fp4_row_to_fp8_col"]) == 0
    out = capsys.readouterr().out
    assert "fp4_row_to_fp8_col_kernel" in out and "FP8LinearBackward" in out
    assert pa.main([str(FP8), "--compare", str(MXFP4)]) == 0
    out = capsys.readouterr().out
    assert "total" in out and "bf16_to_fp4_row_kernel" in out


GAP = ROOT / "tests/data/profile/h200_mxfp4_attn_ln_mlp_mb32_gap_excerpt.json"


def test_gaps_find_the_host_work_the_gpu_waited_for():
    """--gaps on an excerpt of the mxfp4 profile around one MoE layer's forward (902d750, H200; the GPU events of a
    14 ms window, their launches and the CPU ops overlapping it): the one idle stretch over 1 ms is the 12.2 ms
    before the pinned copy of the grouped GEMM's tile table, spent inside GroupedExpertMLP on the host (the Python
    loop that built the table, replaced since); the idle total is the timeline's own."""
    ev = pa.load(str(GAP))
    gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    window, idle, gaps = pa.idle_gaps(ev, 1e3)
    busy_end, want_idle = gpu[0]["ts"], 0.0
    for e in gpu:
        want_idle += max(0.0, e["ts"] - busy_end)
        busy_end = max(busy_end, e["ts"] + e["dur"])
    assert idle == want_idle and window == busy_end - gpu[0]["ts"]
    assert len(gaps) == 1
    start, length, nxt, host = gaps[0]
    assert 12.0e3 < length < 12.5e3 and nxt == "Memcpy HtoD (Pinned -> Device)"
    assert host[0].startswith("GroupedExpertMLP (12.2") and any(h.startswith("aten::pin_memory") for h in host)
    assert pa.idle_gaps(ev, 20e3)[2] == []  # nothing of 20 ms


COPY = ROOT / "tests/data/profile/h100_fp8_full_mb32_a2a_copy_excerpt.json"


def test_memcpys_count_as_gpu_time_and_are_attributed(capsys):
    """An excerpt of the H100 profile of the T1 proxy (fp8, full recompute, micro-batch 32, b0112f1; results/
    train_proxy/profile_h100_mb32_b0112f1/): two 2.8 ms device-to-device memcpys (the world-size-1 all-to-all's copy
    of the routed rows, which no kernel runs), a small one, a memset and four kernels. The GPU time and its groups
    count the copy engine's work (the tool's kernel-only total hid 73.5 ms of those two steps), and --kernels
    attributes a memcpy to the autograd function that issued it."""
    ev = pa.load(str(COPY))
    work = pa.gpu_events(ev)
    copies = [e for e in work if e["cat"] != "kernel"]
    assert len(work) == 8 and len(copies) == 4
    rows = pa.kernel_rows(ev, "Memcpy DtoD")
    big = [r for r in rows if r[3] / r[4] > 2000]
    assert big and all(r[2].startswith("_QuantizedAllToAll") for r in big)
    assert sum(r[4] for r in rows) == 3 and abs(sum(r[3] for r in rows) - sum(
        e["dur"] for e in copies if e["name"].startswith("Memcpy DtoD"))) < 1e-6
    assert pa.group_of("Memcpy DtoD (Device -> Device)", "gpu_memcpy") == "memcpys and memsets (copy engine)"
    assert pa.main([str(COPY), "--top", "3"]) == 0
    out = capsys.readouterr().out
    total = sum(e["dur"] for e in work) / 1e3
    assert out.startswith(f"GPU time {total:.1f} ms") and "4 memcpys / memsets" in out
    assert "memcpys and memsets (copy engine)" in out and "_QuantizedAllToAll" in out


def test_groups_name_fp4moe_kernels_from_the_package_and_deepgemm_apart_from_cublas():
    """fp4moe's kernels by name (fp4moe_kernels.kernel_names, loaded without torch): its grouped GEMMs, then the rest,
    the SwiGLU, the permutation sums and the CUDA kernel included (by pattern they were torch's); DeepGEMM apart."""
    own = "fp4moe kernels (conversions, SwiGLU, sums)"
    assert pa.group_of("grouped_wgrad_tma_kernel") == pa.group_of("grouped_rows_kernel") == "grouped FP8 GEMMs (Triton)"
    for name in ("bf16_to_fp4_row_kernel", "quantize_weight_128x128_kernel", "_swiglu_bwd_kernel",
                 "gather_sum_rows_kernel", "void fp4_row_to_fp8_col<4>(unsigned char const*, int)"):
        assert pa.group_of(name) == own, name
    assert pa.group_of("void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u>(...)") == "DeepGEMM GEMMs"
    assert pa.group_of("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "cuBLAS GEMMs"
    assert pa.group_of("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long)") == \
        "torch elementwise / copy / cat / index / reductions"
    import subprocess   # the tool still imports no torch (standard library only)
    import sys
    probe = ("import runpy, sys; runpy.run_path('tools/profile_attribution.py', run_name='probe'); "
             "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip() == "False"
