"""Layout-invariant initial weights: the same seed gives the same model under any expert / pipeline layout.

megatron-core draws a rank's weights from RNG streams that depend on the layout: routed experts from the expert-
parallel tracker (seed + 1024 + 100 x EP rank, each rank drawing only its local experts, layer after layer), and a
pipeline stage's layers from a stream that does not know which global layers the stage holds. So EP=2 starts from
another model than EP=1, and a convergence comparison across layouts (or a test that EP2 x DP2 computes what one
process computes) compares different models.

:func:`reinit_layout_invariant` redraws every weight matrix (ndim >= 2) of a built ``GPTModel`` from its own
generator, seeded by the run's seed and the parameter's *global* name: ``decoder.layers.<global layer>...`` and
``experts.<global expert>...`` in place of megatron's per-rank local indices, and one name for every pipeline copy
of a tied embedding (so the copies stay equal). The distribution is megatron's own:
normal(0, ``init_method_std``) for every weight, normal(0, the output-layer std) for the output projections
(``linear_proj``, ``linear_fc2``: ``init_method_std / sqrt(2 x num_layers)``); constant tensors (norm weights,
biases) are left as built. Values depend on the device type (a CUDA generator draws other numbers than a CPU one).
"""
from __future__ import annotations

import functools
import re
import zlib
from typing import Any

import torch

OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")
SHARED_EMBEDDING = "embedding.word_embeddings.weight"  # the key of every copy of a tied (shared) embedding


def _std(fn: Any, what: str) -> float:
    if isinstance(fn, functools.partial) and "std" in (fn.keywords or {}):
        return float(fn.keywords["std"])
    from fp4moe.config import ConfigError

    raise ConfigError(f"layout-invariant init needs megatron's normal init methods, but config.{what} is {fn!r}: "
                      "set train.layout_invariant_init=false to keep megatron's own draws")


def global_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> global name: ``decoder.layers.<i>`` renumbered by the layer's ``layer_number``
    (1-based, global) minus 1, ``local_experts.<j>`` by the MoE layer's ``local_expert_indices[j]``; every copy of
    a tied embedding (megatron's ``shared_embedding`` attribute) is ``embedding.word_embeddings.weight``."""
    layer_of: dict[str, int] = {}
    experts_of: dict[str, list[int]] = {}
    for name, mod in model.named_modules():
        if re.fullmatch(r"(.*\.)?decoder\.layers\.\d+", name) and hasattr(mod, "layer_number"):
            layer_of[name] = int(mod.layer_number) - 1
        idx = getattr(mod, "local_expert_indices", None)
        if idx is not None:
            experts_of[name] = [int(i) for i in idx]
    out = {}
    for name, p in model.named_parameters():
        g = name
        m = re.match(r"((?:.*\.)?decoder\.layers\.\d+)(\..*)", name)
        if m and m.group(1) in layer_of:
            g = re.sub(r"decoder\.layers\.\d+$", f"decoder.layers.{layer_of[m.group(1)]}", m.group(1)) + m.group(2)
        e = re.match(r"(.*)\.experts\.local_experts\.(\d+)(\..*)", name)
        if e and e.group(1) in experts_of:
            glob = experts_of[e.group(1)][int(e.group(2))]
            g = g.replace(f"experts.local_experts.{e.group(2)}.", f"experts.global_experts.{glob}.", 1)
        if getattr(p, "shared_embedding", False):  # a pipeline's tied copies (first stage's embedding, the last
            g = SHARED_EMBEDDING                    # stage's output layer / MTP embedding): one key, equal values
        out[name] = g
    return out


@torch.no_grad()
def reinit_layout_invariant(model: torch.nn.Module, seed: int) -> int:
    """Redraw the weight matrices of ``model`` (see the module docstring); returns how many were redrawn."""
    cfg = model.config
    std_in, std_out = _std(cfg.init_method, "init_method"), _std(cfg.output_layer_init_method,
                                                                   "output_layer_init_method")
    names = global_names(model)
    n = 0
    for name, p in model.named_parameters():
        if p.ndim < 2 or p.numel() == 0:
            continue
        flat = p.detach().reshape(-1)
        if bool((flat == flat[0]).all()):  # constant (e.g. zero-initialised): layout-invariant already
            continue
        std = std_out if name.endswith(OUTPUT_PROJECTIONS) else std_in
        gen = torch.Generator(device=p.device)
        gen.manual_seed(zlib.crc32(f"{int(seed)}|{names[name]}".encode()))
        buf = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        buf.normal_(0.0, std, generator=gen)
        p.copy_(buf)
        n += 1
    return n


__all__ = ["reinit_layout_invariant", "global_names", "OUTPUT_PROJECTIONS"]
