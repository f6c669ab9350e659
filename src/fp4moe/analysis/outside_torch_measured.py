"""The measured memory outside PyTorch's allocator (fp4moe.scale.outside_torch says what each term is and how the
model scales it), from the measuring tool's results document (tools/device/measure_outside_torch.py): the file of
results/manifest.yaml's ``memory`` / ``outside_torch`` role. No torch.

    measured()                      -> Measured (the terms in bytes and where they come from)
    measured_assumptions(**kw)      -> fp4moe.scale.memory.MemoryAssumptions with the measured terms (+ ``kw``)
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..scale.memory import NOT_MEASURED, MemoryAssumptions
from . import manifest

FORMAT = "fp4moe-outside-torch/1"   # the measuring tool's results document


@dataclass(frozen=True)
class Measured:
    """The measured terms in bytes and where they come from (``source``: the file, or ``NOT_MEASURED``)."""

    cuda_context_bytes: int = 0
    nccl_communicator_bytes: int = 0
    nccl_peer_bytes: int = 0
    nccl_p2p_peer_bytes: int = 0
    allocator_gap_bytes: int = 0
    allocator_gap_ref_elements: int = 0
    source: str = NOT_MEASURED

    def assumptions(self, **kw: Any) -> MemoryAssumptions:
        """``MemoryAssumptions`` with these terms (and ``kw``)."""
        return MemoryAssumptions(cuda_context_bytes=self.cuda_context_bytes,
                                 nccl_communicator_bytes=self.nccl_communicator_bytes,
                                 nccl_peer_bytes=self.nccl_peer_bytes, nccl_p2p_peer_bytes=self.nccl_p2p_peer_bytes,
                                 allocator_gap_bytes=self.allocator_gap_bytes,
                                 allocator_gap_ref_elements=self.allocator_gap_ref_elements,
                                 outside_torch_source=self.source, **kw)


def _stage_gain(child: dict | None, first: str, last: str) -> int | None:
    """Outside-PyTorch bytes a child of the tool gained from stage ``first`` to stage ``last`` (the largest over its
    ranks); None where the child or a stage is missing (no such measurement, or the tool's run of it failed)."""
    if not child:
        return None
    gains = []
    for rank in child.get("ranks") or [child]:
        out = {x.get("stage"): x.get("outside_bytes") for x in rank.get("stages") or []}
        if out.get(first) is None or out.get(last) is None:
            return None
        gains.append(int(out[last]) - int(out[first]))
    return max(gains) if gains else None


def derive(doc: dict[str, Any], source: str = "") -> Measured:
    """The model's terms from a results document of the measuring tool (``FORMAT``); a term whose measurement is
    missing (e.g. no second GPU: no peer bytes) is 0, and ``source`` says which terms are measured. The two peer
    terms come from the 2-rank group's stages (with the lab's ``NCCL_MIN_NCHANNELS=32`` where measured), less what
    the 1-rank group gained over the same stages: the all-reduces (group -> all_reduce) connect the collectives'
    ring, the all-to-all after them (all_reduce -> all_to_all) its send / recv peer."""
    if doc.get("format") != FORMAT:
        raise ValueError(f"{source or 'results'}: format {doc.get('format')!r}, expected {FORMAT!r}: write it with "
                         "tools/device/measure_outside_torch.py")
    if doc.get("dry_run"):
        raise ValueError(f"{source or 'results'} is a dry run (no GPU measured anything): run the tool on a GPU")
    nccl = doc.get("nccl") or {}
    one = (nccl.get("world1") or {}).get("communicator_bytes")
    two = nccl.get("world2_lab") or nccl.get("world2")
    peer = p2p = None
    if two:
        stages = {"peer": ("group", "all_reduce"), "p2p": ("all_reduce", "all_to_all")}
        gains = {k: _stage_gain(two, *v) for k, v in stages.items()}
        base = {k: _stage_gain(nccl.get("world1"), *v) or 0 for k, v in stages.items()}
        if None not in gains.values():
            peer, p2p = (max(0, gains[k] - base[k]) for k in ("peer", "p2p"))
    gap = doc.get("allocator") or {}
    training = doc.get("training_process") or {}
    context = training.get("outside_torch_bytes")
    parts = []
    if context is not None:
        context = max(0, int(context) - int(one or 0))
        parts.append("context")
    if one is not None:
        parts.append("NCCL communicator")
    if peer is not None:
        parts.append("NCCL peers")
    if gap.get("gap_bytes") is not None:
        parts.append("allocator gap")
    missing = [t for t in ("context", "NCCL communicator", "NCCL peers", "allocator gap") if t not in parts]
    unmeasured = f"; not measured, 0: {', '.join(missing)}" if missing else ""
    what = (f"{source or 'results'} ({doc.get('gpu', '?')}, {doc.get('date', '?')}, {doc.get('commit', '?')}: "
            f"{', '.join(parts) or 'nothing'} measured{unmeasured})")
    return Measured(int(context or 0), int(one or 0), int(peer or 0), int(p2p or 0), int(gap.get("gap_bytes") or 0),
                    int(gap.get("ref_elements") or 0), what)


def load(path: str | Path, source: str = "") -> Measured:
    """``derive`` of the results file at ``path`` (named ``source``, default the path), or every term 0 with
    ``source = NOT_MEASURED`` when it does not exist."""
    path = Path(path)
    if not path.is_file():
        return Measured()
    return derive(json.loads(path.read_text()), source or str(path))


@functools.cache
def measured() -> Measured:
    """The H200 measurement the manifest names (role ``memory`` / ``outside_torch``)."""
    entry, _ = manifest.load().one("memory", "outside_torch")
    return load(entry.file, entry.repo_path)


def measured_assumptions(**kw: Any) -> MemoryAssumptions:
    """``MemoryAssumptions`` with the measured terms outside PyTorch (``measured()``) and ``kw``."""
    return measured().assumptions(**kw)


__all__ = ["FORMAT", "Measured", "derive", "load", "measured", "measured_assumptions"]
