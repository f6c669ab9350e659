"""fp4moe.atomic_write: the new content replaces the old whole; a failed write leaves the old file and no stray."""
import os

import pytest

from fp4moe.atomic_write import write_bytes_atomic


def test_replaces_whole_and_creates_the_folder(tmp_path):
    out = tmp_path / "a" / "b.json"
    write_bytes_atomic(out, b"old")
    write_bytes_atomic(out, b"new content")
    assert out.read_bytes() == b"new content" and oct(out.stat().st_mode & 0o777) == oct(0o644)
    assert os.listdir(out.parent) == ["b.json"]


def test_failed_write_keeps_the_old_file_and_no_temporary(tmp_path):
    out = tmp_path / "r.md"
    write_bytes_atomic(out, b"kept")
    with pytest.raises(TypeError):
        write_bytes_atomic(out, "not bytes")  # fails inside the write
    assert out.read_bytes() == b"kept" and os.listdir(tmp_path) == ["r.md"]
