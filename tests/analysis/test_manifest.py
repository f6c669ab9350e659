"""results/manifest.yaml and its reader (fp4moe.analysis.manifest): every file it names exists and says what made
it, and says it as the file itself records it; every role a study reads has its files; superseded files are read
only where the manifest names them; the model (fp4moe.scale) and the analysis name no commit in their code, and the
model reads no result file. Fast: YAML and JSON headers (the archives decompressed once)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fp4moe.analysis import manifest
from fp4moe.paths import source_root
from fp4moe.runs.archive import expand, load

ROOT = source_root()
COMMIT = re.compile(r"^[0-9a-f]{7}$")
HASH_LIKE = re.compile(r"(?<![0-9a-zA-Z])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9a-zA-Z])")


@pytest.fixture(scope="module")
def m():
    return manifest.load()


def test_every_entry_is_a_result_file_with_its_provenance(m):
    assert m.results == ROOT / "results" and m.entries
    for e in m.entries:
        assert e.file.exists() and (e.file.is_dir() == e.path.endswith("/")), e.path
        assert e.what and e.uses
        if e.kind not in manifest.HAND_WRITTEN:
            assert COMMIT.match(e.commit) and re.match(r"^\d{4}-\d{2}-\d{2}$", e.date) and "H200" in e.gpu, e.path
    assert {m.output(a).name for a in m.outputs} == {"calibration.md", "throughput.md", "paper_t1.md", "paper_t2.md"}
    assert all(m.output(a).is_file() for a in m.outputs)


def test_the_provenance_is_what_the_files_record(m):
    """A runs archive's runs logged the manifest's commit, or ran on a tree with uncommitted changes on top of an
    earlier commit (git_dirty), the code the manifest's commit then committed; a benchmark or measurement file
    records the manifest's commit and date itself."""
    for e in m.entries:
        if e.kind == "runs_archive":
            for r in load(e.file)["runs"]:
                logged = r["tags"].get("mlflow.source.git.commit", "")[:7]
                assert logged == e.commit or r["tags"].get("git_dirty") == "true", (e.path, logged)
        elif e.kind in ("layer_bench", "kernel_bench", "outside_torch") and e.path.endswith(".json"):
            doc = json.loads(e.file.read_text())
            env = doc.get("env", doc)
            assert (env["commit"], str(env["date"])[:10]) == (e.commit, e.date), e.path


def test_every_role_has_its_files(m):
    """Each role a study reads names at least one file; the roles of one file are one each."""
    for analysis, roles in manifest.ROLES.items():
        for role in roles:
            assert m.inputs(analysis, role), (analysis, role)
    for role in ("probe", "profile_cells", "bf16_cells", "attn_block_cells", "core_attention_cells", "proxy_t1_row",
                 "constants"):
        m.one("throughput", role)
    assert m.one("memory", "outside_torch")[0].kind == "outside_torch"


def test_the_reader_refuses_what_is_not_a_manifest(tmp_path):
    path = tmp_path / manifest.NAME
    (tmp_path / "a.json").write_text("{}")
    entry = {"path": "a.json", "kind": "runs_archive", "what": "x", "gpu": "1 x H200", "date": "2026-12-01",
             "commit": "abc1234", "uses": [{"analysis": "calibration", "role": "one_gpu"}]}
    path.write_text(json.dumps({"format": manifest.FORMAT, "files": [entry]}))
    m = manifest.read(path)
    assert m.one("calibration", "one_gpu")[0].file == tmp_path / "a.json"
    with pytest.raises(ValueError, match="0 files for calibration / nccl"):
        m.one("calibration", "nccl")
    for bad, match in ((dict(entry, commit=""), "has no commit"),
                       (dict(entry, uses=[{"analysis": "calibration", "role": "typo"}]), "has no role 'typo'"),
                       (dict(entry, kind="csv"), "kind 'csv'")):
        path.write_text(json.dumps({"format": manifest.FORMAT, "files": [bad]}))
        with pytest.raises(ValueError, match=match):
            manifest.read(path)
    path.write_text(json.dumps({"format": manifest.FORMAT, "files": [entry, entry]}))
    with pytest.raises(ValueError, match="listed twice"):
        manifest.read(path)
    path.write_text(json.dumps({"format": "other", "files": []}))
    with pytest.raises(ValueError, match="format 'other'"):
        manifest.read(path)


def test_superseded_files_are_read_only_where_named(m):
    """Superseded archives sit in their folder's superseded/ (its README says why), which make reproduce-table's
    loader does not read; the manifest names one only with what is still valid in it."""
    for e in m.entries:
        assert e.superseded == ("/superseded/" in f"/{e.path}"), e.path
    loaded = expand([ROOT / "results" / "train_proxy"])
    assert loaded and not any("superseded" in p.parts for p in loaded)
    for folder in (ROOT / "results").rglob("superseded"):
        assert (folder / "README.md").is_file()


def _code_lines(path: Path) -> list[tuple[int, str]]:
    return list(enumerate(path.read_text().splitlines(), 1))


def test_no_commit_in_the_model_or_the_analysis_code():
    """Commits are the manifest's data: no commit hash in fp4moe.scale or fp4moe.analysis (comments and docstrings
    included)."""
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for pkg in ("scale", "analysis") for p in sorted((ROOT / "src/fp4moe" / pkg).glob("*.py"))
             for n, line in _code_lines(p) if HASH_LIKE.search(line)]
    assert not found, "\n".join(found)
    assert HASH_LIKE.search("archive of 38f25cd,") and not HASH_LIKE.search("0x1234abc e431 2026-12-01 a2a_e4m3")


def test_the_model_reads_no_result_file():
    """fp4moe.scale computes from a config and the inputs it is given: it finds no results/ folder and opens no
    file but conf/'s (memory.py's compose_cfg)."""
    for p in sorted((ROOT / "src/fp4moe/scale").glob("*.py")):
        text = p.read_text()
        for name in ("source_root", "results_dir", "repo_root", "read_text(", "open(", "json.load(", "yaml.", "Path("):
            assert name not in text, f"{p.name} uses {name}"
