"""CUDA synchronisations made by a piece of code, for the GPU tests that keep the host from waiting on the stream
(tests/ops/test_grouped_experts.py, tests/moe/test_layer.py). Imported as ``from cuda_syncs import sync_calls``
(tests/ is on sys.path through its conftest.py, as for ``oracles``)."""
from __future__ import annotations

import traceback
import warnings

import torch


def sync_calls(fn) -> list[str]:
    """The synchronizing CUDA calls ``fn()`` makes (torch's sync debug mode, one warning each: a wait of the host
    for the stream, e.g. a ``.tolist()`` or a copy from pageable host memory), each with the innermost frames of
    fp4moe's code that made it."""
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" in str(message):
            ours = [f"{fr.filename.rsplit('/', 2)[-2]}/{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno} {fr.name}"
                    for fr in traceback.extract_stack() if "fp4moe" in fr.filename and "/tests/" not in fr.filename]
            found.append(f"{str(message).splitlines()[0]} at {filename}:{lineno} <- " + " <- ".join(ours[::-1][:4]))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found
