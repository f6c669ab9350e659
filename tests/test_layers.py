"""The package layers (issue P9): the import-linter contracts of pyproject.toml ([tool.importlinter]) hold, so
``make test`` fails on an import that breaks them (imports inside functions count too).

    torch stack       fp4moe_kernels <- fp4moe.ops <- fp4moe.moe <- fp4moe.model <- fp4moe.train
    torch-free side   fp4moe.paths <- fp4moe.paper, fp4moe.atomic_write <- fp4moe.tracking (mlflow_store <- bench_log
                      <- layer_bench_log) <- fp4moe.runs <- fp4moe.scale <- fp4moe.analysis <- fp4moe.report; none of
                      them imports torch, megatron, triton or the torch stack
    no cycles         between the modules and sub-packages of any package

The graph is the static one import-linter builds, so this file also imports the torch-free side with torch made
unimportable: what the graph cannot see (a package's ``__init__`` that a submodule import runs) is checked too.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter", reason="import-linter is in the test extras: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[1]

# What must import without torch (the forbidden contract "torch-free" lists the same modules).
TORCH_FREE_PACKAGES = ("fp4moe.tracking", "fp4moe.runs", "fp4moe.scale", "fp4moe.analysis", "fp4moe.report")
TORCH_FREE_MODULES = ("fp4moe.paper", "fp4moe.recipe", "fp4moe.config", "fp4moe.atomic_write", "fp4moe.paths",
                      "fp4moe_kernels.sizes")


def lint_imports(src: Path, kernels: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on ROOT's pyproject.toml, with the packages imported from ``src`` and ``kernels``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(kernels), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()",
         str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold():
    """Every contract of [tool.importlinter] is kept; a broken one fails with import-linter's report (which import,
    from where, at which line)."""
    r = lint_imports(ROOT / "src", ROOT / "kernels")
    assert r.returncode == 0, f"import-linter contracts broken (pyproject.toml [tool.importlinter]):\n{r.stdout}{r.stderr}"
    assert "0 broken" in r.stdout, r.stdout


def test_a_forbidden_import_breaks_the_contracts(tmp_path):
    """The check can fail: a copy of the sources where fp4moe.scale imports the trainer (inside a function, as the
    earlier breaks did) and fp4moe.ops imports fp4moe.model breaks the torch-free and torch-stack contracts."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.cu", "*.so")
    shutil.copytree(ROOT / "src" / "fp4moe", tmp_path / "src" / "fp4moe", ignore=ignore)
    shutil.copytree(ROOT / "kernels" / "fp4moe_kernels", tmp_path / "kernels" / "fp4moe_kernels", ignore=ignore)
    with open(tmp_path / "src/fp4moe/scale/comm.py", "a") as f:
        f.write("\n\ndef _layer_break():\n    from fp4moe.train import loop  # noqa: F401\n")
    with open(tmp_path / "src/fp4moe/ops/swiglu.py", "a") as f:
        f.write("\n\ndef _layer_break():\n    import fp4moe.model.gpt_model  # noqa: F401\n")
    r = lint_imports(tmp_path / "src", tmp_path / "kernels")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "fp4moe.scale.comm -> fp4moe.train.loop" in r.stdout, r.stdout
    assert "fp4moe.ops.swiglu -> fp4moe.model.gpt_model" in r.stdout, r.stdout


def test_torch_free_side_imports_without_torch():
    """Every module of the torch-free side imports in a process where torch, megatron and triton cannot be imported
    (``fp4moe_kernels.sizes`` included: the package's ``__init__`` loads its torch modules only on first use)."""
    code = f"""
import importlib, pkgutil, sys
for name in ("torch", "megatron", "triton"):
    sys.modules[name] = None  # import raises ImportError
names = list({TORCH_FREE_MODULES!r})
for pkg in {TORCH_FREE_PACKAGES!r}:
    mod = importlib.import_module(pkg)
    names += [m.name for m in pkgutil.walk_packages(mod.__path__, pkg + ".") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print(len(names), "modules")
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "kernels"),
                                                         os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
