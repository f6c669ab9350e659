"""Every notebook in notebooks/ runs headless (nbclient, the venv's python3 kernel) against the fixture store and
against an empty one, without an error; the committed notebooks carry no outputs.

All eight runs share one kernel (a third of the time of eight kernels): each run starts with ``%reset -f``, so a
notebook that leaned on a name left by another one would fail here, and its parameters cell gets
``tracking_uri = <store>`` appended, as papermill would inject it."""
import socket
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_the_four_notebooks_without_outputs():
    assert [p.stem for p in NOTEBOOKS] == ["f3_kernels", "f5_loss", "scale_what_if", "t1_throughput_memory"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(params) == 1 and "tracking_uri = None" in params[0].source, path.name
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name} has outputs"


@pytest.fixture(scope="module")
def executed(report_store, tmp_path_factory):
    """{(notebook stem, 'fixture' | 'empty'): the executed cells of that run}."""
    tmp = tmp_path_factory.mktemp("notebooks")
    empty = f"sqlite:///{tmp / 'empty' / 'mlflow.db'}"
    combined = new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                     "language": "python"}})
    spans = {}
    for path in NOTEBOOKS:
        for which, uri in (("fixture", report_store), ("empty", empty)):
            start = len(combined.cells)
            combined.cells.append(new_code_cell("%reset -f"))
            for cell in nbformat.read(path, as_version=4).cells:
                if "parameters" in cell.metadata.get("tags", []):
                    cell.source += f"\ntracking_uri = {uri!r}"
                combined.cells.append(cell)
            spans[path.stem, which] = (start, len(combined.cells))
    # a server that does not answer: the notebook's store cell ends with one line (no traceback) within seconds
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    params, load = [c for c in nbformat.read(NOTEBOOKS[0], as_version=4).cells if c.cell_type == "code"][:2]
    params.source += f"\ntracking_uri = 'http://127.0.0.1:{closed}'"
    load.metadata.setdefault("tags", []).append("raises-exception")  # nbclient goes on after it
    start = len(combined.cells)
    combined.cells += [new_code_cell("%reset -f"), params, new_code_cell("import time\nt0 = time.monotonic()"), load,
                       new_code_cell("print(f'took {time.monotonic() - t0:.1f} s')")]
    spans["unreachable", str(closed)] = (start, len(combined.cells))
    NotebookClient(combined, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp)}}).execute()
    return {key: combined.cells[a:b] for key, (a, b) in spans.items()}


def test_an_unreachable_store_is_one_line_in_seconds(executed):
    (key,) = [k for k in executed if k[0] == "unreachable"]
    cells = executed[key]
    (error,) = [o for c in cells for o in c.get("outputs", []) if o.output_type == "error"]
    (line,) = error.traceback
    assert line.startswith(f"TrackingUnavailable: MLflow tracking server http://127.0.0.1:{key[1]} is not reachable")
    assert "tracking_uri in the parameters cell" in line
    assert float(_text(cells[-1:]).split()[1]) < 10


def _text(cells) -> str:
    return "\n".join(o.get("text", "") for c in cells for o in c.get("outputs", []))


def _has_png(cells) -> bool:
    return any("image/png" in o.get("data", {}) for c in cells for o in c.get("outputs", []))


@pytest.mark.parametrize("name", [p.stem for p in NOTEBOOKS])
def test_notebook_on_the_fixture_store(executed, name):
    cells = executed[name, "fixture"]
    assert _has_png(cells), f"{name} drew no plot"
    assert "no runs yet" not in _text(cells)


@pytest.mark.parametrize("name", [p.stem for p in NOTEBOOKS])
def test_notebook_on_an_empty_store(executed, name):
    text = _text(executed[name, "empty"])
    if name == "scale_what_if":  # needs no runs; it says the model is not calibrated
        assert "its paper-scale numbers are predictions (0 trainer runs in this store)" in text
    else:
        assert "no runs yet" in text


def test_notebook_content(executed):
    t1 = _text(executed["t1_throughput_memory", "fixture"])
    assert "M1: proxy_h200 on 1 x NVIDIA H200 (140 GiB)" in t1 and "M2: tiny_cpu" in t1
    what_if = _text(executed["scale_what_if", "fixture"])
    assert "layout asked: EP8 PP32 micro-batch 1 -> TP1 PP32 EP8 DP8" in what_if
