"""The precision recipe (fp4moe.recipe.Recipe, SPEC §4) inside megatron-core 0.16.1's MoE layer, no TE.

What replaces what (fp8 / mxfp4 recipes; the bf16 recipe keeps megatron's modules untouched):

=========================  ==================================  =============================================
megatron (local spec)      ours                                what changes
=========================  ==================================  =============================================
``MoELayer``               :class:`RecipeMoELayer`             swaps in the dispatcher below; releases the
                                                              rows of each stage once the next has them
``MoEAlltoAllToken-``      :class:`QuantizedAlltoAllToken-`    the two EP all-to-alls go through
``Dispatcher``             ``Dispatcher``                      ``fp4moe.ops.all_to_all.quantized_all_to_all``
``SequentialMLP``          :class:`RecipeGroupedMLP`           ``grouped_expert_mlp`` over all local experts
``SharedExpertMLP``        :class:`RecipeSharedExpertMLP`      ``fp8_linear`` + ``swiglu`` (recipe storage)
=========================  ==================================  =============================================

Dispatch (``token_dispatch``): the permuted tokens ``[T*k, H]`` go out as MXFP4 rows when
``recipe.dispatch_fp4`` (else BF16; under dispatch_fp4 each token is quantized once, before permutation 1, and its
k MXFP4 rows are gathered: ``quantize_gather_rows``, the same bits; ``FP4MOE_DISPATCH_QUANTIZE=rows`` quantizes
the permuted BF16 rows instead), and stay MXFP4 on the receiver (a ``DispatchedMXFP4``) when also
``recipe.expert_input_fp4``; the gradient all-to-all uses ``recipe.backward_a2a``. The routing probabilities
travel with megatron's own (float32) all-to-all. Combine (``token_combine``): BF16 forward,
``recipe.backward_a2a`` backward. Bytes: ``dispatch_stats`` / ``combine_stats`` (``A2AStats``) of the
dispatcher, summed over calls (``RecipeMoELayer.a2a_stats()``).

Routing probabilities are applied as megatron does for its experts (megatron/core/transformer/mlp.py
``per_token_scale``): after the SwiGLU, before fc2 (``grouped_expert_mlp``'s weighted SwiGLU).

Expert weights keep megatron's ``SequentialMLP`` names and shapes, so state_dict keys do not depend on the
recipe::

    experts.local_experts.{e}.linear_fc1.weight   [2F, H]   = grouped w1[e]  (gate rows 0..F-1, up rows F..2F-1)
    experts.local_experts.{e}.linear_fc2.weight   [H, F]    = grouped w2[e]

The grouped experts read each expert's weights where it lies (``fp4moe.ops.grouped_experts``: the FP8 weight
quantizer takes one address per expert), so the parameters may sit anywhere, in particular in megatron's DDP
buffer, where the distributed optimizer moves them: no stacked copy of a layer's experts is made.

Limits: tensor parallelism and expert tensor parallelism 1 (no TP all-gather of MXFP4 rows), no token
dropping/padding, no shared-expert overlap; ``build.py`` refuses these with a ConfigError.
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from fp4moe_kernels import ops as kops
from fp4moe_kernels.formats import MXFP4Tensor, host_to_device

from ..ops.all_to_all import (A2AStats, DispatchedMXFP4, dispatch_quantize_mode, permute_rows, quantize_gather_rows,
                              quantized_all_to_all, sum_rows_by_token)
from ..ops.fp8_linear import fp8_linear
from ..ops.grouped_experts import grouped_expert_mlp
from ..ops.swiglu import swiglu
from ..recipe import Recipe

_BF16 = torch.bfloat16


# ------------------------------------------------------------------------------------------ row helpers


def _splits(t) -> list[int]:
    return [int(v) for v in (t.tolist() if hasattr(t, "tolist") else t)]


def local_expert_permutation(sizes: torch.Tensor, order: torch.Tensor, rows: int, device) -> torch.Tensor:
    """Megatron's permutation 2 as a gather index: the rows arrive as ``C`` chunks of ``sizes[c]`` rows (source
    rank major, local expert minor) and leave in chunk order ``order`` (local expert major). Returns ``perm``
    ``[rows]`` int64 on ``device`` with ``out = rows_in[perm]``. Built with device ops from the ``C`` chunk sizes
    (no per-chunk host loop, no ``rows``-long host tensor); ``rows`` = ``sizes.sum()`` is passed in so that nothing
    waits on the device."""
    sizes, order = (host_to_device(t.to(torch.int64), device) for t in (sizes, order))
    starts = torch.cumsum(sizes, 0) - sizes                 # where each chunk begins in the input
    out_sizes, out_starts = sizes[order], starts[order]
    out_offsets = torch.cumsum(out_sizes, 0) - out_sizes     # where each chunk begins in the output
    chunk = torch.repeat_interleave(torch.arange(order.numel(), device=device), out_sizes, output_size=rows)
    return torch.arange(rows, device=device) + (out_starts - out_offsets)[chunk]


# ------------------------------------------------------------------------------------------ permutation 1


class _PermuteTokens(torch.autograd.Function):
    """tokens ``[T, H]`` -> rows ``[T*k, H]`` = ``tokens[sorted_indices]`` (megatron's permutation 1 under dropless
    top-k: every token has exactly k rows). Backward: each token's k row gradients gathered through ``order`` (the
    rows grouped by token) and summed in float32, instead of autograd's ``index_add_`` with atomics (an H200 profile
    measured megatron's permute/unpermute atomics at ~6 % of an mxfp4 step)."""

    @staticmethod
    def forward(ctx, tokens, sorted_indices, order, k: int):
        ctx.save_for_backward(order)
        ctx.k, ctx.shape = k, tuple(tokens.shape)
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx, g):
        (order,) = ctx.saved_tensors
        return sum_rows_by_token(g, order, ctx.shape[0], ctx.k), None, None, None


