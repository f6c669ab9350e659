"""results/manifest.yaml: the result files the analysis reads, what each is and who made it, and the studies' outputs.

The analysis names no result file or commit in its code: a study asks for its inputs by role (``inputs("calibration",
"one_gpu")``) and gets each file's entry (path, GPU, date, commit) with that use's options, in the manifest's order.
The file's format is described at its top. No torch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..paths import committed_results_dir

FORMAT = "fp4moe-results-manifest/1"
CONSTANTS_FORMAT = "fp4moe-constants/1"
NAME = "manifest.yaml"   # in results/
# The roles each study reads (an entry's ``uses``): what the manifest may name, and what the studies ask for.
ROLES = {
    "calibration": ("one_gpu",      # runs archives of one H200: the main table, and what fits
                    "nccl",         # runs archives over NCCL (two H200s)
                    "moe_layer",    # P2's layer benchmark (``peak: true``: its peak is modelled)
                    "constants",    # the hand-read numbers (h200_memory)
                    "notes"),       # the document's hand-written text
    "throughput": ("constants",     # the rate sets and the profiles' kernel groups
                   "probe", "profile_cells", "bf16_cells", "attn_block_cells", "core_attention_cells",
                   "proxy_t1_row",  # runs archives of the checks
                   "profile", "profile_2026_11_30", "attn_block_profile", "kernels", "kernels_2026_11_30"),
    # ^ the files the constants were read off (the text names their commits)
    "paper_t1": (),
    "paper_t2": (),
    "memory": ("outside_torch",),   # the measured memory outside PyTorch (fp4moe.analysis.outside_torch_measured)
}
ANALYSES = tuple(ROLES)
KINDS = ("runs_archive", "layer_bench", "kernel_bench", "profile", "outside_torch", "constants", "notes")
HAND_WRITTEN = ("constants", "notes")   # kinds with no GPU, date or commit


@dataclass(frozen=True)
class Use:
    """One study's use of a file: the study (``analysis``), the file's ``role`` in it and that role's options."""

    analysis: str
    role: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.options.get(key, default)


@dataclass(frozen=True)
class Entry:
    """One result file (or folder) of the manifest; ``path`` is relative to results/."""

    path: str
    kind: str
    what: str
    uses: tuple[Use, ...]
    gpu: str = ""
    date: str = ""
    commit: str = ""
    superseded: bool = False
    results: Path = Path("results")   # the results/ folder the path is relative to

    @property
    def name(self) -> str:
        """The file's (or folder's) own name."""
        return Path(self.path).name

    @property
    def file(self) -> Path:
        """Where it is on this machine."""
        return self.results / self.path

    @property
    def repo_path(self) -> str:
        """Its path in the repository, e.g. ``results/scale/outside_torch_h200.json`` (a folder's ``/`` kept)."""
        return f"results/{self.path}"


@dataclass(frozen=True)
class Manifest:
    entries: tuple[Entry, ...]
    code_changes: Mapping[str, str]    # {name: commit}
    outputs: Mapping[str, str]         # {study: Markdown file, relative to results/}
    results: Path

    def inputs(self, analysis: str, role: str) -> list[tuple[Entry, Use]]:
        """Every (entry, use) with that study and role, in the manifest's order."""
        return [(e, u) for e in self.entries for u in e.uses if (u.analysis, u.role) == (analysis, role)]

    def one(self, analysis: str, role: str) -> tuple[Entry, Use]:
        """The one (entry, use) of a role that has exactly one file."""
        found = self.inputs(analysis, role)
        if len(found) != 1:
            raise ValueError(f"{self.results / NAME}: {len(found)} files for {analysis} / {role}, expected one")
        return found[0]

    def entry(self, path: str) -> Entry:
        """The entry of ``path`` (relative to results/)."""
        for e in self.entries:
            if e.path == path:
                return e
        raise KeyError(f"{path} is not in {self.results / NAME}")

    def output(self, analysis: str) -> Path:
        """The Markdown file ``analysis`` writes."""
        return self.results / self.outputs[analysis]

    def commit_of(self, change: str) -> str:
        """The commit of a named code change (``code_changes``)."""
        return self.code_changes[change]


def _entry(raw: dict, results: Path, where: str) -> Entry:
    missing = [k for k in ("path", "kind", "what", "uses") if k not in raw]
    if raw.get("kind") not in HAND_WRITTEN:
        missing += [k for k in ("gpu", "date", "commit") if not raw.get(k)]
    if missing:
        raise ValueError(f"{where}: {raw.get('path', '?')} has no {', '.join(missing)}")
    if raw["kind"] not in KINDS:
        raise ValueError(f"{where}: {raw['path']}: kind {raw['kind']!r}, one of {KINDS}")
    uses = []
    for u in raw["uses"]:
        u = dict(u)
        analysis, role = u.pop("analysis"), u.pop("role")
        if role not in ROLES.get(analysis, ()):
            raise ValueError(f"{where}: {raw['path']}: {analysis!r} has no role {role!r} (manifest.ROLES)")
        uses.append(Use(analysis, role, u))
    return Entry(str(raw["path"]), raw["kind"], str(raw["what"]), tuple(uses), str(raw.get("gpu", "")),
                 str(raw.get("date", "")), str(raw.get("commit", "")), bool(raw.get("superseded", False)), results)


def read(path: str | Path) -> Manifest:
    """The manifest at ``path``; its entries' paths are relative to the folder it is in."""
    path = Path(path)
    doc = yaml.safe_load(path.read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: format {doc.get('format')!r}, expected {FORMAT!r}")
    results = path.parent
    entries = tuple(_entry(raw, results, str(path)) for raw in doc["files"])
    seen = [e.path for e in entries]
    if len(set(seen)) != len(seen):
        raise ValueError(f"{path}: a file is listed twice: {sorted(p for p in seen if seen.count(p) > 1)}")
    changes = {k: str(v["commit"]) for k, v in (doc.get("code_changes") or {}).items()}
    return Manifest(entries, changes, dict(doc.get("outputs") or {}), results)


@functools.cache
def load() -> Manifest:
    """The checkout's results/manifest.yaml (``fp4moe.paths.committed_results_dir``)."""
    return read(committed_results_dir() / NAME)


def constants(analysis: str, manifest: Manifest | None = None) -> dict[str, Any]:
    """The hand-read numbers file of ``analysis`` (its ``constants`` role), as a dict."""
    entry, _ = (manifest or load()).one(analysis, "constants")
    doc = yaml.safe_load(entry.file.read_text())
    if doc.get("format") != CONSTANTS_FORMAT:
        raise ValueError(f"{entry.file}: format {doc.get('format')!r}, expected {CONSTANTS_FORMAT!r}")
    return doc


def notes(analysis: str, manifest: Manifest | None = None) -> dict[str, str]:
    """The hand-written parts of a study's document (its ``notes`` role): {part: text}, each part following a marker
    line ``<!-- part -->`` (a leading comment of the file is not a part)."""
    entry, _ = (manifest or load()).one(analysis, "notes")
    parts: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in entry.file.read_text().split("\n"):
        if line.startswith("<!-- ") and line.endswith(" -->") and " " not in line[5:-4]:
            current = parts.setdefault(line[5:-4], [])
        elif current is not None:
            current.append(line)
    return {k: "\n".join(v) for k, v in parts.items()}


__all__ = ["ANALYSES", "CONSTANTS_FORMAT", "Entry", "FORMAT", "KINDS", "Manifest", "NAME", "ROLES", "Use", "constants",
           "load", "notes", "read"]
