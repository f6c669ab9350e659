"""What is live on the GPU at a run's memory peak: the trainer's ``train.profile.memory=true`` (see
:mod:`fp4moe.train.profile`) and the MoE layer benchmark's ``--memtrace`` (:mod:`fp4moe.bench.moe_layer`). Plain Python.

The window records the CUDA caching allocator's history (``torch.cuda.memory._record_memory_history``, Python
stacks). :func:`peak_breakdown` replays that history as the allocator's ``allocated_bytes`` statistic counts: an
``alloc`` event adds its size rounded up to the allocator's 512-byte granule (the trace holds the requested size),
``free_requested`` removes it (the statistic drops there; ``free_completed`` comes later for blocks still in use by
another stream). The largest sum is the window's peak. It can fall short of ``torch.cuda.max_memory_allocated`` by
the few blocks the allocator hands out whole rather than split (a remainder too small to keep), well under 1 %.
The trainer starts the history before it builds the model, so the blocks live at the peak (and those already live
when the window opened: weights, gradients, optimizer state, anything an earlier step left behind) are grouped by
the innermost Python frame in fp4moe / megatron-core code (where the tensor was made) and by the innermost line of
the trainer's loop that was running (forward, backward, optimizer step; allocations made on autograd's backward
thread carry no such frame). What was allocated before the history began is the ``baseline``.

This is what the paper-scale memory model (:mod:`fp4moe.scale.memory`) is calibrated against: the saved activations
and the backward's transients at the peak, by site.
"""
from __future__ import annotations

import linecache
from collections import defaultdict
from typing import Any, Iterable

OWN_CODE = ("/fp4moe/", "/fp4moe_kernels/", "/megatron/")
LOOP_FILE = "/fp4moe/train/loop.py"


def _site(frames: list[dict]) -> str:
    """The innermost frame (frames are innermost first) in fp4moe or megatron-core code, as ``path:line func``
    with the path from the package folder on; ``<torch>`` / ``<no python frame>`` otherwise."""
    for f in frames:
        name = str(f.get("filename", ""))
        for marker in OWN_CODE:
            i = name.rfind(marker)
            if i >= 0:
                return f"{name[i + 1:]}:{f.get('line')} {f.get('name')}"
    return "<torch>" if frames else "<no python frame>"


GRANULE = 512  # bytes: the CUDA caching allocator rounds every block up to a multiple of this
NO_LOOP_FRAME = "<no trainer frame: autograd's backward thread, or outside the loop>"


def _trainer_line(frames: list[dict]) -> str:
    """The source line of fp4moe.train.loop that was running (innermost such frame), e.g. ``loss = model(...)``."""
    for f in frames:
        name = str(f.get("filename", ""))
        if name.endswith(LOOP_FILE) or LOOP_FILE in name:
            text = linecache.getline(name, int(f.get("line") or 0)).strip()
            return text or f"loop.py:{f.get('line')}"
    return NO_LOOP_FRAME


