"""The precision recipe (fp4moe.recipe.Recipe, docs/recipe.md) inside megatron-core 0.16.1's MoE layer, no TE: a thin
adapter. megatron keeps the routing, the config and the parameters (names, shapes); every row operation is
fp4moe.moe's data path (:mod:`fp4moe.moe.dispatch`, :mod:`fp4moe.moe.experts`), the one the standalone
``fp4moe.moe.MoELayer`` runs (tests/model/test_one_moe_path.py: the same outputs and gradients, bit for bit).

What replaces what (fp8 / mxfp4 recipes; the bf16 recipe keeps megatron's modules untouched unless the kernel
switch ``bf16_moe=fp4moe`` is in force when the model is built: then the BF16 grouped expert path):

=========================  ==================================  =============================================
megatron (local spec)      ours                                what changes
=========================  ==================================  =============================================
``MoELayer``               :class:`RecipeMoELayer`             swaps in the dispatcher below; releases the
                                                              rows of each stage once the next has them,
                                                              and what the dispatcher kept, on return
``MoEAlltoAllToken-``      :class:`QuantizedAlltoAllToken-`    permutations as gathers, the EP all-to-alls
``Dispatcher``             ``Dispatcher``                      through ``quantized_all_to_all`` (dispatch.py)
``SequentialMLP``          :class:`RecipeGroupedMLP`           ``routed_experts`` (``grouped_expert_mlp``)
``SharedExpertMLP``        :class:`RecipeSharedExpertMLP`      ``shared_expert`` (``fp8_linear`` + ``swiglu``)
=========================  ==================================  =============================================

Dispatch (``token_dispatch``): the permuted tokens ``[T*k, H]`` go out as MXFP4 rows when
``recipe.dispatch_fp4`` (else BF16; under dispatch_fp4 each token is quantized once, before permutation 1, and its
k MXFP4 rows are gathered: ``quantize_gather_rows``, the same bits; ``FP4MOE_DISPATCH_QUANTIZE=rows`` quantizes
the permuted BF16 rows instead), and stay MXFP4 on the receiver (a ``DispatchedMXFP4``) when also
``recipe.expert_input_fp4``; the gradient all-to-all uses ``recipe.backward_a2a``. The routing probabilities
travel beside them in their own dtype (``dispatch_probs``). Combine (``token_combine``): BF16 forward,
``recipe.backward_a2a`` backward. Bytes: ``dispatch_stats`` / ``combine_stats`` (``A2AStats``) of the
dispatcher, summed over calls (``RecipeMoELayer.a2a_stats()``); the routed rows sent and received,
``fp4moe_rows`` (megatron's own dispatcher under bf16 gets the same counter from ``fp4moe.model.gpt_model.finish``).

Routing probabilities are applied as megatron does for its experts (megatron/core/transformer/mlp.py
``per_token_scale``): after the SwiGLU, before fc2 (``grouped_expert_mlp``'s weighted SwiGLU).

Expert weights keep megatron's ``SequentialMLP`` names and shapes, so state_dict keys do not depend on the
recipe::

    experts.local_experts.{e}.linear_fc1.weight   [2F, H]   = grouped w1[e]  (gate rows 0..F-1, up rows F..2F-1)
    experts.local_experts.{e}.linear_fc2.weight   [H, F]    = grouped w2[e]

The grouped experts read each expert's weights where it lies (``fp4moe.ops.grouped_experts``: the FP8 weight
quantizer takes one address per expert), so the parameters may sit anywhere, in particular in megatron's DDP
buffer, where the distributed optimizer moves them: no stacked copy of a layer's experts is made. Since the
experts' and the shared expert's forwards read the weights of ``linear_fc1`` / ``linear_fc2`` modules they never
call, they run those modules' forward pre-hooks first (:func:`await_parameters`): that is where megatron's DDP
waits for a parameter's all-gather under ``overlap_param_gather``.

Limits: tensor parallelism and expert tensor parallelism 1 (no TP all-gather of MXFP4 rows), no token
dropping/padding, no shared-expert overlap; ``gpt_model.py`` refuses these with a ConfigError (the dispatcher still
falls back to megatron's own row code for them).
"""
from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from ..moe.dispatch import (as_int_list, combine_rows, dispatch_probs, dispatch_rows, host_to_device,
                            local_expert_permutation, pad_probs, permutation_from_routing_map, permute_tokens,
                            reorder_rows, row_padding, unpermute_tokens)
from ..moe.experts import routed_experts, shared_expert
from ..ops.all_to_all import A2AStats, DispatchedMXFP4, dispatch_quantize_mode
from ..ops.grouped_experts import gemm_row_align
from ..recipe import Recipe

