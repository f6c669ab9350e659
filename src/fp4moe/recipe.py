"""The precision recipe of a run: which linears compute in FP8, what is stored and sent in MXFP4 (docs/recipe.md).

A leaf module (standard library only; OmegaConf is imported lazily by ``Recipe.from_config``).

Three presets, one per column of the paper's tables::

    Recipe.bf16()    plain BF16 everywhere
    Recipe.fp8()     blockwise FP8 compute (1x128 activations, 128x128 weights), BF16 dispatch, inputs saved
                     for backward as FP8 row + FP8 column copies (Transformer Engine's Float8BlockScaling)
    Recipe.mxfp4()   the paper's: FP8 compute, MXFP4 dispatch, expert inputs kept MXFP4, every FP8 linear
                     saves its input as MXFP4, SwiGLU input stored MXFP4; backward on the FP8 path

``Recipe.from_config({"name": "mxfp4", "save_fp4": False})`` starts from the preset that ``name`` picks and
overrides the given keys (so a Hydra ``precision/`` file only lists what differs; a null keeps the preset's value,
which is what the ``precision`` group's schema, fp4moe.settings.Precision, holds for a key no file sets). Invalid
combinations raise ``RecipeError`` naming the key and the fix; the trainer parses its recipe once
(``fp4moe.settings.Settings.precision``).

Decisions where the paper is silent:

* ``dispatch_fp4`` and ``expert_input_fp4`` are independent. dispatch_fp4 without expert_input_fp4: the receiver
  dequantizes the MXFP4 payload to BF16 (exact) and the experts quantize that BF16 to FP8 rows as in the fp8
  recipe (one BF16 tensor in memory; the FP4 error is still paid). expert_input_fp4 without dispatch_fp4: the
  dispatch carries BF16 and the receiver quantizes to MXFP4 itself (BF16ToFP4Row), then FP4RowToFP8Row feeds the
  GEMM and the MXFP4 copy is what is saved. Both are ablations; the paper's recipe sets both.
* FP4 switches are only valid with ``name='mxfp4'``, and ``name='mxfp4'`` needs at least one of them on (with all
  off it *is* the fp8 recipe: a result table grouped by name would then mislabel it).
* Gradients are never FP4: ``backward_a2a`` is 'bf16' or 'fp8' (the latter only with FP8 compute).
* ``scope`` says which linears the FP8 compute *and* the FP4 storage cover (``applies_to``); linears outside it
  run in BF16. Presets use 'experts+shared' (the whole MoE layer, as in the paper's T2 "all MoE" row).
* ``scale_rule`` is the MXFP4 UE8M0 scale rule (docs/formats.md): 'ceil' (default, never clips) or 'floor' (OCP MX).
* ``label`` is what results call a variant of a preset (``tag``: the trainer's MLflow tag ``recipe``, by which the
  report groups runs): conf/precision/mxfp4_mlp_shared.yaml is ``name: mxfp4`` (its kernels, its memory) with
  ``label: mxfp4_mlp_shared``, so its runs never share a row with the paper's mxfp4. A label may not be another
  preset's name.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NAMES = ("bf16", "fp8", "mxfp4")
BACKWARD_A2A = ("bf16", "fp8")
SCOPES = ("experts", "experts+shared", "all_linears")
SCALE_RULES = ("ceil", "floor")
LAYER_KINDS = ("expert", "shared_expert", "dense")
FP4_SWITCHES = ("dispatch_fp4", "expert_input_fp4", "save_fp4", "activation_fp4_store", "recompute_cache_fp4")


class RecipeError(ValueError):
    """An unknown key, a bad value or an invalid combination in a recipe; the message names the key and the fix."""


@dataclass(frozen=True)
class Recipe:
    """Precision recipe (frozen; build with a preset or ``from_config``)."""

    # Recipe family: 'bf16' (no quantization), 'fp8' (blockwise FP8 GEMMs, BF16 storage/communication of the
    # forward activations except FP8 saved copies) or 'mxfp4' (FP8 GEMMs + the FP4 switches below).
    name: str = "bf16"
    # Dispatch all-to-all carries MXFP4 rows (data [T, H/2] + UE8M0 scales [T, H/32], 0.53 B/element) instead
    # of BF16 (2 B/element).
    dispatch_fp4: bool = False
    # Experts keep their input as MXFP4 and feed the fc1 GEMM through FP4RowToFP8Row (no BF16 copy).
    expert_input_fp4: bool = False
    # Every FP8 linear in scope saves its input for backward as MXFP4 only (wgrad operand rebuilt with
    # FP4RowToFP8Col) instead of FP8 row + FP8 column copies.
    save_fp4: bool = False
    # The SwiGLU input (fc1 output) is stored for backward as MXFP4 instead of BF16.
    activation_fp4_store: bool = False
    # Recompute caches that are not already MXFP4 are kept as MXFP4: the inputs of fp4moe's layernorm recompute,
    # the MLA up-projection latents (mla_up_proj), the q/k/v of megatron's core_attn recompute and the dense-MLP
    # input (mlp); not the layer inputs of full recompute (its backward re-runs the routing: fp4moe.model.recompute).
    # Backward then reads E2M1-rounded values: ~12-20 % relative error on the gradients that read them directly
    # (norm weights, q/kv projections, router; tests/model/test_recipe_model.py). The routed experts' cache is the
    # dispatched MXFP4 itself under expert_input_fp4, independent of this switch.
    recompute_cache_fp4: bool = False
    # Codec of the gradient all-to-alls (combine backward, dispatch backward): 'bf16' or 'fp8' (1x128 E4M3).
    backward_a2a: str = "bf16"
    # Which linears the FP8 compute and FP4 storage cover: 'experts' (routed experts), 'experts+shared'
    # (routed + shared experts: the whole MoE layer) or 'all_linears' (also attention / dense MLP linears).
    scope: str = "experts+shared"
    # MXFP4 UE8M0 scale rule: 'ceil' (2**ceil(log2(amax/6)), nothing clips) or 'floor' (OCP MX, may clip).
    scale_rule: str = "ceil"
    # What results call this recipe when it is a variant of its preset (``tag``); empty: ``name``.
    label: str = ""

    def __post_init__(self):
        _check_choice("name", self.name, NAMES)
        for key in FP4_SWITCHES:
            v = getattr(self, key)
            if not isinstance(v, bool):
                raise RecipeError(f"{key} must be true or false, got {v!r} ({type(v).__name__})")
        _check_choice("backward_a2a", self.backward_a2a, BACKWARD_A2A, extra=(
            " (gradients are never FP4: docs/recipe.md)" if self.backward_a2a in ("fp4", "mxfp4") else ""))
        _check_choice("scope", self.scope, SCOPES)
        _check_choice("scale_rule", self.scale_rule, SCALE_RULES)
        if not isinstance(self.label, str) or any(ch.isspace() for ch in self.label):
            raise RecipeError(f"label must be a word (the name results give this recipe), got {self.label!r}")
        if self.label in NAMES and self.label != self.name:
            raise RecipeError(
                f"label={self.label!r} with name={self.name!r} would put this recipe's runs with the {self.label} "
                f"preset's: give the variant its own label (e.g. its precision file's name), or set name: {self.label}"
            )
        on = [k for k in FP4_SWITCHES if getattr(self, k)]
        if self.name != "mxfp4" and on:
            raise RecipeError(
                f"{', '.join(on)}=true needs name='mxfp4' (got name={self.name!r}): FP4 storage and communication "
                f"are part of the mxfp4 recipe; set name: mxfp4, or set {', '.join(on)} to false"
            )
        if self.name == "mxfp4" and not on:
            raise RecipeError(
                "name='mxfp4' with every FP4 switch false (dispatch_fp4, expert_input_fp4, save_fp4, "
                "activation_fp4_store, recompute_cache_fp4) is the fp8 recipe: set name: fp8, or turn at least one switch on"
            )
        if self.name == "bf16" and self.backward_a2a != "bf16":
            raise RecipeError(
                f"backward_a2a={self.backward_a2a!r} needs FP8 compute, but name='bf16': set backward_a2a: bf16, "
                "or name: fp8 / mxfp4"
            )

    # ------------------------------------------------------------------------------------------ presets

    @classmethod
    def bf16(cls) -> "Recipe":
        """Plain BF16: no quantization anywhere."""
        return cls(name="bf16")

    @classmethod
    def fp8(cls) -> "Recipe":
        """Blockwise FP8 compute, BF16 dispatch, FP8 row + column copies saved (TE Float8BlockScaling)."""
        return cls(name="fp8")

    @classmethod
    def mxfp4(cls) -> "Recipe":
        """The paper's recipe: FP8 compute with every FP4 switch on, BF16 gradient all-to-alls."""
        return cls(name="mxfp4", dispatch_fp4=True, expert_input_fp4=True, save_fp4=True, activation_fp4_store=True,
                   recompute_cache_fp4=True)

    @classmethod
    def preset(cls, name: str) -> "Recipe":
        """The preset called ``name`` ('bf16' | 'fp8' | 'mxfp4')."""
        _check_choice("name", name, NAMES)
        return getattr(cls, name)()

    @classmethod
    def from_config(cls, cfg: Any) -> "Recipe":
        """From a mapping or an OmegaConf node: the preset of ``cfg['name']`` (default 'bf16') with the other keys
        overriding it (a null key keeps the preset's value; a precision file's ``defaults`` list is skipped). Unknown
        keys and invalid combinations raise ``RecipeError``."""
        if isinstance(cfg, Recipe):
            return cfg
        if not isinstance(cfg, Mapping):
            try:  # an OmegaConf DictConfig (not always registered as a Mapping)
                from omegaconf import DictConfig, OmegaConf
            except ImportError:  # pragma: no cover
                DictConfig = None
            if DictConfig is not None and isinstance(cfg, DictConfig):
                cfg = OmegaConf.to_container(cfg, resolve=True)
            else:
                raise RecipeError(f"a recipe config must be a mapping (dict or OmegaConf node), got {type(cfg).__name__}")
        # null: the preset's value (fp4moe.settings.Precision); 'defaults': a conf/precision file's Hydra defaults list
        # (its schema), when the file is loaded as it is
        cfg = {k: v for k, v in dict(cfg).items() if v is not None and k != "defaults"}
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in cfg if k not in fields)
        if unknown:
            raise RecipeError(
                f"unknown recipe key(s) {', '.join(repr(k) for k in unknown)}: the keys are {', '.join(fields)}"
            )
        name = cfg.get("name", "bf16")
        # A config naming mxfp4 that switches some FP4 flags off keeps the preset's others on.
        return dataclasses.replace(cls.preset(name), **cfg)

    # ------------------------------------------------------------------------------------------ queries

    @property
    def tag(self) -> str:
        """The recipe's name in results (the trainer's MLflow tag and param ``recipe``; the report groups by it):
        ``label``, else ``name``."""
        return self.label or self.name

    @property
    def fp8_compute(self) -> bool:
        """True when linears in scope run their GEMMs in FP8 (recipes fp8 and mxfp4)."""
        return self.name != "bf16"

    def applies_to(self, layer_kind: str) -> bool:
        """Whether the FP8 (and, for mxfp4, FP4 storage) recipe covers a linear of ``layer_kind``:
        'expert' (routed expert fc1/fc2), 'shared_expert' or 'dense' (attention projections, dense MLPs).
        Always False for bf16; otherwise decided by ``scope``."""
        _check_choice("layer_kind", layer_kind, LAYER_KINDS)
        if not self.fp8_compute:
            return False
        if layer_kind == "expert":
            return True
        if layer_kind == "shared_expert":
            return self.scope in ("experts+shared", "all_linears")
        return self.scope == "all_linears"

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (for MLflow params and configs); ``from_config`` of it gives back self."""
        return dataclasses.asdict(self)


def _check_choice(key: str, value: Any, choices: tuple[str, ...], extra: str = "") -> None:
    if not isinstance(value, str) or value not in choices:
        raise RecipeError(f"{key}={value!r} is not one of {', '.join(repr(c) for c in choices)}{extra}: pick one of them")


__all__ = ["Recipe", "RecipeError", "NAMES", "BACKWARD_A2A", "SCOPES", "SCALE_RULES", "LAYER_KINDS", "FP4_SWITCHES"]
