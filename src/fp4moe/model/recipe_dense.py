"""The precision recipe in megatron-core 0.16.1's attention and dense MLPs (``scope: all_linears``), no TE: spec modules.

Under ``scope: all_linears`` (``Recipe.applies_to('dense')``) the layer spec (``fp4moe.model.gpt_model.layer_spec``) puts
these in place of megatron's local linears outside the MoE layers: MLA's projections, its output projection, the
dense MLPs' fc1 / fc2, MTP's ``eh_proj``. Not the embedding or the output layer.

=================================  ===============================  ==============================================
megatron (local spec)              ours                             what changes
=================================  ===============================  ==============================================
``ColumnParallelLinear``           :class:`FP8ColumnParallelLinear`  the GEMMs through ``fp8_linear(..., 'dense')``
``RowParallelLinear``              :class:`FP8RowParallelLinear`     the same
``MLASelfAttention``               :class:`RecipeMLASelfAttention`   its two down-projections FP8 (below)
=================================  ===============================  ==============================================

Each is a subclass that only changes the forward's GEMM (``_forward_impl``, which megatron's linears call with
their input and weight): parameters, their names and initialisation are megatron's, so checkpoints load across
recipes. A linear whose in / out features are not both multiples of 128 (the FP8 weight blocks) stays BF16
(``computes_fp8`` False). TP = 1 only (``fp4moe.model.gpt_model`` refuses TP > 1 under fp8 / mxfp4).

The one place a megatron type check forbids a subclass: ``MLASelfAttention.__init__``
(multi_latent_attention.py, ``submodules.linear_q_down_proj in [Linear, TEColumnParallelLinear,
ColumnParallelLinear]`` and the same for ``linear_kv_down_proj``) accepts only those exact classes for the two
down-projections (it picks their constructor arguments by class; the up-projections and ``linear_proj`` are
unchecked). So the spec keeps ``ColumnParallelLinear`` there and :class:`RecipeMLASelfAttention`, the spec's
attention module under all_linears, turns those two children into :class:`FP8ColumnParallelLinear` when it has
built them (a class change of its own children in its constructor; no new parameters, no RNG drawn).
"""
from __future__ import annotations

import functools

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from ..ops.fp8_linear import fp8_linear
from ..recipe import Recipe

FP8_BLOCK = 128  # in and out features of an FP8 linear: multiples of the 128 x 128 weight blocks


def _fp8_forward_impl(recipe: Recipe, input: torch.Tensor, weight: torch.Tensor, bias=None, *args, **kwargs):
    """megatron's linear ``_forward_impl`` (``linear_with_grad_accumulation_and_async_allreduce``; TP = 1) as
    ``fp8_linear(..., layer_kind='dense')``, back in the input's dtype."""
    y = fp8_linear(input, weight, recipe, layer_kind="dense").to(input.dtype)
    return y if bias is None else y + bias


class _FP8Dense:
    """What both FP8 linears add to megatron's: the recipe and whether this linear computes in FP8."""

    recipe: Recipe | None = None
    computes_fp8: bool = False

    def _use_recipe(self, recipe: Recipe | None) -> None:
        self.recipe = recipe
        weight = getattr(self, "weight", None)
        self.computes_fp8 = bool(recipe is not None and recipe.applies_to("dense") and weight is not None
                                 and weight.shape[0] % FP8_BLOCK == 0 and weight.shape[1] % FP8_BLOCK == 0)
        if self.computes_fp8:
            self._forward_impl = functools.partial(_fp8_forward_impl, recipe)


class FP8ColumnParallelLinear(_FP8Dense, ColumnParallelLinear):
    """megatron's ``ColumnParallelLinear`` computing through ``fp8_linear`` (spec param ``recipe``)."""

    def __init__(self, *args, recipe: Recipe, **kwargs):
        super().__init__(*args, **kwargs)
        self._use_recipe(recipe)


class FP8RowParallelLinear(_FP8Dense, RowParallelLinear):
    """megatron's ``RowParallelLinear`` computing through ``fp8_linear`` (spec param ``recipe``)."""

    def __init__(self, *args, recipe: Recipe, **kwargs):
        super().__init__(*args, **kwargs)
        self._use_recipe(recipe)


class RecipeMLASelfAttention(MLASelfAttention):
    """megatron's ``MLASelfAttention`` whose down-projections compute in FP8 under the recipe (spec param ``recipe``;
    None or a recipe without all_linears: megatron's own). Its other linears are the spec's (FP8 classes under
    all_linears); why the down-projections are done here: the module docstring."""

    DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")

    def __init__(self, *args, recipe: Recipe | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if recipe is None or not recipe.applies_to("dense"):
            return
        for name in self.DOWN_PROJECTIONS:
            linear = getattr(self, name, None)
            if type(linear) is ColumnParallelLinear:
                linear.__class__ = FP8ColumnParallelLinear
                linear._use_recipe(recipe)


def fp8_linear_spec(linear: type, recipe: Recipe):
    """The spec of ``linear`` (megatron's ``ColumnParallelLinear`` / ``RowParallelLinear``) under ``recipe``'s
    all_linears: the FP8 subclass with the recipe; anything else unchanged."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    fp8 = {ColumnParallelLinear: FP8ColumnParallelLinear, RowParallelLinear: FP8RowParallelLinear}.get(linear)
    return linear if fp8 is None else ModuleSpec(module=fp8, params={"recipe": recipe})


def bf16_linears(model: torch.nn.Module) -> list[str]:
    """Names of the recipe's dense linears in ``model`` that stay BF16 (dims not multiples of 128)."""
    return [n for n, m in model.named_modules() if isinstance(m, _FP8Dense) and not m.computes_fp8]


def fp8_linears(model: torch.nn.Module) -> list[str]:
    """Names of the recipe's dense linears in ``model`` that compute in FP8."""
    return [n for n, m in model.named_modules() if isinstance(m, _FP8Dense) and m.computes_fp8]


__all__ = ["FP8ColumnParallelLinear", "FP8RowParallelLinear", "RecipeMLASelfAttention", "fp8_linear_spec",
           "bf16_linears", "fp8_linears", "FP8_BLOCK"]
