"""Where a study writes its Markdown: the manifest's ``outputs`` (results/scale/<study>.md), or ``--out``."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Sequence

from ..atomic_write import unwritable
from ..paths import source_root
from . import manifest


def target(out: str | Path | None, analysis: str) -> Path:
    """The file a study writes: ``out``, relative to the repository root unless absolute; None: the manifest's
    output of ``analysis``."""
    return manifest.load().output(analysis) if out is None else source_root() / out  # absolute stays as it is


def out_problem(out: str | Path | None, analysis: str) -> str | None:
    """Why the study's file (:func:`target`) cannot be written (a folder there, or above it a file or a folder this
    process cannot write), else None; asked before the study computes anything. Leaves nothing behind."""
    path = target(out, analysis)
    if path.is_dir():
        return f"--out {out}: {path} is a folder; give the Markdown file to write"
    why = unwritable(path.parent)
    return why and f"--out {out}: {why}; give a file in a folder this process can create or write"


def write_markdown(out: str | Path | None, analysis: str, text: str) -> Path:
    """``text`` written atomically (a .tmp beside the target, then renamed) to :func:`target` (``out``, or the
    manifest's output of ``analysis``). Returns the path written."""
    path = target(out, analysis)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    print(f"wrote {path}")
    return path


def markdown_cli(argv: Sequence[str] | None, doc: str, analysis: str, text: Callable[[], str]) -> int:
    """The ``--out`` command line of a study that writes one Markdown file (``text()``)."""
    ap = argparse.ArgumentParser(prog=f"python -m fp4moe.analysis.{analysis}", description=doc.splitlines()[0])
    ap.add_argument("--out", default=None, help="Markdown file to write, relative to the repository root (default: "
                                                f"the manifest's output for {analysis})")
    args = ap.parse_args(argv)
    why = out_problem(args.out, analysis)
    if why:  # before the study's work
        ap.error(why)
    write_markdown(args.out, analysis, text())
    return 0


__all__ = ["markdown_cli", "out_problem", "target", "write_markdown"]
