"""fp4moe's recompute modules for megatron-core 0.16.1 without Transformer Engine (``recompute.fp4moe_modules``).

``layernorm``: megatron's own output-discarding checkpoint of ``input_layernorm`` / ``pre_mlp_layernorm``
(megatron/core/transformer/transformer_layer.py: ``CheckpointWithoutOutput().checkpoint(norm, x)``, then
``discard_output_and_register_recompute``: the norm output's storage is freed after its consumers ran and
refilled from the recompute when the layer's output gradient arrives). Upstream crashes without TE:
``CheckpointWithoutOutput.__init__(fp8=False)`` sets ``self.fp8 = fp8 is not None`` (random.py), True for the
default, and then calls TE's ``FP8GlobalStateManager`` (NameError). ``fp4moe.model.cpu_shims.active()`` (shim 0e)
swaps in :class:`FP4CacheCheckpointWithoutOutput`, which (a) sets ``fp8`` False without TE and (b) when the checkpointed
module carries ``fp4moe_recompute_cache = 'mxfp4'`` stores the recompute cache (the norm input, the residual
stream ``[s, b, H]``) as MXFP4 rows (data ``[M, H/2]`` + UE8M0 scales ``[M, H/32]`` uint8, M = s*b) instead
of BF16 (2H bytes per token -> 17H/32), through ``fp4moe.ops.fp4_store`` (a ``saved_tensors_hooks`` context). The recompute then
runs on the dequantized input (an E2M1 rounding of x; the norm's gradient too).

``mla_up_proj`` (megatron's own, works without TE): under mxfp4 its cache (the q/kv latents and k_pos_emb)
is stored MXFP4 the same way.

``core_attn`` and ``mlp`` (dense MLPs) (megatron's own, reentrant ``tensor_parallel.checkpoint``, which keeps its
tensor arguments: q ``[s, b, n, dqk]`` / k / v ``[s, b, n, dv]``; the pre-MLP norm output ``[s, b, H]``):
``fp4moe.model.cpu_shims.active()`` also swaps in :func:`checkpoint`, which stores those arguments MXFP4 under mxfp4.

Which checkpoints store MXFP4: every one that runs while a module marked by :func:`cache_mxfp4_inside` is in its
forward, or whose checkpointed module carries the attribute itself. The layer spec marks every layer when
``Recipe.recompute_cache_fp4``: its layers are :class:`MXFP4CacheTransformerLayer` (``fp4moe.model.gpt_model.layer_spec``). Only activations are packed (``_cacheable``). Full-layer
recompute (``full``: the block checkpoints each layer's input, outside the layer's forward) keeps its cache BF16 on
purpose: its backward re-runs the router, and an E2M1-rounded layer input would pick other experts for some
tokens than the forward did (gradients then flow to experts that never saw those tokens; measured on the tiny
model: 55-60 % relative error on the router and expert weight gradients).

``moe_expert``: the routed experts' fc1 -> SwiGLU -> fc2 without re-running the dispatch (see
``fp4moe.model.recipe_moe.RecipeGroupedMLP``, and :class:`RecomputedSequentialMLP` for the bf16 recipe).

``self_attention``: the whole MLA block (q/kv down- and up-projections, their norms, RoPE, core attention, output
projection) under megatron's reentrant checkpoint, :class:`RecomputedMLASelfAttention`: it keeps only the block's
input, the input layernorm's output ``[s, b, H]`` (whose storage the ``layernorm`` module then frees and refills
before the block's backward, as megatron does for a dense ``mlp`` checkpoint; under mxfp4 an MXFP4 copy survives
instead). The reading of the paper's "attention" that orders its T1 memory cells as it does
(results/scale/paper_t1.md); megatron's ``core_attn`` is the other.
"""
from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.transformer_layer import TransformerLayer

from fp4moe_kernels.constants import MX_BLOCK

from ..ops.fp4_store import fp4_saved_tensors
from .recipe_dense import RecipeMLASelfAttention

CACHE_ATTR = "fp4moe_recompute_cache"  # 'mxfp4' on a module: its recompute cache is stored MXFP4


def _cacheable_input(t: torch.Tensor) -> bool:
    """The shape rule of an MXFP4 recompute cache: floating (bf16 / fp32), not parameters, >= 2 dims, last dim a
    multiple of 32; others (masks, 1-D routing probabilities) are kept as they are. Alone it also admits MLA's RoPE
    frequencies [s, 1, 1, rope] fp32 when rope is a multiple of 32: ``_cacheable`` (autograd's saved tensors) and
    ``FP4CacheCheckpointWithoutOutput.checkpoint`` (its inputs) add that the tensor is an activation (requires
    grad)."""
    return (t.is_floating_point() and not isinstance(t, torch.nn.Parameter) and t.dim() >= 2 and t.numel() > 0
            and t.shape[-1] % MX_BLOCK == 0 and t.dtype in (torch.bfloat16, torch.float32))


