"""The GPU test run covers every GPU test: each file with a test marked ``gpu`` lies under one of the Makefile's
GPU_TESTS paths, which ``make test-gpu`` runs and the device script's ``tests`` phase reads (tests/bench's
--memtrace test had been left out of both)."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _gpu_test_paths() -> list[str]:
    (line,) = re.findall(r"^GPU_TESTS *= *(.+)$", (ROOT / "Makefile").read_text(), re.M)
    return line.split()


def _marks_gpu(tree: ast.Module) -> bool:
    """A ``pytest.mark.gpu`` anywhere: a decorator, ``pytestmark = ...``, or ``pytest.param(..., marks=...)``."""
    return any(isinstance(n, ast.Attribute) and n.attr == "gpu" and isinstance(n.value, ast.Attribute)
               and n.value.attr == "mark" for n in ast.walk(tree))


def test_every_file_with_gpu_tests_is_in_the_gpu_run():
    paths = _gpu_test_paths()
    assert all((ROOT / p).exists() for p in paths), paths
    gpu_files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                       if _marks_gpu(ast.parse(f.read_text())))
    assert len(gpu_files) >= 10, gpu_files
    left_out = [f for f in gpu_files if not any(f == p or f.startswith(p.rstrip("/") + "/") for p in paths)]
    assert left_out == [], f"GPU tests outside the Makefile's GPU_TESTS: {left_out}"


def test_make_and_the_device_script_run_that_list():
    make = subprocess.run(["make", "-n", "test-gpu"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert " ".join(_gpu_test_paths()) in make and "-m gpu" in make
    # the device script's default is the same line, read from the Makefile where it runs
    script = (ROOT / "tools" / "device" / "h200_p3.sh").read_text()
    default = re.search(r"^tests\)(.*?)^  ;;", script, re.S | re.M).group(1)
    sed = re.search(r"\$\((sed [^)]*) Makefile\)", default).group(1)
    out = subprocess.run(["bash", "-c", f"{sed} Makefile"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == _gpu_test_paths()