def _apply(live: dict[int, tuple[int, list[dict]]], ev: dict) -> int:
    """Apply one trace event to ``live`` (address -> (bytes, frames)); returns the change in allocated bytes."""
    action = ev.get("action")
    if action == "alloc":
        size = -(-max(int(ev["size"]), 1) // GRANULE) * GRANULE
        live[int(ev["addr"])] = (size, ev.get("frames") or [])
        return size
    if action == "free_requested":
        got = live.pop(int(ev["addr"]), None)
        return -got[0] if got is not None else 0
    return 0


def _live_after(trace: list[dict], stops: Iterable[int]) -> dict[int, dict[int, tuple[int, list[dict]]]]:
    """The live blocks after the first ``stop`` events, for each of ``stops`` (one replay)."""
    wanted = sorted(set(stops))
    out: dict[int, dict[int, tuple[int, list[dict]]]] = {}
    live: dict[int, tuple[int, list[dict]]] = {}
    for i, ev in enumerate(trace):
        while wanted and wanted[0] == i:
            out[wanted.pop(0)] = dict(live)
        _apply(live, ev)
    for stop in wanted:
        out[stop] = dict(live)
    return out


def peak_breakdown(trace: Iterable[dict], baseline_bytes: int, *, start_event: int = 0,
                   top: int = 40) -> dict[str, Any]:
    """Replay one device's allocator trace (``snapshot['device_traces'][i]``, events with ``action``, ``addr``,
    ``size`` and ``frames``) on top of ``baseline_bytes`` allocated before it began; the window whose peak is
    wanted starts at event ``start_event`` (the events before it only build up what is live when it opens).

    Returns ``peak_bytes`` (baseline + the largest live sum of traced blocks at or after ``start_event``),
    ``baseline_bytes``, ``traced_at_peak_bytes``, ``peak_event`` (index into the trace), ``events``, ``start_event``,
    ``at_start_bytes`` (traced blocks live when the window opened) and, as lists of ``{"where", "bytes", "blocks"}``
    largest first: ``by_site`` and ``by_trainer_line`` (live at the peak), ``at_start_by_site`` and
    ``at_start_by_trainer_line`` (live when the window opened). Site lists are cut to ``top`` rows plus one
    ``<other>`` row. Frees of blocks allocated before the trace began are ignored (they belong to the baseline)."""
    trace = list(trace)
    n, start = len(trace), min(int(start_event), len(trace))
    live: dict[int, tuple[int, list[dict]]] = {}
    cur = best = at_start_bytes = 0
    best_at, best_stop = start, start  # the peak event, and how many events are applied at the peak
    for i, ev in enumerate(trace):  # one pass for the sums; the live sets are rebuilt below, not copied at each rise
        if i == start:
            at_start_bytes = best = cur
        cur += _apply(live, ev)
        if i >= start and ev.get("action") == "alloc" and cur > best:
            best, best_at, best_stop = cur, i, i + 1
    if start == n:  # an empty window: what is live at the end
        at_start_bytes = best = cur
        best_at = best_stop = n
    snap = _live_after(trace, (start, best_stop))
    at_start, best_live = snap[start], snap[best_stop]

    def group(blocks: dict[int, tuple[int, list[dict]]], key) -> dict[str, list[int]]:
        table: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for size, frames in blocks.values():
            row = table[key(frames)]
            row[0] += size
            row[1] += 1
        return table

    def rows(table: dict[str, list[int]], cut: int | None) -> list[dict[str, Any]]:
        out = [{"where": k, "bytes": v[0], "blocks": v[1]} for k, v in sorted(table.items(), key=lambda kv: -kv[1][0])]
        if cut is not None and len(out) > cut:
            rest = out[cut:]
            out = out[:cut] + [{"where": "<other>", "bytes": sum(r["bytes"] for r in rest),
                                "blocks": sum(r["blocks"] for r in rest)}]
        return out

    return {"peak_bytes": int(baseline_bytes) + best, "baseline_bytes": int(baseline_bytes),
            "traced_at_peak_bytes": best, "peak_event": best_at, "events": n, "start_event": int(start_event),
            "at_start_bytes": at_start_bytes,
            "by_site": rows(group(best_live, _site), top), "by_trainer_line": rows(group(best_live, _trainer_line), None),
            "at_start_by_site": rows(group(at_start, _site), top),
            "at_start_by_trainer_line": rows(group(at_start, _trainer_line), None)}


def format_breakdown(b: dict[str, Any]) -> str:
    """A plain-text table of :func:`peak_breakdown`'s result (GiB and % of the peak, largest first)."""
    gib = 2 ** 30
    out = [f"peak {b['peak_bytes'] / gib:.3f} GiB = {b['baseline_bytes'] / gib:.3f} GiB allocated before the history "
           f"began + {b['traced_at_peak_bytes'] / gib:.3f} GiB of traced blocks live at event {b['peak_event']} of "
           f"{b['events']}; {b['at_start_bytes'] / gib:.3f} GiB of them were already live when the window opened "
           f"(event {b['start_event']})"]
    for title, key in (("live at the peak, by trainer line", "by_trainer_line"),
                       ("live at the peak, by allocation site", "by_site"),
                       ("live when the window opened, by trainer line", "at_start_by_trainer_line"),
                       ("live when the window opened, by allocation site", "at_start_by_site")):
        out.append(f"\n{title}:")
        for r in b[key]:
            pct = 100.0 * r["bytes"] / b["peak_bytes"] if b["peak_bytes"] else 0.0
            out.append(f"  {r['bytes'] / gib:9.3f} GiB {pct:5.1f}% {r['blocks']:6d} blocks  {r['where']}")
    return "\n".join(out) + "\n"


__all__ = ["peak_breakdown", "format_breakdown"]