class _UnpermuteTokens(torch.autograd.Function):
    """rows ``[T*k, H]`` -> tokens ``[T, H]``: each token's k rows summed in float32 and rounded once (megatron's
    unpermute 1 without probs, which scatter-adds in the rows' dtype). Backward: a gather, ``g[sorted_indices]``."""

    @staticmethod
    def forward(ctx, rows, sorted_indices, order, k: int, t: int):
        ctx.save_for_backward(sorted_indices)
        return sum_rows_by_token(rows, order, t, k)

    @staticmethod
    def backward(ctx, g):
        (sorted_indices,) = ctx.saved_tensors
        return g.index_select(0, sorted_indices), None, None, None, None


# ------------------------------------------------------------------------------------------ dispatcher


class QuantizedAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher with the recipe's wire formats (module docstring). TP = 1 only.

    Everything else (routing map -> splits, the probs all-to-all, chunk sort by local expert) is megatron's code;
    ``token_dispatch`` and ``token_combine`` swap the EP all-to-all of the tokens, ``dispatch_postprocess`` sorts
    MXFP4 rows by local expert (megatron's ``sort_chunks_by_idxs`` only takes tensors) and, with
    ``combine_preprocess``, skips that sort where it is the identity (one source rank), and ``dispatch_preprocess``
    / ``combine_postprocess`` are megatron's with permutation 1 and its inverse as gathers
    (:class:`_PermuteTokens`, :class:`_UnpermuteTokens`) when every token has exactly top-k rows (dropless, no
    padding for quantization, no permute fusion); otherwise megatron's own."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None, *, recipe: Recipe):
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        if self.tp_size != 1:
            raise ValueError("QuantizedAlltoAllTokenDispatcher needs expert tensor parallel size 1")
        self.recipe = recipe
        # FP4MOE_DISPATCH_QUANTIZE: under dispatch_fp4, quantize tokens before permutation 1 (default) or the rows
        self.quantize_tokens = dispatch_quantize_mode() == "tokens"
        self.dispatch_stats = A2AStats()
        self.combine_stats = A2AStats()
        # megatron's permutation 2 (rows source-rank-major -> local-expert-major) and its inverse copy the rows in
        # the same order when there is one source rank (EP = TP = 1): skip both. Fixed by the layout at build time.
        order = torch.as_tensor(self.sort_input_by_local_experts).reshape(-1)
        self.skip_permutation_2 = (self.num_local_experts > 1 and not self.drop_and_pad
                                   and bool((order.cpu() == torch.arange(order.numel())).all()))

    def _ep_splits(self, rows: int) -> tuple[list[int], list[int]]:
        """(input_splits, output_splits) as int lists; megatron leaves them None when EP = TP = 1."""
        if self.ep_size == 1 or self.input_splits is None:
            return [rows], [rows]
        return _splits(self.input_splits), _splits(self.output_splits)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """megatron's ``dispatch_preprocess`` with permutation 1 as :class:`_PermuteTokens` (same rows, same probs,
        same ``reversed_local_input_permutation_mapping``); megatron's own where a token may have other than k rows."""
        self._fp4moe_perm = None
        cfg = self.config
        if self.drop_and_pad or cfg.moe_router_padding_for_quantization or cfg.moe_permute_fusion:
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(self.routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        t, k = hidden_states.shape[0], int(cfg.moe_router_topk)
        mask = routing_map.bool().T.contiguous()  # [E, T], expert-major as megatron's permute
        sorted_indices = torch.arange(t, device=mask.device).unsqueeze(0).expand(mask.shape[0], -1).masked_select(mask)
        permuted_probs = probs.T.contiguous().masked_select(mask)
        self.reversed_local_input_permutation_mapping = sorted_indices
        if sorted_indices.numel() != t * k:  # not exactly k rows per token: megatron's index_add_ path
            return hidden_states.index_select(0, sorted_indices), permuted_probs
        order = torch.argsort(sorted_indices, stable=True)  # rows grouped by token, experts ascending within
        self._fp4moe_perm = (order, k, t)
        if self.recipe.dispatch_fp4 and self.quantize_tokens:
            # MXFP4 is per row: quantize the T tokens once and gather their MXFP4 rows (the same bits as quantizing
            # the T*k BF16 rows; k times fewer rows to quantize, a quarter of the bytes to permute)
            rows = quantize_gather_rows(hidden_states, sorted_indices, self.recipe.scale_rule, order=order, k=k)
            return rows, permuted_probs
        return _PermuteTokens.apply(hidden_states, sorted_indices, order, k), permuted_probs

    def combine_postprocess(self, permutated_local_input_tokens):
        """megatron's ``combine_postprocess`` with the inverse of permutation 1 as :class:`_UnpermuteTokens`."""
        perm, self._fp4moe_perm = getattr(self, "_fp4moe_perm", None), None
        if perm is None:
            return super().combine_postprocess(permutated_local_input_tokens)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(permutated_local_input_tokens)
            self.shared_experts.post_forward_comm()
        order, k, t = perm
        output = _UnpermuteTokens.apply(permutated_local_input_tokens, self.reversed_local_input_permutation_mapping,
                                        order, k, t).view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        """Tokens ``[T*k, H]`` (rows grouped by destination rank; BF16, or MXFP4 rows from ``dispatch_preprocess``
        under dispatch_fp4) -> received rows ``[R, H]`` (a tensor, or a ``DispatchedMXFP4`` under dispatch_fp4 +
        expert_input_fp4) and their float32 probs ``[R]``."""
        from megatron.core.tensor_parallel import all_to_all

        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
        r = self.recipe
        ins, outs = self._ep_splits(permutated_local_input_tokens.shape[0])
        tokens = quantized_all_to_all(
            permutated_local_input_tokens, ins, outs, self.ep_group, "mxfp4" if r.dispatch_fp4 else "bf16",
            r.backward_a2a, keep_fp4=r.dispatch_fp4 and r.expert_input_fp4, stats=self.dispatch_stats,
            rule=r.scale_rule)
        if self.ep_size > 1:
            permuted_probs = all_to_all(self.ep_group, permuted_probs, outs, ins)
        return tokens, permuted_probs

    def _local_expert_perm(self, rows: int, device) -> torch.Tensor:
        """Row order source-rank-major -> local-expert-major (megatron's permutation 2), as an index tensor on
        ``device``."""
        return local_expert_permutation(torch.as_tensor(self.num_global_tokens_per_local_expert).reshape(-1),
                                        torch.as_tensor(self.sort_input_by_local_experts).reshape(-1), rows, device)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """megatron's, except that permutation 2 is skipped where it is the identity (``skip_permutation_2``:
        megatron copies the rows then, and again in ``combine_preprocess``, two [R, H] copies per layer and pass on
        one GPU) and that MXFP4 rows are sorted by ``permute_rows`` (megatron's ``sort_chunks_by_idxs`` only takes
        tensors)."""
        mx = isinstance(global_input_tokens, DispatchedMXFP4)
        if not mx and not self.skip_permutation_2:
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        if not mx and self.shared_experts is not None:  # megatron's overlapped shared expert, as in its own
            self.shared_experts.linear_fc1_forward_and_act(global_input_tokens)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_2", self.tokens_per_expert)
        if self.num_local_experts > 1 and not self.skip_permutation_2:
            perm = self._local_expert_perm(global_probs.shape[0], global_probs.device)
            global_input_tokens = permute_rows(global_input_tokens, perm)
            global_probs = global_probs.index_select(0, perm)
        tokens_per_expert = self._maybe_dtoh_and_synchronize("before_finish", self.tokens_per_expert)
        self.tokens_per_expert = None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        """megatron's un-permutation 2, skipped with permutation 2 (``skip_permutation_2``)."""
        return hidden_states if self.skip_permutation_2 else super().combine_preprocess(hidden_states)

    def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        """Expert outputs ``[R, H]`` back to the token owners: BF16 forward, ``recipe.backward_a2a`` backward."""
        ins, outs = self._ep_splits(hidden_states.shape[0])
        return quantized_all_to_all(hidden_states, outs, ins, self.ep_group, "bf16", self.recipe.backward_a2a,
                                    stats=self.combine_stats)


# megatron's MoELayer.fwd_execution_map when one forward call runs the whole layer (route, experts, combine)
WHOLE_FORWARD = ("route", "expert_compute", "postprocess")


class RecipeMoELayer(MoELayer):
    """megatron's ``MoELayer`` with :class:`QuantizedAlltoAllTokenDispatcher` (spec param ``recipe``)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, *, recipe: Recipe):
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        self.recipe = recipe
        pg = pg_collection
        if pg is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg = get_default_pg_collection()
        self.token_dispatcher = QuantizedAlltoAllTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=self.config, pg_collection=pg, recipe=recipe)

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        """megatron's route -> dispatch -> experts -> combine, with each stage's input released as soon as the next
        stage has consumed it (:meth:`_forward_releasing`); megatron's own ``forward`` for what that does not cover
        (partial CUDA-graph capture with intermediate tensors, MoE-layer recompute, a changed execution map). The
        output is cast back to ``hidden_states.dtype`` (the recipe's ops return BF16, and an fp32-parameter model
        must get fp32 back, as from megatron's own experts)."""
        own = (intermediate_tensors is None and not self.moe_layer_recompute
               and tuple(self.fwd_execution_map) == WHOLE_FORWARD)
        out = (self._forward_releasing(hidden_states, padding_mask) if own
               else super().forward(hidden_states, intermediate_tensors, padding_mask))
        if intermediate_tensors is None and isinstance(out, tuple) and isinstance(out[0], torch.Tensor):
            return (out[0].to(hidden_states.dtype), *out[1:])
        return out

    def _forward_releasing(self, hidden_states, padding_mask=None):
        """megatron's ``MoELayer.forward`` body (moe_layer.py, custom_forward) with the same calls in the same order,
        but its locals do not outlive their use: megatron keeps permutation 1's rows and the dispatched rows
        referenced until the layer returns, so both stayed allocated through the experts and the combine ([R, H]
        each, live at fp8's forward memory peak on the H200). Neither is needed by a backward: the permutation keeps
        its index, the all-to-all its splits, the experts their own (quantized) copies."""
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()  # [bsz, seq] -> [seq, bsz], as megatron
        shared_expert_output = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        rows, probs = self.preprocess(hidden_states, probs, routing_map)
        del routing_map
        rows, probs = self.dispatch(rows, probs)  # rebinding releases permutation 1's rows
        output, mlp_bias = self.routed_experts_compute(rows, probs)
        del rows, probs
        output = self.combine(output)
        return self.postprocess(output, shared_expert_output), mlp_bias

    def a2a_stats(self) -> dict[str, int]:
        """Payload bytes of this layer's all-to-alls so far: ``dispatch_*`` and ``combine_*`` (A2AStats fields)."""
        d = self.token_dispatcher
        out = {f"dispatch_{k}": v for k, v in d.dispatch_stats.as_dict().items()}
        out.update({f"combine_{k}": v for k, v in d.combine_stats.as_dict().items()})
        return out


# ------------------------------------------------------------------------------------------ experts


class _ExpertRecompute(torch.autograd.Function):
    """Recompute of the routed experts (fp4moe recompute module ``moe_expert``): forward runs
    ``grouped_expert_mlp`` without saving anything but its inputs (the *recompute cache*: the received rows,
    the probs, the weights by reference), backward runs it again with autograd and back-propagates. No
    dispatch re-run. Cache modes (``mode``):

    ``'fp4'``       rows arrived MXFP4 (``DispatchedMXFP4``): x is the stride-0 anchor; data + scales are cached.
    ``'bf16'``      rows are BF16 and cached as they are (bf16 / fp8 recipes): recompute is bit-exact.
    ``'bf16_fp4'``  rows are BF16 (mxfp4 recipe without dispatch_fp4/expert_input_fp4): the forward uses x, the
                    cache is MXFP4 of x (data + scales) and the backward recomputes from its dequantized rows.

    Inputs: (x, data, scales, probs, counts, recipe, mode, *weights): the E fc1 then the E fc2 weights."""

    @staticmethod
    def forward(ctx, x, data, scales, probs, counts, recipe, mode, *weights):
        ctx.meta = (counts, recipe, mode, x.dtype, tuple(x.shape))
        n = len(counts)
        xin = DispatchedMXFP4(data, scales, tuple(x.shape), x) if mode == "fp4" else x
        with torch.no_grad():
            y = grouped_expert_mlp(xin, counts, weights[:n], weights[n:], probs, recipe)
        cache = (x,) if mode == "bf16" else (data, scales)
        ctx.save_for_backward(*cache, probs, *weights)  # the weights by reference
        return y

    @staticmethod
    def backward(ctx, dy):
        counts, recipe, mode, x_dtype, x_shape = ctx.meta
        n = len(counts)
        data = scales = None
        saved = ctx.saved_tensors
        if mode == "bf16":
            (x, probs), weights = saved[:2], saved[2:]
        else:
            (data, scales, probs), weights = saved[:3], saved[3:]
            if mode == "fp4":
                x = torch.zeros((), dtype=x_dtype, device=data.device).expand(x_shape)
            else:
                x = kops.fp4_to_bf16(MXFP4Tensor(data, scales, x_shape)).to(x_dtype)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[3], *ctx.needs_input_grad[7:])
        ins = [t.detach().requires_grad_(need) for t, need in zip((x, probs, *weights), needs)]
        with torch.enable_grad():
            xin = DispatchedMXFP4(data, scales, x_shape, ins[0]) if mode == "fp4" else ins[0]
            y = grouped_expert_mlp(xin, counts, ins[2:2 + n], ins[2 + n:], ins[1], recipe)
        need = [t for t in ins if t.requires_grad]
        grads = iter(torch.autograd.grad(y, need, dy, allow_unused=True) if need else ())
        gx, gp, *gws = (next(grads) if t.requires_grad else None for t in ins)
        return (gx, None, None, gp, None, None, None, *gws)


class RecipeGroupedMLP(SequentialMLP):
    """megatron's ``SequentialMLP`` parameters (``local_experts.{e}.linear_fc1/fc2.weight``) computed by
    ``grouped_expert_mlp`` under ``recipe`` (spec params ``recipe``, ``recompute``).

    forward(x ``[R, H]`` tensor or ``DispatchedMXFP4``, tokens_per_expert ``[E_local]`` int, probs ``[R]``
    float32) -> (``[R, H]`` bf16, None). ``recompute=True``: :class:`_ExpertRecompute` (cache stored MXFP4
    under the mxfp4 recipe; the forward is unchanged; under ``torch.no_grad`` the plain forward)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, *, recipe: Recipe,
                 recompute: bool = False):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        if config.add_bias_linear or not config.gated_linear_unit:
            raise ValueError("RecipeGroupedMLP needs SwiGLU experts without biases")
        self.recipe = recipe
        self.recompute = recompute

    def grouped_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the E fc1 weights ``[2F, H]``, the E fc2 weights ``[H, F]``) of the local experts, in expert order:
        the parameters themselves, which the grouped GEMMs read where they lie."""
        return ([e.linear_fc1.weight for e in self.local_experts], [e.linear_fc2.weight for e in self.local_experts])

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        counts = _splits(tokens_per_expert)
        w1, w2 = self.grouped_weights()
        probs = permuted_probs.float()
        if not self.recompute or not torch.is_grad_enabled():
            # no backward to come (evaluation): nothing to cache, and under no_grad a DispatchedMXFP4 has no anchor
            return grouped_expert_mlp(x, counts, w1, w2, probs, self.recipe), None
        r = self.recipe
        if isinstance(x, DispatchedMXFP4):
            anchor = x.grad_anchor
            if anchor is None:  # the sender's rows need no gradient: a stride-0 stand-in carries dtype and shape
                anchor = torch.zeros((), dtype=_BF16, device=x.data.device).expand(x.shape)
            y = _ExpertRecompute.apply(anchor, x.data, x.scales, probs, counts, r, "fp4", *w1, *w2)
        elif r.name == "mxfp4":  # cache as MXFP4 (_ExpertRecompute 'bf16_fp4')
            q = kops.bf16_to_fp4_row(x.detach().to(_BF16), r.scale_rule)
            y = _ExpertRecompute.apply(x, q.data, q.scales, probs, counts, r, "bf16_fp4", *w1, *w2)
        else:
            y = _ExpertRecompute.apply(x, None, None, probs, counts, r, "bf16", *w1, *w2)
        return y, None


# ------------------------------------------------------------------------------------------ shared expert


class RecipeSharedExpertMLP(SharedExpertMLP):
    """megatron's ``SharedExpertMLP`` parameters (``linear_fc1.weight [2Fs, H]``, ``linear_fc2.weight [H, Fs]``)
    computed as fp4moe's standalone MoE layer does: ``fp8_linear`` (layer_kind 'shared_expert') -> ``swiglu``
    (input stored MXFP4 under activation_fp4_store) -> ``fp8_linear``. x ``[s, b, H]`` -> ``[s, b, H]`` bf16."""

    def __init__(self, config, submodules, gate: bool, pg_collection=None, *, recipe: Recipe):
        super().__init__(config, submodules, gate=gate, pg_collection=pg_collection)
        if gate or config.add_bias_linear or not config.gated_linear_unit:
            raise ValueError("RecipeSharedExpertMLP needs an ungated SwiGLU shared expert without biases")
        self.recipe = recipe

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        lead, h = hidden_states.shape[:-1], hidden_states.shape[-1]
        x2 = hidden_states.reshape(-1, h)
        r = self.recipe
        hmat = fp8_linear(x2, self.linear_fc1.weight, r, layer_kind="shared_expert").to(_BF16)
        z = swiglu(hmat, r, "shared_expert")
        y = fp8_linear(z, self.linear_fc2.weight, r, layer_kind="shared_expert")
        return y.reshape(*lead, y.shape[-1])


__all__ = ["local_expert_permutation", "QuantizedAlltoAllTokenDispatcher", "RecipeMoELayer", "RecipeGroupedMLP", "RecipeSharedExpertMLP",
           "permute_rows"]
