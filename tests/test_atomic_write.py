"""fp4moe.atomic_write: the new content replaces the old whole; a failed write leaves the old file and no stray;
``unwritable`` says where a folder cannot be created, for root too, and leaves nothing behind."""
import os
from pathlib import Path

import pytest

from fp4moe.atomic_write import unwritable, write_bytes_atomic


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


def test_unwritable_names_the_blocking_file_or_folder_and_leaves_nothing(tmp_path):
    assert unwritable(tmp_path / "a" / "b") is None and os.listdir(tmp_path) == []
    (tmp_path / "f").write_text("")
    assert unwritable(tmp_path / "f" / "g") == f"{tmp_path / 'f'} is not a folder"
    if os.geteuid() != 0:  # the permission bits (root passes them)
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        assert unwritable(ro / "x") == f"{ro} is not writable"
    assert sorted(os.listdir(tmp_path)) == sorted(["f"] + (["ro"] if os.geteuid() != 0 else []))


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_no_one_can_create_entries_in_is_unwritable_for_root_too():
    """/proc passes the permission check for root (os.access says writable) yet no folder can be made there: the
    probe (an empty folder made and removed) says so where the bits alone did not (a traceback from mkdir later)."""
    assert unwritable("/proc/fp4moe/data") == "/proc is not writable"
