"""Kernel switches: which implementation of an operation runs, held in one place (torch-free).

Every switch chooses between implementations that compute the same thing (each pair is tested against the other);
none changes the recipe. :class:`Switches` is also the schema of the trainer's ``kernels`` config group
(``kernels/base_kernels`` in Hydra's ConfigStore, fp4moe.settings): composition refuses a key it lacks, and
``fp4moe.settings.Settings.kernels`` is the instance the run holds. Each switch has an environment variable, an
override read here and nowhere else (:func:`env_value`): by :meth:`Switches.from_env` for the kernels used on their
own, and by conf/kernels/default.yaml, whose values are ``${fp4moe.kernel_env:<switch>}`` (the resolver is
:func:`env_value`), so a run's config records the switches it ran with. A command-line ``kernels.<switch>=...``
wins over the variable.

=================  =========================  ======================================================================
field              environment variable       values (first: the default)
=================  =========================  ======================================================================
cuda_col           FP4MOE_CUDA_COL            auto (CUDA C++ FP4RowToFP8Col where it builds), 1 (insist, warn when
                                              it cannot run), 0 (Triton)
dispatch_quantize  FP4MOE_DISPATCH_QUANTIZE   tokens (quantize each token once, permute its MXFP4 rows), rows
                                              (permute BF16 tokens, quantize the T*k rows)
fused_swiglu       FP4MOE_FUSED_SWIGLU        1 (fused Triton SwiGLU on CUDA), 0 (the torch formulas)
fused_swiglu_fp4   FP4MOE_FUSED_SWIGLU_FP4    1 (the SwiGLU writes its input's MXFP4 copy in the same pass), 0
fused_swiglu_fp8   FP4MOE_FUSED_SWIGLU_FP8    0 (the routed experts' SwiGLU writes z, and its backward dh, in BF16 for
                                              the FP8 quantizers), 1 (it writes their FP8 rows and columns itself,
                                              where fused_swiglu is 1: the same bits, z and dh never in memory)
gather_sum         FP4MOE_GATHER_SUM          triton (each token's k rows of the MoE permutation summed by one kernel,
                                              rows read once, on CUDA; summed in row order, which torch's CUDA
                                              reduction may not keep), torch (index_select, then sum)
grouped_gemm       FP4MOE_GROUPED_GEMM        triton (one grouped launch per expert GEMM on CUDA), deepgemm
                                              (fprop / dgrad through DeepGEMM on rows padded to 128 per expert,
                                              wgrad Triton; fp4moe_kernels.deepgemm), loop (one GEMM per expert)
fp8_row_col        FP4MOE_FP8_ROW_COL         0 (an operand's FP8 row and column copies by two kernels), 1 (one kernel
                                              reading it once: ``convert.bf16_to_fp8_row_col``; the same bits)
wgrad_gemm         FP4MOE_WGRAD_GEMM          triton (the grouped Triton wgrad, one launch, where grouped_gemm is
                                              triton or deepgemm), loop (one cuBLAS ``F.scaled_mm`` per expert:
                                              host-bound for small experts, near the dense rate for large ones)
tiles              FP4MOE_TILES               '' (the swept defaults), or JSON / the path of a JSON file: conversion
                                              kernels' tiles (``triton_kernels.launchers.tiles_from_env``)
gemm_tiles         FP4MOE_GEMM_TILES          '' (the swept defaults), or JSON: the grouped GEMMs' tiles
bf16_moe           FP4MOE_BF16_MOE            megatron (the bf16 recipe's MoE layers are megatron-core's own:
                                              SequentialMLP experts, its all-to-all dispatcher), fp4moe (fp4moe's
                                              MoE layer with the BF16 grouped expert path, as the FP8 recipes'
                                              layers are built; read when the model is built)
=================  =========================  ======================================================================

``current()`` is what the operations read: the switches set by ``use`` (the trainer sets its config's), else the
environment's, read at each call (so a change of the environment, e.g. a test's, takes effect at once).
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, fields
from typing import Iterator, Mapping

ENV = {"cuda_col": "FP4MOE_CUDA_COL", "dispatch_quantize": "FP4MOE_DISPATCH_QUANTIZE",
       "fused_swiglu": "FP4MOE_FUSED_SWIGLU", "fused_swiglu_fp4": "FP4MOE_FUSED_SWIGLU_FP4",
       "grouped_gemm": "FP4MOE_GROUPED_GEMM", "tiles": "FP4MOE_TILES", "gemm_tiles": "FP4MOE_GEMM_TILES",
       "bf16_moe": "FP4MOE_BF16_MOE", "wgrad_gemm": "FP4MOE_WGRAD_GEMM", "fp8_row_col": "FP4MOE_FP8_ROW_COL",
       "fused_swiglu_fp8": "FP4MOE_FUSED_SWIGLU_FP8", "gather_sum": "FP4MOE_GATHER_SUM"}
# the values each choice switch takes (the first is the default) and what each means, for the error message
CHOICES = {
    "cuda_col": (("auto", "1", "0"), "auto (the default: CUDA C++ where it builds), 1 (CUDA C++, warn when it cannot "
                                     "run) or 0 (Triton)"),
    "dispatch_quantize": (("tokens", "rows"), "tokens (the default: quantize each token once, then permute its MXFP4 "
                                              "rows) or rows (quantize the permuted rows)"),
    "fused_swiglu": (("1", "0"), "1 (the default: the fused Triton SwiGLU on CUDA) or 0 (the torch formulas)"),
    "fused_swiglu_fp4": (("1", "0"), "1 (the default: the SwiGLU writes its input's MXFP4 copy) or 0"),
    "grouped_gemm": (("triton", "deepgemm", "loop"), "'triton' (the default: one grouped launch per GEMM), 'deepgemm' "
                                                  "(fprop / dgrad through DeepGEMM) or 'loop'"),
    "fp8_row_col": (("0", "1"), "0 (the default: an operand's FP8 row and column copies by two kernels) or 1 (one "
                                "kernel for both)"),
    "fused_swiglu_fp8": (("0", "1"), "0 (the default: the experts' SwiGLU writes BF16 for the FP8 quantizers) or 1 "
                                     "(it writes the FP8 rows and columns itself)"),
    "gather_sum": (("triton", "torch"), "'triton' (the default: one kernel reading each row once) or 'torch' (a "
                                         "gather, then a sum)"),
    "wgrad_gemm": (("triton", "loop"), "'triton' (the default: the grouped Triton wgrad) or 'loop' (one cuBLAS GEMM "
                                       "per expert)"),
    "bf16_moe": (("megatron", "fp4moe"), "'megatron' (the default: the bf16 recipe keeps megatron-core's MoE layers) "
                                         "or 'fp4moe' (fp4moe's MoE layer, BF16 grouped experts)"),
}


class SwitchError(ValueError):
    """A switch with a value it does not take; the message names the variable (or config key) and the values."""

    def __init__(self, message: str, name: str = "", raw: object = None, words: str = ""):
        super().__init__(message)
        self.name, self.raw, self.words = name, raw, words


@dataclass(frozen=True)
class Switches:
    """The kernel switches (the module docstring's table). Values are normalised (stripped, lower case for the
    choices; an empty choice is its default) and checked: SwitchError names the switch as ``where`` spells it."""

    cuda_col: str = "auto"
    dispatch_quantize: str = "tokens"
    fused_swiglu: str = "1"
    fused_swiglu_fp4: str = "1"
    grouped_gemm: str = "triton"
    tiles: str = ""
    gemm_tiles: str = ""
    bf16_moe: str = "megatron"
    wgrad_gemm: str = "triton"
    fp8_row_col: str = "0"
    fused_swiglu_fp8: str = "0"
    gather_sum: str = "triton"

    def __post_init__(self) -> None:
        for f in fields(self):
            raw = getattr(self, f.name)
            text = "" if raw is None else str(raw).strip()
            if isinstance(raw, bool):  # YAML true / false for the 1 / 0 switches
                text = "1" if raw else "0"
            if f.name in CHOICES:
                values, words = CHOICES[f.name]
                text = text.lower() or values[0]
                if set(values) == {"0", "1"} and text in ("true", "false"):  # a bool the str-typed config spelled out
                    text = "1" if text == "true" else "0"
                if text not in values:
                    raise SwitchError(f"{ENV[f.name]}={raw!r}: use {words}", f.name, raw, words)
            object.__setattr__(self, f.name, text)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Switches":
        """The switches the environment sets (unset ones: their defaults)."""
        return cls(**{name: env_value(name, environ) for name in ENV})

    @classmethod
    def from_config(cls, node: Mapping | None) -> "Switches":
        """The switches of a ``kernels`` config node (its keys are the fields; missing ones: defaults). SwitchError
        for an unknown key or value, naming ``kernels.<key>``."""
        node = dict(node or {})
        unknown = sorted(set(node) - set(ENV))
        if unknown:
            raise SwitchError(f"kernels has unknown key(s) {unknown}: the switches are {', '.join(ENV)}")
        try:
            return cls(**node)
        except SwitchError as e:
            raise SwitchError(f"kernels.{e.name}={e.raw!r} (the config's, or ${ENV[e.name]}'s): use {e.words}",
                              e.name, e.raw, e.words) from None

    def as_env(self) -> dict[str, str]:
        """{variable: value} for the switches that differ from their defaults (e.g. for a child process)."""
        default = Switches()
        return {ENV[f.name]: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


def env_value(name: str, environ: Mapping[str, str] | None = None) -> str:
    """Switch ``name``'s environment variable as written (``ENV[name]``; ``environ``: default ``os.environ``), else
    the switch's default: the one place the ``FP4MOE_*`` kernel variables are read. Also the resolver
    ``${fp4moe.kernel_env:<name>}`` of conf/kernels/default.yaml."""
    if name not in ENV:
        raise SwitchError(f"{name!r} is not a kernel switch: the switches are {', '.join(ENV)}", name)
    env = os.environ if environ is None else environ
    return env.get(ENV[name], _DEFAULTS[name])


_DEFAULTS = {f.name: f.default for f in fields(Switches)}
_SET: list[Switches] = []


def current() -> Switches:
    """The switches in force: the innermost ``use``, else the environment's (read now; parsed once per distinct set
    of values: the kernels ask on every call, tens of times per layer and step)."""
    if _SET:
        return _SET[-1]
    return _parsed(tuple(os.environ.get(var) for var in ENV.values()))


@functools.lru_cache(maxsize=16)
def _parsed(values: tuple[str | None, ...]) -> Switches:
    """``Switches.from_env`` of the environment whose ``ENV`` variables hold ``values`` (None: unset)."""
    return Switches.from_env({var: v for var, v in zip(ENV.values(), values) if v is not None})


@contextlib.contextmanager
def use(switches: Switches) -> Iterator[Switches]:
    """Run the block with ``switches`` in force (nested uses stack; the previous ones return after the block)."""
    _SET.append(switches)
    try:
        yield switches
    finally:
        _SET.pop()


__all__ = ["CHOICES", "ENV", "SwitchError", "Switches", "current", "env_value", "use"]
