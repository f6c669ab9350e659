"""Every benchmark refuses a results folder it could not write before it measures anything.

Before, ``python -m fp4moe.bench.moe_layer --out <a path under a file>`` ran the first recipe and then ended in
NotADirectoryError's traceback, and the GPU benchmarks would have spent their minutes of GPU time the same way;
``--baseline`` with a wrong folder failed only after the tile sweep. Each of them now says what is wrong with
``--out`` (or ``--baseline``) in one line, exit status 2, before any GPU check, on any machine, and creates nothing."""
import os
from pathlib import Path

import pytest

from fp4moe.bench import moe_layer, swiglu_fusion
from fp4moe_kernels.bench import conversions, cuda_col
from fp4moe_kernels.bench.timing import out_problem

MAINS = {
    "fp4moe_kernels.bench.conversions": conversions.main,
    "fp4moe_kernels.bench.cuda_col": cuda_col.main,
    "fp4moe.bench.swiglu_fusion": swiglu_fusion.main,
    "fp4moe.bench.moe_layer": lambda argv: moe_layer.main(
        ["--device", "cpu", "--no-gemm", "--no-profile", "--hidden", "128", "--ffn", "128", "--tokens", "16",
         "--local-experts", "2", "--top-k", "1", "--shared-ffn", "0", "--iters", "1", "--warmup", "0", *argv]),
}


def _refused(main, argv, capsys) -> str:
    """The one line that ``main(argv)`` exits with (status 2 from argparse, or SystemExit's message)."""
    with pytest.raises(SystemExit) as err:
        main(argv)
    code = err.value.code
    if isinstance(code, str):
        return code
    assert code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("bench", MAINS)
def test_an_out_under_a_file_is_refused_before_any_work(bench, tmp_path, capsys):
    blocker = tmp_path / "results.txt"
    blocker.write_text("a file where a folder of results would go\n")
    out = blocker / "kernels"
    line = _refused(MAINS[bench], ["--out", str(out)], capsys)
    assert f"--out {out}: {blocker} is not a folder; give a folder this process can create or write" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]


def test_out_problem_accepts_a_folder_to_create_and_names_the_blocking_file(tmp_path):
    assert out_problem(tmp_path / "a" / "b") is None and not (tmp_path / "a").exists()
    assert out_problem(tmp_path) is None
    (tmp_path / "f").write_text("")
    assert out_problem(tmp_path / "f" / "g" / "h").endswith(f"{tmp_path / 'f'} is not a folder; give a folder this "
                                                            "process can create or write")
    if os.geteuid() != 0:  # root passes the permission bits
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        assert "is not writable" in out_problem(ro / "x")
    if Path("/proc/self").is_dir():  # ... but not /proc (Linux): the probe says so for root too
        assert out_problem("/proc/fp4moe") == ("--out /proc/fp4moe: /proc is not writable; give a folder this process "
                                               "can create or write")
    assert not any(p.name.startswith(".fp4moe-probe-") for p in tmp_path.iterdir())


def test_a_baseline_folder_without_the_package_is_refused_before_any_work(tmp_path, capsys):
    (tmp_path / "old").mkdir()
    line = _refused(conversions.main, ["--out", str(tmp_path / "res"), "--baseline", f"{tmp_path / 'old'}:61fea29"],
                    capsys)
    assert line.endswith(f"--baseline {tmp_path / 'old'}: no fp4moe_kernels package there (__init__.py and formats.py); "
                         "give the unpacked fp4moe_kernels folder of the other commit (git archive <commit> "
                         "kernels/fp4moe_kernels | tar x)"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
