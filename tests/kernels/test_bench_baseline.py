"""``fp4moe_kernels.bench.conversions --baseline``: an older copy of the package runs side by side with this one.

The baseline here is this package's own folder, copied: every baseline callable must return what this package's
``convert`` returns on the same inputs (CPU: both dispatch to their reference), in the baseline's own format classes."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import fp4moe_kernels
from fp4moe_kernels import selfcheck
from fp4moe_kernels.bench import conversions as bench
from fp4moe_kernels.bench.timing import environment
from fp4moe_kernels import convert as ops


def test_baseline_copy_runs_side_by_side_and_agrees(tmp_path):
    src = Path(fp4moe_kernels.__file__).parent
    base = tmp_path / "fp4moe_kernels"
    shutil.copytree(src, base, ignore=shutil.ignore_patterns("__pycache__"))
    try:
        bops, bfmt = bench.load_baseline(str(base))
        assert bops.__file__.startswith(str(base)) and bfmt is not sys.modules["fp4moe_kernels.formats"]
        shape = bench.Shape("t", 256, 256, [100, 0, 156])
        x = selfcheck.make_input(256, 256, seed=5)
        a = ops.bf16_to_fp4_row(x)
        f = ops.bf16_to_fp8_row(x, shape.counts)
        ours, theirs = bench._ours(shape, x, a, f), bench._ours(shape, x, a, f, bops, bfmt)
        assert ours.keys() == theirs.keys()
        for kernel in ours:
            got, want = theirs[kernel](), ours[kernel]()
            flat = lambda r: r if isinstance(r, tuple) else (r,)  # noqa: E731
            for g, w in zip(flat(got), flat(want)):
                if isinstance(w, torch.Tensor):
                    assert torch.equal(g.view(torch.int16), w.view(torch.int16)), kernel
                else:
                    assert type(g).__module__ == "fp4moe_kernels_baseline.formats", kernel
                    assert torch.equal(g.data.view(torch.uint8), w.data.view(torch.uint8)), kernel
                    assert torch.equal(g.scales, w.scales), kernel
    finally:
        for name in [m for m in sys.modules if m.startswith("fp4moe_kernels_baseline")]:
            del sys.modules[name]


def test_weight_quantizer_rows_run_beside_two_baselines(tmp_path, monkeypatch):
    """The weight quantizer's rows (``run_weights``, on the CPU under the interpreter, one call each instead of a
    timing): this package's launcher and two baseline copies loaded side by side (each under its own package name,
    as ``--baseline`` given twice loads them) give the same four tensors, bytes counted as documented; without a
    loaded baseline there is no baseline quantizer."""
    src = Path(fp4moe_kernels.__file__).parent
    folders = [tmp_path / "a" / "fp4moe_kernels", tmp_path / "b" / "fp4moe_kernels"]
    for folder in folders:
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("__pycache__"))
    calls = []
    monkeypatch.setattr(bench, "do_bench", lambda fn, warmup_ms, rep_ms: calls.append(fn()) or 0.5)
    try:
        names = [bench.BASELINE_MODULE, bench.BASELINE_MODULE + "_1"]
        for folder, name in zip(folders, names):
            bench.load_baseline(str(folder), name)
        quantizers = [bench.baseline_weight_quantizer(name) for name in names]
        assert [q.__module__ for q in quantizers] == [f"{n}.triton_kernels.launchers" for n in names]
        assert [sys.modules[n].__file__ for n in names] == [str(f / "__init__.py") for f in folders]
        shape = bench.WeightShape("2x[256,384] +T", 2, 256, 384)
        rows = bench.run_weights([shape], 4000.0, 1, 1, list(zip(("a", "b"), quantizers)), log=lambda *a: None,
                                 device="cpu")
        el = 2 * 256 * 384
        assert [(r.kernel, r.impl) for r in rows] == [("quantize_weight_128x128", "fp4moe"),
                                                      ("quantize_weight_128x128", "fp4moe a"),
                                                      ("quantize_weight_128x128", "fp4moe b")]
        assert all(r.bytes == 2 * el + 2 * (el + 4 * el // 128 ** 2) and r.ms == 0.5 for r in rows)
        ours, first, second = calls
        assert len(ours) == 4 and ours[2].shape == (2, 384, 256)
        for theirs in (first, second):
            for a, b in zip(ours, theirs):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    finally:
        for name in [m for m in sys.modules if m.startswith("fp4moe_kernels_baseline")]:
            del sys.modules[name]
    assert bench.baseline_weight_quantizer() is None


def test_a_baseline_from_before_the_rename_loads_its_ops_module(tmp_path):
    """Commits before issue P9 named the public API's module ops.py (now convert.py): a baseline of such a commit
    still loads."""
    src = Path(fp4moe_kernels.__file__).parent
    base = tmp_path / "fp4moe_kernels"
    shutil.copytree(src, base, ignore=shutil.ignore_patterns("__pycache__"))
    (base / "convert.py").rename(base / "ops.py")
    try:
        bops, _ = bench.load_baseline(str(base))
        assert bops.__file__ == str(base / "ops.py") and callable(bops.bf16_to_fp4_row)
    finally:
        for name in [m for m in sys.modules if m.startswith("fp4moe_kernels_baseline")]:
            del sys.modules[name]


def test_baseline_folder_without_package_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="git archive"):
        bench.load_baseline(str(tmp_path))


def test_two_baselines_with_one_label_are_refused_before_anything_runs(capsys):
    """Two --baseline copies under one label would share a column: refused at argument parsing, naming the label
    and the fix, on any machine (no GPU needed to be told)."""
    with pytest.raises(SystemExit) as e:
        bench.main(["--baseline", "build/x/fp4moe_kernels:old", "--baseline", "build/y/fp4moe_kernels:old"])
    assert e.value.code == 2
    assert "the label 'old' is taken by another --baseline" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--tokens", "0"], "--tokens 0: give a whole number >= 1"),
    (["--sweep", "--sweep-kernels", "fp8_row_to_fp4,fp8_row_to_fp5"], "--sweep-kernels: fp8_row_to_fp5 not among"),
    (["--sweep-kernels", "fp8_row_to_fp4"], "--sweep-kernels picks what --sweep sweeps: add --sweep"),
])
def test_a_bad_argument_is_refused_before_the_gpu_check(capsys, args, message):
    """On the GPU machine a typo used to start the benchmark (or sweep nothing); here, without a GPU, it used to be
    the 'needs a CUDA GPU' line: either way the mistake showed only after device time was spent."""
    with pytest.raises(SystemExit) as e:
        bench.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_second_run_of_the_day_at_one_commit_keeps_the_first(tmp_path):
    """bench.write names files by GPU, date and commit; a second run that day at that commit (make reproduce-table
    --rerun) gets its time appended instead of replacing the first run's files."""
    rows = [bench.Row("dense", "bf16_to_fp4_row", "fp4moe", 0.125, 1000, 8.0, 0.2)]
    env = {"date": "2026-12-02T08:21:47Z", "commit": "4aa6bd7", "gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6",
           "cuda": "13.0", "command": "python -m fp4moe_kernels.bench.conversions"}
    first = bench.write(str(tmp_path), env, 4240.0, rows, [])
    second = bench.write(str(tmp_path), {**env, "date": "2026-12-02T08:30:53Z"}, 4242.0, rows, [])
    assert Path(first).name == "kernels_h200_2026-12-02_4aa6bd7"
    assert Path(second).name == "kernels_h200_2026-12-02_4aa6bd7_083053"
    assert json.loads(Path(first + ".json").read_text())["copy_gbps"] == 4240.0
    assert json.loads(Path(second + ".json").read_text())["copy_gbps"] == 4242.0
    assert len(list(tmp_path.iterdir())) == 6


def test_the_recorded_command_names_no_machine_folder(monkeypatch):
    """``environment`` (shared by the kernel, CUDA and SwiGLU benchmarks) records the command as results/ keeps it:
    ``make reproduce-table``'s absolute ``--out`` becomes ``<repo>/results/kernels``. Only the GPU query is stood in."""
    pytest.importorskip("triton")
    from fp4moe.paths import results_dir

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    env = environment(f"python -m fp4moe_kernels.bench.conversions --out {results_dir() / 'kernels'}", "4aa6bd7")
    assert env["command"] == "python -m fp4moe_kernels.bench.conversions --out <repo>/results/kernels"
    assert env["commit"] == "4aa6bd7" and env["gpu"] == "NVIDIA H200"
