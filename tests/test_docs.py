"""The documentation holds together: README.md short and leading to docs/, every relative link in README.md and
docs/*.md resolves inside the repository, and no tracked file points to files outside it (the research notes and
specification the project started from are not in the repository; docs/ says what they said)."""
from __future__ import annotations

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
# The development machine's paths and tool library: nowhere in the code, configs, docs or tools. (Measured files in
# results/ still record the absolute paths of the machine that wrote them: an open item of issue 29.)
MACHINE_PATHS = ("/work" + "/", "." + "library/")
# Folders that are never part of the repository's own text when there is no git index to ask (.gitignore's).
UNTRACKED_DIRS = {".git", ".venv", "mlruns", "__pycache__", ".pytest_cache", ".hypothesis", ".import_linter_cache",
                  "outputs", "multirun", ".whl", ".corpus", "build", "data", "checkpoints", "logs"}
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


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte) or one that is not there (a deleted, unstaged file)."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    return None if b"\0" in data[:8192] else data.decode("utf-8", errors="replace")


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
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("results/") and rel.endswith(".json"):
            continue
        text = text_of(path)
        if text is None:
            continue
        needles = OUTSIDE_REFERENCES + (() if rel.startswith("results/") else MACHINE_PATHS)
        if not any(needle in text for needle in needles):
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            offenders += [f"{rel}:{lineno}: {needle}" for needle in needles if needle in line]
    assert not offenders, "files outside the repository are referenced (say it in docs/ instead):\n" + "\n".join(
        offenders)
