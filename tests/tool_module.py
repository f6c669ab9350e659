"""Scripts under tools/ are not a package: their tests load them by path with :func:`load_tool`."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_tool(relpath: str):
    """The module at ``ROOT / relpath`` (e.g. ``tools/step_times.py``), executed once per call."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
