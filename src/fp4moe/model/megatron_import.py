"""Import megatron-core once per process, optionally with its fused elementwise functions left eager.

megatron-core decorates ~40 fused functions (bias + SwiGLU/GeLU, bias-dropout-add, RoPE helpers) with its
``jit_fuser``, which is ``torch.compile``: building those wrappers imports dynamo and costs ~3 s per process at
import time on the CPU machines. On a CPU-only run the trainer disables dynamo anyway (fp4moe.train.loop._run), so
there the wrappers are never used; ``import_megatron_core(eager_fusions=True)`` makes megatron's ``jit_fuser`` the
identity instead (what ``megatron.core.jit.disable_jit_fuser`` does, but before the decorated modules are imported,
which megatron's own switch cannot). A GPU run imports megatron-core unchanged.
"""
from __future__ import annotations

import importlib
import sys


def _identity_compile(model=None, **_kwargs):
    """``torch.compile``'s call forms, compiling nothing: ``compile(fn, ...)`` -> fn, ``compile(...)`` -> decorator."""
    return model if model is not None else (lambda fn: fn)


def import_megatron_core(eager_fusions: bool) -> bool:
    """Import ``megatron.core``; with ``eager_fusions`` its ``jit_fuser`` is the identity for this process. Returns
    whether the fusions are eager (False as well when megatron-core was imported before this call: nothing changes)."""
    if "megatron.core" in sys.modules or not eager_fusions:
        importlib.import_module("megatron.core")
        return False
    import torch

    compile_ = torch.compile
    torch.compile = _identity_compile
    try:
        jit = importlib.import_module("megatron.core.jit")  # megatron.core's __init__ first, decorating everything
    finally:
        torch.compile = compile_
    jit.jit_fuser = jit.noop_decorator  # for modules imported later
    return True
