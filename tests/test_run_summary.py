"""What a run and a multirun say at the end (fp4moe.runs.outcome): the trainer's ``done:`` line with rounded figures and
the paths of its log, checkpoints and store; a multirun's table of cells, written by the Hydra callback from each
job's result; and the known-harmless warnings filtered in one place (fp4moe.known_warnings)."""
from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fp4moe import known_warnings
from fp4moe.runs.outcome import JOB_RETURN, MultirunSummary, cells_table, done_line

# what `python -m fp4moe.train` returns (fp4moe/train/__main__.py), from a CPU run and from a GPU run
CPU_DONE = {"outcome": "done", "run_id": "4e370f51fc47", "start_step": 0, "step": 3, "total_steps": 3,
            "recipe": "mxfp4", "checkpoint": "/x/logs/train/runs/A/checkpoints/train/step_0000003",
            "slurm_job_id": None, "final_loss": 6.16156005859375, "final_eval_loss": 6.204330801963806,
            "tokens_per_gpu_s": 1799.5212414061132, "peak_mem_gib": None, "output_dir": "/x/logs/train/runs/A",
            "tracking_uri": "sqlite:////x/mlruns/mlflow.db"}
GPU_DONE = {**CPU_DONE, "recipe": "bf16", "final_loss": 10.5, "final_eval_loss": None,
            "tokens_per_gpu_s": 123456.7, "peak_mem_gib": 71.2345, "checkpoint": None}


def test_done_line_is_rounded_and_names_the_log_checkpoints_and_store():
    assert done_line(CPU_DONE) == (
        "done: step 3/3, loss 6.1616, eval loss 6.2043, 1,800 tokens/GPU/s (median), peak memory n/a; "
        "log /x/logs/train/runs/A; checkpoints /x/logs/train/runs/A/checkpoints/train; "
        "MLflow sqlite:////x/mlruns/mlflow.db run 4e370f51fc47")
    line = done_line({**GPU_DONE, "tracking_uri": "https://user:secret@mlflow.example:5000"})
    assert line.startswith("done: step 3/3, loss 10.5000, eval loss n/a, 123,457 tokens/GPU/s (median), "
                           "peak memory 71.23 GiB; log /x/logs/train/runs/A; checkpoints none written; ")
    assert line.endswith("MLflow https://mlflow.example:5000 run 4e370f51fc47")  # no credentials printed


def _job(sweep, num, overrides):
    """A job folder as Hydra makes it, and the job's config as the callback gets it."""
    out = sweep / f"{num}_{'_'.join(o.split('=')[1] for o in overrides)}"
    (out / ".hydra").mkdir(parents=True)
    (out / ".hydra" / "overrides.yaml").write_text("\n".join(f"- {o}" for o in overrides))
    return OmegaConf.create({"hydra": {"mode": "MULTIRUN", "runtime": {"output_dir": str(out)},
                                       "sweep": {"dir": str(sweep)}}})


def test_a_multirun_ends_with_the_table_of_its_cells(tmp_path, capsys):
    from hydra.core.utils import JobReturn, JobStatus

    sweep = tmp_path / "multiruns" / "2026-12-03_11-00-00"
    common = ["experiment=proxy_t1_1gpu", "train.steps=20"]
    cells = [(common + ["precision=bf16", "recompute=full"], JobStatus.COMPLETED, GPU_DONE),
             (common + ["precision=fp8", "recompute=none"], JobStatus.COMPLETED, {"outcome": "OOM"}),
             (common + ["precision=mxfp4", "recompute=none"], JobStatus.FAILED, RuntimeError("NCCL timeout\nmore")),
             (common + ["precision=mxfp4", "recompute=full"], None, None)]  # killed: wrote nothing
    cb = MultirunSummary()
    for i, (overrides, status, value) in enumerate(cells):
        cfg = _job(sweep, i, overrides)
        if status is not None:
            cb.on_job_end(cfg, JobReturn(overrides=overrides, status=status, _return_value=value))
    assert (sweep / "0_proxy_t1_1gpu_20_bf16_full" / JOB_RETURN).is_file()
    cb.on_multirun_end(OmegaConf.create({"hydra": {"mode": "MULTIRUN", "sweep": {"dir": str(sweep)}}}))
    out = capsys.readouterr().out
    table = (sweep / "cells.md").read_text()
    assert out == f"multirun: 4 cells in {sweep}\n{table}"
    lines = table.splitlines()
    assert lines[0] == "every cell: experiment=proxy_t1_1gpu train.steps=20"
    rows = [ln for ln in lines if ln.startswith("| ")]
    assert [c.strip() for c in rows[0].strip("|").split("|")] == ["cell", "outcome", "tokens/GPU/s", "peak GiB",
                                                                  "final loss"]
    assert [c.strip() for c in rows[1].strip("|").split("|")][1:] == ["done", "123,457", "71.23", "10.5000"]
    assert [c.strip() for c in rows[2].strip("|").split("|")][1:] == ["OOM", "n/a", "n/a", "n/a"]
    assert "failed (RuntimeError: NCCL timeout)" in rows[3]
    assert [c.strip() for c in rows[4].strip("|").split("|")][:2] == ["precision=mxfp4 recompute=full", "no result"]


