"""Where a study writes its Markdown: the manifest's ``outputs`` (results/scale/<study>.md), or ``--out``."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Sequence

from ..paths import source_root
from . import manifest


def write_markdown(out: str | Path | None, analysis: str, text: str) -> Path:
    """``text`` written atomically (a .tmp beside the target, then renamed) to ``out``, relative to the repository
    root unless absolute; None: the manifest's output of ``analysis``. Returns the path written."""
    path = manifest.load().output(analysis) if out is None else source_root() / out  # absolute stays as it is
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    print(f"wrote {path}")
    return path


def markdown_cli(argv: Sequence[str] | None, doc: str, analysis: str, text: Callable[[], str]) -> int:
    """The ``--out`` command line of a study that writes one Markdown file (``text()``)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=None, help="Markdown file to write, relative to the repository root (default: "
                                                f"the manifest's output for {analysis})")
    args = ap.parse_args(argv)
    write_markdown(args.out, analysis, text())
    return 0


__all__ = ["markdown_cli", "write_markdown"]
