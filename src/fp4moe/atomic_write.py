"""Atomic file writes: a reader sees the old file or the new one, never a half-written one, and a failed write
leaves nothing behind. Used by the report (fp4moe.report.render) and the runs archives (fp4moe.runs.archive).
Also where a folder can be created (``writable_ancestor``: the MLflow store's and the checkpoints' preflight;
``unwritable``: the same, said for a message)."""
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


def writable_ancestor(path: str | os.PathLike) -> tuple[Path, bool]:
    """(``path`` or its nearest existing ancestor, whether that is a folder this process can create files in):
    what decides, before anything is written, whether ``path`` can be created. Leaves nothing behind: where the
    permission bits allow, an empty folder is made there and removed (:func:`can_create_in`)."""
    path = Path(path)
    existing = next(p for p in (path, *path.parents) if p.exists())
    return existing, existing.is_dir() and os.access(existing, os.W_OK | os.X_OK) and can_create_in(existing)


def can_create_in(folder: Path) -> bool:
    """Whether an entry can be created in ``folder``, by making an empty folder there and removing it: the
    permission bits do not say it for root (root may write anywhere the bits forbid, but not in /proc, a read-only
    bind mount or an NFS export that squashes root)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fp4moe-probe-", dir=folder))
    except OSError:
        return False
    return True


def unwritable(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be created or written, as the end of a message: ``"<ancestor> is not a folder"`` (a file
    on the way) or ``"<ancestor> is not writable"``; None when it can be (:func:`writable_ancestor`)."""
    existing, writable = writable_ancestor(path)
    if writable:
        return None
    return f"{existing} {'is not writable' if existing.is_dir() else 'is not a folder'}"


__all__ = ["can_create_in", "unwritable", "writable_ancestor", "write_bytes_atomic"]