def _cacheable(t: torch.Tensor) -> bool:
    """``_cacheable_input`` for tensors autograd saves: activations only (requiring grad), not weights passed by
    reference."""
    return t.requires_grad and _cacheable_input(t)


def mxfp4_cache():
    """Context: tensors saved for backward inside it that ``_cacheable`` accepts are stored MXFP4
    (``fp4moe.ops.fp4_store``; decoded back to their dtype in backward)."""
    return fp4_saved_tensors(accept=_cacheable)


class _DecodedInputs:
    """The ``ctx`` megatron's ``CheckpointWithoutOutput._recompute`` reads: ``saved_tensors`` are the decoded MXFP4
    inputs with their ``requires_grad`` restored (so that the recompute's input gradients exist); every other
    attribute, read or written (``outputs``, ``inputs`` for the backward), is the autograd ctx's."""

    def __init__(self, ctx, requires_grad: tuple[bool, ...]):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "_requires_grad", requires_grad)

    @property
    def saved_tensors(self):
        return tuple(t.requires_grad_(rg) if isinstance(t, torch.Tensor) and rg else t
                     for t, rg in zip(self._ctx.saved_tensors, self._requires_grad))

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


class _MXFP4CheckpointWithoutOutputFunction(torch.autograd.Function):
    """megatron's ``CheckpointWithoutOutputFunction`` (random.py) for an MXFP4 cache. megatron saves
    ``detach_variable(args)``: leaves that require grad. autograd keeps a saved leaf that requires grad alive itself
    (its gradient accumulator holds it), so a pack hook's MXFP4 copy came IN ADDITION to the BF16 input: every
    norm input [s, b, H] stayed BF16 beside its cache (found in the H200 memory traces of mxfp4 attn_ln_mlp /
    attn_ln_experts). Here the inputs are saved detached and not requiring grad; ``_DecodedInputs`` restores the
    flag when the recompute reads them. The backward is megatron's."""

    @staticmethod
    def forward(ctx, run_function, checkpoint_obj, *args):
        ctx.fp8, ctx.fp8_recipe = False, None
        with torch.no_grad():
            outputs = run_function(*args)
        # packed to MXFP4 when apply() returns, by the caller's fp4_saved_tensors(accept=_cacheable_input)
        ctx.save_for_backward(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
        checkpoint_obj.ctx = _DecodedInputs(ctx, tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args))
        return outputs

    backward = staticmethod(mrandom.CheckpointWithoutOutputFunction.backward)


class FP4CacheCheckpointWithoutOutput(mrandom.CheckpointWithoutOutput):
    """megatron's ``CheckpointWithoutOutput`` with the no-TE fp8 flag fixed and an optional MXFP4 cache."""

    def __init__(self, fp8=False):
        super().__init__(fp8=fp8)
        from megatron.core.extensions import transformer_engine as mte

        self.fp8 = bool(fp8) if not mte.HAVE_TE else self.fp8

    def checkpoint(self, run_function, *args):
        if not (getattr(run_function, CACHE_ATTR, None) == "mxfp4" or _MXFP4_SCOPES) or self.fp8:
            return super().checkpoint(run_function, *args)
        # megatron's checkpoint() with the MXFP4-saving function (megatron 0.16.1, tensor_parallel/random.py)
        from megatron.core.transformer.cuda_graphs import is_graph_warmup

        if is_graph_warmup():
            return run_function(*args)
        self.run_function = run_function
        self.rng_states = mrandom._get_all_rng_states()
        # autograd packs what forward saved as apply() returns, under the hooks active then. The function saves its
        # inputs detached, so which are activations (MXFP4) is decided here: those that require grad (MLA's RoPE
        # frequencies, an input of the up-projection checkpoint, do not and stay exact)
        acts = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor) and _cacheable(a)}
        with fp4_saved_tensors(accept=lambda t: _cacheable_input(t) and t.untyped_storage().data_ptr() in acts):
            outputs = _MXFP4CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
        return outputs


_MXFP4_SCOPES: list[torch.nn.Module] = []  # modules whose forward is running with an MXFP4 recompute cache


def _enter(module, args):
    if getattr(module, CACHE_ATTR, None) == "mxfp4":
        _MXFP4_SCOPES.append(module)


def _leave(module, args, output):
    if _MXFP4_SCOPES and _MXFP4_SCOPES[-1] is module:
        _MXFP4_SCOPES.pop()


