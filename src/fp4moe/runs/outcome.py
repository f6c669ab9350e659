"""What a run and a multirun say at the end: the trainer's final ``done:`` line and the table of a multirun's cells.

- :func:`done_line`: one line from the dict ``python -m fp4moe.train`` returns (rounded figures, then where its log,
  checkpoints and MLflow store are). Tools grep ``done:`` at its start.
- :func:`cells_table`: a multirun's cells (overrides, outcome, tokens/GPU/s, peak memory, final loss) as text.
- :class:`MultirunSummary`: the Hydra callback (``hydra.callbacks.summary`` in conf/train.yaml) that writes each job's
  result next to its log (``<job folder>/job_return.json``, so that it works for jobs run in other processes:
  submitit, Slurm) and prints the table at the end of the multirun (also written to ``<sweep folder>/cells.md``).

No torch; Hydra and OmegaConf only inside the callback.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fp4moe.tracking.mlflow_store import without_credentials

JOB_RETURN = "job_return.json"
CELLS_FILE = "cells.md"


def _loss(v: Any) -> str:
    return "n/a" if v is None else f"{float(v):.4f}"


def _tgs(v: Any) -> str:
    return "n/a" if v is None else f"{round(float(v)):,}"


def _gib(v: Any) -> str:
    return "n/a" if v is None else f"{float(v):.2f} GiB"


def done_line(r: Mapping[str, Any]) -> str:
    """``done: step S/T, loss L, eval loss E, N tokens/GPU/s (median), peak memory M GiB; log DIR; checkpoints DIR;
    MLflow URI run ID`` from the trainer's return dict: loss to 4 decimals, tokens/GPU/s a whole number with thousands
    separators, peak memory (allocated, the fullest GPU's) in GiB to 2 decimals, ``n/a`` where not measured (peak
    memory on CPU; no eval pass)."""
    ckpt = r.get("checkpoint")
    ckpt_dir = str(Path(ckpt).parent) if ckpt else "none written"
    return (f"done: step {r.get('step')}/{r.get('total_steps')}, loss {_loss(r.get('final_loss'))}, "
            f"eval loss {_loss(r.get('final_eval_loss'))}, {_tgs(r.get('tokens_per_gpu_s'))} tokens/GPU/s (median), "
            f"peak memory {_gib(r.get('peak_mem_gib'))}; log {r.get('output_dir') or 'n/a'}; checkpoints {ckpt_dir}; "
            f"MLflow {without_credentials(str(r.get('tracking_uri')))} run {r.get('run_id')}")


def cells_table(cells: Sequence[tuple[Sequence[str], str, Mapping[str, Any] | None]]) -> str:
    """A plain-text (Markdown) table of ``(cell overrides, outcome, return dict or None)``: one row per cell with its
    tokens/GPU/s, peak memory (GiB) and final loss, formatted as in :func:`done_line`. The cell column shows the
    overrides that differ between cells (those every cell shares are said once, above the table)."""
    shared = set.intersection(*(set(o) for o, _, _ in cells)) if len(cells) > 1 else set()
    head = ("cell", "outcome", "tokens/GPU/s", "peak GiB", "final loss")
    rows = [head]
    for overrides, outcome, r in cells:
        r = r or {}
        peak = r.get("peak_mem_gib")
        rows.append((" ".join(o for o in overrides if o not in shared) or "(no overrides)", outcome,
                     _tgs(r.get("tokens_per_gpu_s")), "n/a" if peak is None else f"{float(peak):.2f}",
                     _loss(r.get("final_loss"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    right = (False, False, True, True, True)

    def fmt(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if rt else c.ljust(w) for c, w, rt in zip(row, widths, right)) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if rt else ("-" * (w + 2)) for w, rt in zip(widths, right)) + "|"
    common = [o for o in cells[0][0] if o in shared] if cells else []
    return "\n".join([*([f"every cell: {' '.join(common)}", ""] if common else []), fmt(rows[0]), sep,
                      *(fmt(r) for r in rows[1:])])


def _outcome(status: str, value: Any) -> str:
    if status != "COMPLETED":
        text = f"{type(value).__name__}: {value}".splitlines()[0] if value is not None else "no result"
        return f"failed ({text[:100]})"
    if isinstance(value, Mapping):
        return str(value.get("outcome", "done"))
    return "done"


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str)) if isinstance(value, Mapping) else None


def read_cells(sweep_dir: str | Path) -> list[tuple[list[str], str, Mapping[str, Any] | None]]:
    """The cells of the multirun in ``sweep_dir``: every job folder Hydra made (``<num>_<name>/.hydra/``), in job
    order, with the result its job wrote (``job_return.json``) or outcome ``no result`` (a job that was killed or is
    still running)."""
    sweep = Path(sweep_dir)
    jobs = sorted((p.parent.parent for p in sweep.glob("*/.hydra/overrides.yaml")),
                  key=lambda p: (int(p.name.split("_", 1)[0]) if p.name.split("_", 1)[0].isdigit() else 1 << 30,
                                 p.name))
    cells = []
    for job in jobs:
        f = job / JOB_RETURN
        if f.is_file():
            d = json.loads(f.read_text())
            cells.append((list(d.get("overrides") or []), d["outcome"], d.get("return")))
        else:  # the overrides as Hydra wrote them when it started the job
            from omegaconf import OmegaConf

            cells.append(([str(o) for o in OmegaConf.load(job / ".hydra" / "overrides.yaml")], "no result", None))
    return cells


try:
    from hydra.experimental.callback import Callback as _Callback
except ImportError:  # hydra absent: the callback is never used
    _Callback = object  # type: ignore[assignment,misc]


class MultirunSummary(_Callback):
    """Hydra callback: ``on_job_end`` (in the job's process) writes ``job_return.json`` (overrides, outcome, return
    value) into the job's output folder; ``on_multirun_end`` (the launching process) prints the table of every cell of
    the sweep folder and writes it to ``<sweep folder>/cells.md``."""

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        out = OmegaConf.select(config, "hydra.runtime.output_dir", default=None)
        mode = str(OmegaConf.select(config, "hydra.mode", default=""))
        if not out or not mode.endswith("MULTIRUN"):
            return
        status = getattr(job_return.status, "name", str(job_return.status))
        value = job_return._return_value  # the return value, or the exception of a failed job (no re-raise)
        record = {"overrides": list(job_return.overrides or []), "outcome": _outcome(status, value),
                  "return": _jsonable(value)}
        try:
            Path(out, JOB_RETURN).write_text(json.dumps(record, indent=1))
        except OSError as e:  # the table then says "no result" for this cell; the job itself is not failed for it
            print(f"fp4moe.runs.outcome: could not write {Path(out, JOB_RETURN)}: {e}")

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import OmegaConf

        sweep = OmegaConf.select(config, "hydra.sweep.dir", default=None)
        if not sweep or not Path(sweep).is_dir():
            return
        cells = read_cells(sweep)
        if not cells:
            return
        table = cells_table(cells)
        try:
            Path(sweep, CELLS_FILE).write_text(table + "\n")
        except OSError:
            pass
        print(f"multirun: {len(cells)} cells in {sweep}\n{table}", flush=True)


__all__ = ["CELLS_FILE", "JOB_RETURN", "MultirunSummary", "cells_table", "done_line", "read_cells"]
