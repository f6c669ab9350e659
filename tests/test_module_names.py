"""No two modules share a file name (issue P9: packages that say what they hold).

Across src/fp4moe and kernels/fp4moe_kernels every module's file name (``__init__.py`` and ``__main__.py`` aside) is
its own, so a name such as ``bench`` or ``throughput`` says which module is meant without its package: the model in
fp4moe.scale and its studies in fp4moe.analysis, the kernels' API (fp4moe_kernels.convert) and fp4moe.ops, the layer
and kernel benchmarks, the autograd SwiGLU and its fused kernels. docs/layout.md lists the pairs that once repeated.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (ROOT / "src" / "fp4moe", ROOT / "kernels" / "fp4moe_kernels")
EXEMPT = {"__init__.py", "__main__.py"}


def repeated_module_names(*packages: Path) -> dict[str, list[str]]:
    """File name -> the modules (paths relative to the package folders' parent) that share it, for each name that
    more than one ``.py`` file under ``packages`` has (``__init__.py`` / ``__main__.py`` and ``__pycache__`` aside)."""
    found: dict[str, list[str]] = defaultdict(list)
    for package in packages:
        for path in sorted(package.rglob("*.py")):
            if path.name in EXEMPT or "__pycache__" in path.parts:
                continue
            found[path.name].append(path.relative_to(package.parent).as_posix())
    return {name: paths for name, paths in sorted(found.items()) if len(paths) > 1}


def test_no_two_modules_share_a_file_name():
    for package in PACKAGES:
        assert package.is_dir(), package
    repeated = repeated_module_names(*PACKAGES)
    assert not repeated, "modules sharing a file name (give each a name that says what it holds): " + "; ".join(
        f"{name}: {', '.join(paths)}" for name, paths in repeated.items())


def test_a_repeated_name_is_reported_with_both_modules(tmp_path):
    """The check itself: a name in two packages (also one level down) is found, __init__ / __main__ are not."""
    for rel in ("a/__init__.py", "a/__main__.py", "a/bench.py", "a/x/__init__.py", "a/x/only.py",
                "b/__init__.py", "b/__main__.py", "b/y/__init__.py", "b/y/bench.py", "b/__pycache__/only.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    assert repeated_module_names(tmp_path / "a", tmp_path / "b") == {"bench.py": ["a/bench.py", "b/y/bench.py"]}