def cache_mxfp4_inside(module: torch.nn.Module) -> None:
    """Every megatron checkpoint that runs inside ``module``'s forward (output-discarding: layernorm inputs, MLA
    ``mla_up_proj`` latents ``[s, b, q_lora]`` / ``[s, b, kv_lora]`` / ``k_pos_emb``; reentrant: core_attn q/k/v, dense
    MLP input) stores its cache MXFP4 while ``module.fp4moe_recompute_cache == 'mxfp4'`` (set here; set it to None
    to switch off). A checkpoint around the module (full recompute's, around a layer) is outside it: not MXFP4."""
    setattr(module, CACHE_ATTR, "mxfp4")
    if not getattr(module, "_fp4moe_cache_hooks", False):
        module.register_forward_pre_hook(_enter)
        module.register_forward_hook(_leave, always_call=True)
        module._fp4moe_cache_hooks = True


_MEGATRON_CHECKPOINT = mrandom.checkpoint  # megatron's reentrant checkpoint (tensor_parallel/random.py)


def checkpoint(function, distribute_saved_activations, *args):
    """megatron's reentrant ``tensor_parallel.checkpoint`` (forward under no_grad, keeps ``args``, re-runs
    ``function`` in backward); inside a module marked by :func:`cache_mxfp4_inside` the kept activation
    arguments are stored MXFP4 and the re-run reads their dequantized values."""
    if _MXFP4_SCOPES:
        with mxfp4_cache():
            return _MEGATRON_CHECKPOINT(function, distribute_saved_activations, *args)
    return _MEGATRON_CHECKPOINT(function, distribute_saved_activations, *args)


class MXFP4CacheTransformerLayer(TransformerLayer):
    """megatron's ``TransformerLayer`` whose recompute caches are MXFP4 (:func:`cache_mxfp4_inside` on itself): the
    layer class of the spec when ``Recipe.recompute_cache_fp4`` (``fp4moe.model.gpt_model.layer_spec``). Needs
    ``fp4moe.model.cpu_shims.active()`` (its checkpoint functions) to store anything MXFP4.

    megatron's ``get_gpt_mtp_block_spec`` accepts a layer spec only when its module is exactly ``TransformerLayer``
    (gpt_layer_specs.py, ``spec.module == TransformerLayer``): give it the decoder block spec instead, whose last
    layer it takes (``fp4moe.model.gpt_model.mtp_block_spec`` does)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cache_mxfp4_inside(self)


class RecomputedSequentialMLP(SequentialMLP):
    """megatron's ``SequentialMLP`` run under megatron's reentrant ``tensor_parallel.checkpoint`` (the bf16
    recipe's ``moe_expert`` recompute): saves only its inputs (received tokens ``[R, H]``, counts, probs ``[R]``),
    bit-identical results."""

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        parent = super().forward

        def run(x, counts, probs):
            return parent(x, counts, probs)[0]

        y = tensor_parallel.checkpoint(run, False, permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        return y, None


class RecomputedMLASelfAttention(RecipeMLASelfAttention):
    """megatron's ``MLASelfAttention`` run under megatron's reentrant ``tensor_parallel.checkpoint`` when training
    (the ``self_attention`` recompute module): saves its input ``hidden_states`` ``[s, b, H]`` (and the mask, None
    for causal SDPA), re-runs the whole block in backward; bit-identical results. Inference runs as megatron's.
    Needs ``add_bias_linear=False`` (DeepSeek's; fp4moe.model.gpt_model refuses the module otherwise). Spec param
    ``recipe``: :class:`fp4moe.model.recipe_dense.RecipeMLASelfAttention`'s (FP8 linears under all_linears)."""

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, position_ids=None, sequence_len_offset=None, *,
                inference_params=None):
        kwargs = dict(key_value_states=key_value_states, rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                      rotary_pos_sin=rotary_pos_sin, rotary_pos_cos_sin=rotary_pos_cos_sin,
                      attention_bias=attention_bias, packed_seq_params=packed_seq_params, position_ids=position_ids,
                      sequence_len_offset=sequence_len_offset)
        if not self.training or inference_context is not None or inference_params is not None:
            return super().forward(hidden_states, attention_mask, inference_context=inference_context,
                                   inference_params=inference_params, **kwargs)
        parent = super().forward

        def run(x, mask):
            out, bias = parent(x, mask, **kwargs)
            assert bias is None, "RecomputedMLASelfAttention: the output projection returned a bias"
            return out

        return tensor_parallel.checkpoint(run, False, hidden_states, attention_mask), None


__all__ = ["FP4CacheCheckpointWithoutOutput", "MXFP4CacheTransformerLayer", "RecomputedMLASelfAttention",
           "RecomputedSequentialMLP", "cache_mxfp4_inside", "checkpoint", "mxfp4_cache", "CACHE_ATTR"]
