"""Atomic file writes: a reader sees the old file or the new one, never a half-written one, and a failed write
leaves nothing behind. Used by the report (fp4moe.report.render) and the runs archives (fp4moe.runs_archive)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_bytes_atomic(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder (created if missing), then
    ``os.replace``; the temporary file is removed if anything fails. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


__all__ = ["write_bytes_atomic"]