# ------------------------------------------------------------------------------------------ dispatcher


class QuantizedAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher with the recipe's wire formats (module docstring). TP = 1 only.

    megatron's code keeps the routing (routing map -> splits, ``num_global_tokens_per_local_expert``, the chunk
    orders); every row operation is fp4moe.moe.dispatch's: ``dispatch_preprocess`` / ``combine_postprocess`` are
    megatron's with permutation 1 and its inverse as gathers (``permute_tokens``, ``unpermute_tokens``) when every
    token has exactly top-k rows (dropless, no padding for quantization, no permute fusion), ``token_dispatch`` /
    ``token_combine`` are ``dispatch_rows`` / ``dispatch_probs`` / ``combine_rows``, and ``dispatch_postprocess`` /
    ``combine_preprocess`` sort the rows by local expert and back with ``reorder_rows`` through
    ``local_expert_permutation`` (megatron's ``sort_chunks_by_idxs`` only takes tensors), skipped where that is the
    identity (``skip_permutation_2``: one source rank). megatron's own code where a token may have other than k
    rows, and for drop/pad and permute fusion.

    Rows padded for the expert GEMMs (``fp4moe.moe.dispatch``, "Rows padded for the expert GEMMs"): when the experts'
    GEMMs want every expert's rows a multiple of ``row_align`` (None, the default: the GEMM backend's,
    ``gemm_row_align``; 128 under DeepGEMM), the gather before the experts writes the rows padded (zero rows, or
    MXFP4 zero codes with zero scales under ``dispatch_fp4``; probability 0): permutation 1 when EP = 1 and
    permutation 2 does not run (under dispatch_fp4 with ``FP4MOE_DISPATCH_QUANTIZE=tokens`` only: in the rows mode
    the experts pad), else permutation 2 when it runs (BF16 or received MXFP4 rows); ``dispatch_postprocess``
    returns the padded counts as ``tokens_per_expert`` and the padded rows, and ``combine_preprocess`` /
    ``combine_postprocess`` take the padded expert output back through the inverse gather. ``pad_in_dispatch =
    False`` leaves the padding to the experts (a copy each way, the same bits). megatron's MoELayer hands
    ``tokens_per_expert`` to the experts only (the router's aux losses count the routing map themselves)."""

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
        # routed rows this rank's tokens sent and its local experts received (fp4moe.model.gpt_model.a2a_stats): their
        # ratio is the routing's imbalance on this GPU. From shapes, no device sync; a recomputed forward counts again
        self.fp4moe_rows = {"sent": 0, "received": 0}
        # the expert GEMMs' row alignment (None: the backend's) and whether the dispatch's gathers pad to it
        self.row_align = None
        self.pad_in_dispatch = True
        self._fp4moe_pad1 = self._fp4moe_pad2 = None  # the RowPadding of permutation 1 / 2 in this forward

    def _row_padding(self, counts, device, permutation: int):
        """The padding of the rows grouped by local expert (``counts``) for the expert GEMMs, or None, written by
        ``permutation`` 1 or 2. Permutation 2 pads any rows (BF16, or received MXFP4); permutation 1 BF16 rows, or
        the MXFP4 rows it gathers itself under dispatch_fp4 (``FP4MOE_DISPATCH_QUANTIZE=tokens``; the rows mode
        quantizes after it: the experts pad those)."""
        if not self.pad_in_dispatch or (permutation == 1 and self.recipe.dispatch_fp4 and not self.quantize_tokens):
            return None
        align = gemm_row_align(device, self.recipe, self.row_align)
        return row_padding(counts, align, device)

    def _runs_permutation_2(self) -> bool:
        return self.num_local_experts > 1 and not self.skip_permutation_2

    def _megatron_permutation_1(self) -> bool:
        """Whether megatron's own permutation 1 runs (drop/pad, padding for quantization, permute fusion)."""
        cfg = self.config
        return bool(self.drop_and_pad or cfg.moe_router_padding_for_quantization or cfg.moe_permute_fusion)

    def _megatron_permutation_2(self) -> bool:
        """Whether megatron's own permutation 2 runs on BF16 rows (drop/pad: a reshape by capacity; permute fusion)."""
        return bool(self.drop_and_pad or self.config.moe_permute_fusion)

    def _ep_splits(self, rows: int) -> tuple[list[int], list[int]]:
        """(input_splits, output_splits) as int lists; megatron leaves them None when EP = TP = 1."""
        if self.ep_size == 1 or self.input_splits is None:
            return [rows], [rows]
        return as_int_list(self.input_splits), as_int_list(self.output_splits)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """megatron's ``dispatch_preprocess`` with permutation 1 as ``permute_tokens`` (same rows, same probs, same
        ``reversed_local_input_permutation_mapping``; under dispatch_fp4 the tokens quantized once and their MXFP4
        rows gathered); megatron's own where a token may have other than k rows."""
        self._fp4moe_perm = self._fp4moe_pad1 = self._fp4moe_pad2 = None
        if self._megatron_permutation_1():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        self.hidden_shape = hidden_states.shape
        self.probs, self.routing_map = probs, routing_map
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(self.routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        perm, sorted_indices, permuted_probs = permutation_from_routing_map(routing_map, probs,
                                                                             int(self.config.moe_router_topk))
        self.reversed_local_input_permutation_mapping = sorted_indices
        if perm is None:  # not exactly k rows per token: megatron's index_add_ path
            return hidden_states.index_select(0, sorted_indices), permuted_probs
        if self.ep_size == 1 and not self._runs_permutation_2():  # the gather before the experts: pad there
            # tokens_per_expert: the local experts' counts (EP = TP = 1); permutation_from_routing_map synced already
            rp = self._row_padding(as_int_list(self.tokens_per_expert), hidden_states.device, 1)
            if rp is not None:
                self._fp4moe_pad1 = rp
                perm, permuted_probs = perm.padded(rp), pad_probs(permuted_probs, rp)
        self._fp4moe_perm = perm
        return permute_tokens(hidden_states, perm, self.recipe, self.quantize_tokens), permuted_probs

    def combine_postprocess(self, permutated_local_input_tokens):
        """megatron's ``combine_postprocess`` with the inverse of permutation 1 as ``unpermute_tokens``."""
        perm, self._fp4moe_perm, self._fp4moe_pad1 = getattr(self, "_fp4moe_perm", None), None, None
        if perm is None:
            return super().combine_postprocess(permutated_local_input_tokens)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(permutated_local_input_tokens)
            self.shared_experts.post_forward_comm()
        output = unpermute_tokens(permutated_local_input_tokens, perm).view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        """Tokens ``[T*k, H]`` (rows grouped by destination rank; BF16, or MXFP4 rows from ``dispatch_preprocess``
        under dispatch_fp4) -> received rows ``[R, H]`` (a tensor, or a ``DispatchedMXFP4`` under dispatch_fp4 +
        expert_input_fp4) and their probs ``[R]`` (``dispatch_rows``, ``dispatch_probs``)."""
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
        ins, outs = self._ep_splits(permutated_local_input_tokens.shape[0])
        tokens = dispatch_rows(permutated_local_input_tokens, ins, outs, self.ep_group, self.recipe,
                               self.dispatch_stats)
        padding = 0 if self._fp4moe_pad1 is None else int(self._fp4moe_pad1.pad.numel())  # count the routed rows
        self.fp4moe_rows["sent"] += int(permutated_local_input_tokens.shape[0]) - padding
        self.fp4moe_rows["received"] += int(tokens.shape[0]) - padding
        return tokens, dispatch_probs(permuted_probs, ins, outs, self.ep_group, self.ep_size)

    def _local_expert_perm(self, rows: int, device, restore: bool = False) -> torch.Tensor:
        """Row order source-rank-major -> local-expert-major (megatron's permutation 2), or back with ``restore``, as
        an index tensor on ``device`` (``local_expert_permutation`` of megatron's chunk sizes and orders)."""
        sizes = torch.as_tensor(self.num_global_tokens_per_local_expert)
        if restore:
            return local_expert_permutation(sizes.T.reshape(-1), self.restore_output_by_local_experts, rows, device)
        return local_expert_permutation(sizes.reshape(-1), self.sort_input_by_local_experts, rows, device)

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        """megatron's, with permutation 2 as ``reorder_rows`` (BF16 or MXFP4 rows, and the probs), skipped where it is
        the identity (``skip_permutation_2``: megatron copies the rows then, and again in ``combine_preprocess``, two
        [R, H] copies per layer and pass on one GPU); megatron's own for BF16 rows under drop/pad or fusion."""
        mx = isinstance(global_input_tokens, DispatchedMXFP4)
        if not mx and self._megatron_permutation_2():
            return super().dispatch_postprocess(global_input_tokens, global_probs)
        if not mx and self.shared_experts is not None:  # megatron's overlapped shared expert, as in its own
            self.shared_experts.linear_fc1_forward_and_act(global_input_tokens)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_2", self.tokens_per_expert)
        if self._runs_permutation_2():
            perm = self._local_expert_perm(global_probs.shape[0], global_probs.device)
            rp = self._row_padding(as_int_list(self.tokens_per_expert), global_probs.device, 2)
            global_input_tokens = reorder_rows(global_input_tokens, perm, pad=rp)
            global_probs = reorder_rows(global_probs, perm, pad=rp)
            self._fp4moe_pad2 = rp
        tokens_per_expert = self._maybe_dtoh_and_synchronize("before_finish", self.tokens_per_expert)
        self.tokens_per_expert = None
        rp = self._fp4moe_pad1 if self._fp4moe_pad1 is not None else self._fp4moe_pad2
        if rp is not None:  # the experts' counts are the padded ones
            tokens_per_expert = host_to_device(torch.tensor(rp.padded.counts, dtype=torch.int64),
                                               getattr(tokens_per_expert, "device", "cpu"))  # queued if on a GPU
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        """megatron's un-permutation 2 as ``reorder_rows``, skipped with permutation 2 (``skip_permutation_2``)."""
        if self._megatron_permutation_2():
            return super().combine_preprocess(hidden_states)
        if not self._runs_permutation_2():
            return hidden_states  # padded as permutation 1 wrote them, if it did: combine_postprocess reads them so
        rp, self._fp4moe_pad2 = self._fp4moe_pad2, None
        rows = hidden_states.shape[0] if rp is None else int(rp.dst.numel())
        return reorder_rows(hidden_states, self._local_expert_perm(rows, hidden_states.device, restore=True), unpad=rp)

    def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        """Expert outputs ``[R, H]`` back to the token owners (``combine_rows``): BF16 forward, ``recipe.backward_a2a``
        backward."""
        ins, outs = self._ep_splits(hidden_states.shape[0])
        return combine_rows(hidden_states, outs, ins, self.ep_group, self.recipe, self.combine_stats)


# megatron's MoELayer.fwd_execution_map when one forward call runs the whole layer (route, experts, combine)
WHOLE_FORWARD = ("route", "expert_compute", "postprocess")

# megatron's token dispatchers keep these from one forward for its combine; each holds the autograd graph it came from
DISPATCHER_STEP_TENSORS = ("probs", "routing_map")
# a MoE layer attribute: when True (the default of RecipeMoELayer, and of megatron's MoELayer once
# fp4moe.model.gpt_model.finish hooked it), the layer drops its dispatcher's DISPATCHER_STEP_TENSORS as its forward returns
RELEASES_DISPATCHER = "fp4moe_releases_dispatcher"


def drop_step_tensors(dispatcher) -> int:
    """Set the ``DISPATCHER_STEP_TENSORS`` a token dispatcher holds to None; returns how many it held."""
    n = 0
    for name in DISPATCHER_STEP_TENSORS:
        if getattr(dispatcher, name, None) is not None:
            setattr(dispatcher, name, None)
            n += 1
    return n


def release_after_forward(layer, intermediate_tensors) -> None:
    """At the end of a MoE layer's forward: its combine has run, so what its dispatcher kept for it is dead (unless
    the layer's ``RELEASES_DISPATCHER`` is False). Under full recompute the forward that sets them last is the
    recomputation inside the backward: kept, the probabilities held that graph (the layer's detached input and its
    gradient, [seq, micro, hidden] each) until the step's backward had passed, so every MoE layer already
    differentiated kept two such tensors while the layers before it ran theirs (0.75 GiB at the H200 proxy's first
    MoE layer at micro-batch 16: results/train_proxy/memtrace_h200_mb16_e431a41/). A partial forward (CUDA-graph
    capture with intermediate tensors, or an execution map other than the whole layer) keeps them for the calls that
    follow."""
    if (getattr(layer, RELEASES_DISPATCHER, False) and intermediate_tensors is None
            and tuple(getattr(layer, "fwd_execution_map", WHOLE_FORWARD)) == WHOLE_FORWARD):
        drop_step_tensors(layer.token_dispatcher)


class RecipeMoELayer(MoELayer):
    """megatron's ``MoELayer`` with :class:`QuantizedAlltoAllTokenDispatcher` (spec param ``recipe``); drops what the
    dispatcher kept when its forward returns (:func:`release_after_forward`)."""

    fp4moe_releases_dispatcher = True  # RELEASES_DISPATCHER

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
        release_after_forward(self, intermediate_tensors)
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


def await_parameters(modules) -> None:
    """Run the forward pre-hooks of ``modules`` (in the given order), whose parameters a parent's forward reads
    without calling them. megatron-core's DDP with ``overlap_param_gather`` (the distributed optimizer's updated
    shards all-gathered during the next forward) waits for a parameter's all-gather, and dispatches the next
    bucket's, in a forward pre-hook of the module that owns the parameter (``recurse=False``). The grouped experts
    read ``local_experts.{e}.linear_fc1/fc2.weight`` and the shared expert its ``linear_fc1/fc2.weight`` without
    calling those linears: without this they would compute with the previous step's weights and leave the
    all-gather in flight (megatron asserts at the next step's dispatch). Pre-hooks get empty positional arguments
    (and keyword arguments where registered ``with_kwargs``); a module without hooks costs a dict lookup."""
    for m in modules:
        hooks = m._forward_pre_hooks
        if not hooks:
            continue
        with_kwargs = m._forward_pre_hooks_with_kwargs
        for hook_id, hook in list(hooks.items()):
            if hook_id in with_kwargs:
                hook(m, (), {})
            else:
                hook(m, ())


class RecipeGroupedMLP(SequentialMLP):
    """megatron's ``SequentialMLP`` parameters (``local_experts.{e}.linear_fc1/fc2.weight``) computed by
    ``fp4moe.moe.experts.routed_experts`` under ``recipe`` (spec params ``recipe``, ``recompute``).

    forward(x ``[R, H]`` tensor or ``DispatchedMXFP4``, tokens_per_expert ``[E_local]`` int, probs ``[R]``)
    -> (``[R, H]`` bf16, None). ``recompute=True``: the experts' recompute (``_ExpertRecompute``; cache stored
    MXFP4 under the mxfp4 recipe; the forward is unchanged; under ``torch.no_grad`` the plain forward).
    ``row_align`` (attribute, None: the GEMM backend's): ``grouped_expert_mlp``'s; the dispatcher's padded rows
    (``QuantizedAlltoAllTokenDispatcher.row_align``, the same value) come with counts it need not pad."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, *, recipe: Recipe,
                 recompute: bool = False):
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        if config.add_bias_linear or not config.gated_linear_unit:
            raise ValueError("RecipeGroupedMLP needs SwiGLU experts without biases")
        self.recipe = recipe
        self.recompute = recompute
        self.row_align = None

    def grouped_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(the E fc1 weights ``[2F, H]``, the E fc2 weights ``[H, F]``) of the local experts, in expert order:
        the parameters themselves, which the grouped GEMMs read where they lie."""
        return ([e.linear_fc1.weight for e in self.local_experts], [e.linear_fc2.weight for e in self.local_experts])

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        await_parameters(m for e in self.local_experts for m in (e.linear_fc1, e.linear_fc2))
        w1, w2 = self.grouped_weights()
        y = routed_experts(permuted_local_hidden_states, as_int_list(tokens_per_expert), w1, w2,
                           permuted_probs.float(), self.recipe, self.recompute, row_align=self.row_align)
        return y, None


# ------------------------------------------------------------------------------------------ shared expert


class RecipeSharedExpertMLP(SharedExpertMLP):
    """megatron's ``SharedExpertMLP`` parameters (``linear_fc1.weight [2Fs, H]``, ``linear_fc2.weight [H, Fs]``)
    computed by ``fp4moe.moe.experts.shared_expert`` (the standalone MoE layer's): ``fp8_linear`` (layer_kind
    'shared_expert') -> ``swiglu`` (input stored MXFP4 under activation_fp4_store) -> ``fp8_linear``.
    x ``[s, b, H]`` -> ``[s, b, H]`` bf16."""

    def __init__(self, config, submodules, gate: bool, pg_collection=None, *, recipe: Recipe):
        super().__init__(config, submodules, gate=gate, pg_collection=pg_collection)
        if gate or config.add_bias_linear or not config.gated_linear_unit:
            raise ValueError("RecipeSharedExpertMLP needs an ungated SwiGLU shared expert without biases")
        self.recipe = recipe

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        await_parameters((self.linear_fc1, self.linear_fc2))
        lead, h = hidden_states.shape[:-1], hidden_states.shape[-1]
        y = shared_expert(hidden_states.reshape(-1, h), self.linear_fc1.weight, self.linear_fc2.weight, self.recipe)
        return y.reshape(*lead, y.shape[-1])


__all__ = ["await_parameters", "QuantizedAlltoAllTokenDispatcher", "RecipeMoELayer", "RecipeGroupedMLP",
           "RecipeSharedExpertMLP", "WHOLE_FORWARD", "DISPATCHER_STEP_TENSORS", "RELEASES_DISPATCHER",
           "drop_step_tensors", "release_after_forward"]
