"""The documentation holds together: README.md short and leading to docs/, every relative link in README.md and
docs/*.md resolves inside the repository, and no tracked file points to files outside it (the research notes and
specification the project started from are not in the repository; docs/ says what they said), nor names the folders
of the machines that wrote it (results/ included: its writers name them ``<repo>``, ``$OUT``, ``~``)."""
from __future__ import annotations

import lzma
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 200
# Built from pieces so that this file does not match itself.
OUTSIDE_REFERENCES = ("../" + "shared", "SPEC" + ".md", "SPEC" + " §", "DESIGN" + ".md", "shared " + "notes/")
# The development machine's paths and tool library: nowhere in the repository, results/ included (what benchmarks,
# runs archives and the report write there names folders with fp4moe.tracking.mlflow_store.portable: <repo>/..., $OUT/..., ~/...).
MACHINE_PATHS = ("/work" + "/", "." + "library/")
# results/ also names no home folder (the device's $OUT is one). /tmp/ and /opt/ stay: scratch and installed software
# as tracebacks and logs show them (/tmp/site/megatron, a venv's site-packages, pytest's tmp_path), no checkout or
# user's files.
HOME_PATHS = ("/root" + "/", "/home" + "/")
XZ_MAGIC = b"\xfd7zXZ\x00"
# torch profiler traces (results/train_proxy/profile_*/*.trace.json.xz, ~200 MB decompressed) are kept byte for byte
# as the profiler wrote them: their only path is traceName, the folder the trace was written to; rewriting it would
# add ~9 MB of git objects to change one field.
RAW_TRACES = ".trace.json.xz"
# Folders that are never part of the repository's own text when there is no git index to ask (.gitignore's).
UNTRACKED_DIRS = {".git", ".venv", ".venv-mlflow-server", "mlruns", "__pycache__", ".pytest_cache", ".hypothesis",
                  ".import_linter_cache", "outputs", "multirun", ".whl", ".corpus", "build", "data", "checkpoints", "logs"}
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def doc_files() -> list[Path]:
    """README.md and every Markdown file in docs/."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(md: Path) -> list[str]:
    """The link targets of ``md`` that name a path (no URL scheme, not a bare #anchor), fragments removed."""
    targets = []
    for target in LINK.findall(md.read_text(encoding="utf-8")):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def tracked_files() -> list[Path]:
    """The repository's files: git's index where there is one, else the tree without .gitignore's folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30).stdout
        return [ROOT / p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        files = []
        for folder, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if d not in UNTRACKED_DIRS and not d.endswith(".egg-info")]
            files += [Path(folder) / n for n in names]
        return files


def text_of(path: Path) -> bytes | None:
    """The file's text as bytes (an xz file's decompressed), or None for a binary file (a NUL byte) or one that is
    not there (a deleted, unstaged file). Bytes: large compressed results are searched without decoding them."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if data[:6] == XZ_MAGIC:
        data = lzma.decompress(data)
    return None if b"\0" in data[:8192] else data


def outside_references(rel: str, data: bytes) -> list[str]:
    """``rel:line: needle`` for each reference outside the repository in ``data`` (the file ``rel``): the project's
    notes, the development machine's paths, and in results/ a home folder."""
    needles = OUTSIDE_REFERENCES + MACHINE_PATHS + (HOME_PATHS if rel.startswith("results/") else ())
    if not any(needle.encode() in data for needle in needles):
        return []
    return [f"{rel}:{lineno}: {needle}" for lineno, line in
            enumerate(data.decode("utf-8", errors="replace").splitlines(), 1) for needle in needles if needle in line]


def test_readme_is_short_and_names_the_two_commands():
    text = README.read_text(encoding="utf-8")
    lines = text.count("\n") + (not text.endswith("\n"))
    assert lines < README_MAX_LINES, f"README.md has {lines} lines: move detail into docs/ (limit {README_MAX_LINES})"
    for command in ("make reproduce-table", "make test"):
        assert f"`{command}" in text or f"\n{command}" in text, f"README.md does not name `{command}`"


def test_docs_exist_and_readme_links_every_one():
    readme_targets = {(ROOT / t).resolve() for t in relative_links(README)}
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert docs, "docs/ has no Markdown files"
    missing = [d.name for d in docs if d.resolve() not in readme_targets]
    assert not missing, f"README.md does not link docs/{missing}"


@pytest.mark.parametrize("md", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(md: Path):
    broken = []
    for target in relative_links(md):
        path = (md.parent / target).resolve()
        if not path.is_relative_to(ROOT) or not path.exists():
            broken.append(target)
    assert not broken, f"{md.relative_to(ROOT)}: links that resolve to nothing in the repository: {broken}"


def test_link_check_finds_a_broken_link(tmp_path: Path):
    """The checker itself: a link to a missing file and one outside the tree are found, a good one is not."""
    md = tmp_path / "x.md"
    md.write_text("[a](missing.md) [b](../../outside.md) [c](x.md#top) [d](https://example.org) [e](#anchor)\n")
    assert relative_links(md) == ["missing.md", "../../outside.md", "x.md"]


def test_no_tracked_file_points_outside_the_repository():
    offenders = []
    for path in tracked_files():
        if path.name.endswith(RAW_TRACES):
            continue
        text = text_of(path)
        if text is not None:
            offenders += outside_references(path.relative_to(ROOT).as_posix(), text)
    assert not offenders, ("files or machine folders outside the repository are named (say it in docs/; results/ "
                           "names them <repo>/..., $OUT/..., ~/...: fp4moe.tracking.mlflow_store.portable):\n" + "\n".join(offenders))


def test_the_reference_check_reads_compressed_results(tmp_path: Path):
    """The checker itself: a home folder in an xz-compressed result is found; there, not elsewhere; /tmp/ stays."""
    packed = tmp_path / "a.json.xz"
    packed.write_bytes(lzma.compress(b'{"env.FP4MOE_TILES": "/root/out/kernels/k.json",\n "cache": "/tmp/x"}'))
    text = text_of(packed)
    assert outside_references("results/a.json.xz", text) == ["results/a.json.xz:1: /root/"]
    assert outside_references("tests/a.json", text) == []
    assert outside_references("results/a.md", b"--out <repo>/results/kernels, $OUT/moe_layer") == []
