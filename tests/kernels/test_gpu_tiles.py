"""Per-GPU conversion tiles (``launchers.GPU_TILES``): which GPU gets which, their order under FP4MOE_TILES /
kernels.tiles, the first launch applying them, and every such tile bit for bit against the reference."""
import os

import pytest
import torch

from fp4moe_kernels import reference as ref
from fp4moe_kernels import selfcheck
from fp4moe_kernels.formats import FP8RowTensor, Segments
from fp4moe_kernels.switches import Switches, use
from fp4moe_kernels.triton_kernels import launchers

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def tables():
    """The tile table and the once-per-process flag as they were, back after the test."""
    saved, flag = dict(launchers.TILES), launchers._gpu_tiles_set
    yield
    launchers.TILES.clear()
    launchers.TILES.update(saved)
    launchers._gpu_tiles_set = flag


def _devices():
    out = [pytest.param("cpu", id="interpreted")] if INTERPRET else []
    return out + [pytest.param("cuda", id="gpu", marks=[pytest.mark.gpu,
                                                        pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")])]


def test_gpu_names_pick_their_tiles():
    assert launchers.gpu_tiles(H100) == {"fp8_row_to_fp4": (32, 0, 2), "bf16_to_fp8_col": (128, 0, 4)}
    assert launchers.gpu_tiles("NVIDIA H100 PCIe") == launchers.gpu_tiles(H100)
    assert launchers.gpu_tiles("NVIDIA H200") == {} and launchers.gpu_tiles("") == {}  # TILES are the H200's
    for tiles in launchers.GPU_TILES.values():
        assert set(tiles) <= set(launchers.DEFAULT_TILES)


def test_switches_tiles_go_over_the_gpus_and_the_gpus_over_the_defaults(tables):
    launchers.apply_tiles(Switches(), gpu=H100)
    assert launchers.TILES == {**launchers.DEFAULT_TILES, **launchers.gpu_tiles(H100)}
    launchers.apply_tiles(Switches(tiles='{"fp8_row_to_fp4": [64, 0, 4]}'), gpu=H100)
    assert launchers.TILES["fp8_row_to_fp4"] == (64, 0, 4) and launchers.TILES["bf16_to_fp8_col"] == (128, 0, 4)
    launchers.apply_tiles(Switches(), gpu="NVIDIA H200")
    assert launchers.TILES == launchers.DEFAULT_TILES


@pytest.mark.skipif(not INTERPRET, reason="the first-launch path on the CPU runs the kernel under the interpreter")
def test_the_first_launch_applies_the_gpus_tiles_once_and_not_over_named_ones(tables, monkeypatch):
    """The first conversion launch in a process on an H100 (the device name given, the kernel interpreted) takes the
    H100's tiles, except for a kernel FP4MOE_TILES / kernels.tiles names; it does so once."""
    launchers.apply_tiles(Switches(), gpu="")
    launchers._gpu_tiles_set = False
    monkeypatch.setattr(launchers, "_current_gpu", lambda: H100)
    x = selfcheck.make_input(64, 128, 3, special=False)
    f = ref.bf16_to_fp8_row(x, [30, 34])
    named = launchers.DEFAULT_TILES["bf16_to_fp8_col"]  # named with the default's value: kept for being named
    with use(Switches(tiles=f'{{"bf16_to_fp8_col": {list(named)}}}')):
        got = launchers.fp8_row_to_fp4(FP8RowTensor(f.data, f.scales, f.segments))
    assert not selfcheck.compare(got, ref.fp8_row_to_fp4(f))
    assert launchers.TILES["fp8_row_to_fp4"] == (32, 0, 2) and launchers.TILES["bf16_to_fp8_col"] == named
    launchers.TILES["fp8_row_to_fp4"] = launchers.DEFAULT_TILES["fp8_row_to_fp4"]
    launchers.fp8_row_to_fp4(FP8RowTensor(f.data, f.scales, f.segments))
    assert launchers.TILES["fp8_row_to_fp4"] == launchers.DEFAULT_TILES["fp8_row_to_fp4"]  # once per process


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_apply_tiles_reads_this_gpus_name(tables):
    torch.cuda.init()
    launchers.apply_tiles(Switches())
    assert launchers.TILES == {**launchers.DEFAULT_TILES, **launchers.gpu_tiles(torch.cuda.get_device_name())}


@pytest.mark.parametrize("gpu", sorted(launchers.GPU_TILES))
@pytest.mark.parametrize("device", _devices())
def test_every_gpus_tiles_match_the_reference(tables, gpu, device):
    """Each GPU's tiles, forced on this device: ragged segments with an empty expert and a tail, bit for bit."""
    launchers.apply_tiles(Switches(), gpu=gpu)
    counts = [100, 0, 28, 128]
    x = selfcheck.make_input(256, 256, 11, spread=3, special=True)
    seg = Segments.of(counts, 256)
    tiles = launchers.gpu_tiles(gpu)
    if "fp8_row_to_fp4" in tiles:
        f = ref.bf16_to_fp8_row(x, counts)
        got = launchers.fp8_row_to_fp4(FP8RowTensor(f.data.to(device), f.scales.to(device), f.segments))
        assert not selfcheck.compare(got, ref.fp8_row_to_fp4(f))
    if "bf16_to_fp8_col" in tiles:
        assert not selfcheck.compare(launchers.bf16_to_fp8_col(x.to(device), seg), ref.bf16_to_fp8_col(x, seg))


def test_every_gpus_tiles_compile_for_sm90_without_spills():
    """The GPU tiles compiled for sm_90 (``aot.compile_kernel`` in a subprocess with TRITON_INTERPRET=0, as
    test_kernels_compile does for the launcher's tiles): no spills, no local memory. (Not 16-byte accesses:
    FP8RowToFP4 at the H100's (32, 0, 2) gives a thread half a group, in 8-byte loads and stores, and was faster
    there all the same.)"""
    import json
    import subprocess
    import sys

    code = ("import json; from fp4moe_kernels.triton_kernels import aot, launchers\n"
            "for gpu, tiles in launchers.GPU_TILES.items():\n"
            "    for name, t in tiles.items():\n"
            "        r = aot.compile_kernel(name, 7168, tile=t)\n"
            "        print(json.dumps({'gpu': gpu, 'kernel': name, 'spill': r.spill_bytes,\n"
            "                          'local': r.sass['LDL/STL']}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="0"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == sum(len(t) for t in launchers.GPU_TILES.values())
    for r in reports:
        assert r["spill"] == 0 and r["local"] == 0, r