def test_the_cell_column_shows_what_differs():
    table = cells_table([(["train.steps=2", "precision=bf16"], "done", CPU_DONE),
                         (["train.steps=2", "precision=mxfp4"], "done", GPU_DONE)])
    assert table.splitlines()[0] == "every cell: train.steps=2"
    assert "| precision=bf16  | done    |        1,800 |      n/a |     6.1616 |" in table


def test_known_warnings_are_silenced_only_from_their_library(monkeypatch):
    """Each entry says why it is harmless; a known message is hidden from megatron-core, not from anyone else."""
    assert all(k.why and k.kind in ("warning", "log") for k in known_warnings.KNOWN)
    msg = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    monkeypatch.setattr(known_warnings, "_installed", False)  # pytest restores the warnings filters after each test
    with warnings.catch_warnings(record=True) as seen:
        warnings.filterwarnings("always", append=True)  # after install()'s: what they do not hide shows every time
        known_warnings.install()
        warnings.warn_explicit(msg, UserWarning, "optimizer/__init__.py", 24, module="megatron.core.optimizer")
        warnings.warn_explicit(msg, UserWarning, "mine.py", 1, module="fp4moe.mine")
    assert [(str(w.message), w.filename) for w in seen] == [(msg, "mine.py")]
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.name, record.getMessage()))

    for name in ("megatron.core.transformer.transformer_layer", "megatron.core.transformer.other"):
        logger = logging.getLogger(name)
        logger.addHandler(handler := Keep())
        try:
            logger.warning("Unknown MLP type: <class 'ModuleSpec'>. Using default kwargs.")
            logger.warning("Unknown something else")
        finally:
            logger.removeHandler(handler)
    layer, other = "megatron.core.transformer.transformer_layer", "megatron.core.transformer.other"
    assert records == [(layer, "Unknown something else"),
                       (other, "Unknown MLP type: <class 'ModuleSpec'>. Using default kwargs."),
                       (other, "Unknown something else")]


def test_the_collectives_whose_deprecation_is_silenced_are_not_fp4moes():
    """known_warnings hides torch's deprecation of all_gather_into_tensor / reduce_scatter_tensor from every caller
    (torch's own wrapper emits it): megatron-core calls them; fp4moe and its kernels must not."""
    root = Path(__file__).resolve().parents[1]
    silenced = {m.group(1) for k in known_warnings.KNOWN if k.source.startswith(r"torch\.distributed\.c10d")
                for m in [re.search(r"torch\\\.distributed\\\.(\w+)", k.message)] if m}
    assert silenced == {"all_gather_into_tensor", "reduce_scatter_tensor"}
    sources = [path for folder in ("src", "kernels") for path in (root / folder).rglob("*.py")]
    calls = [f"{path.relative_to(root)}: {name}" for path in sources for name in silenced
             if re.search(rf"\b{name}\s*\(", path.read_text())]
    assert calls == []


@pytest.mark.parametrize("value, text", [(None, "n/a"), (0.5, "0.5000")])
def test_missing_figures_read_n_a(value, text):
    assert f"loss {text}," in done_line({**CPU_DONE, "final_loss": value})
