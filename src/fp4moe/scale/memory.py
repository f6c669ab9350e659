"""Per-GPU memory of a megatron-core DeepSeek-V3-style training run, from first principles (issue 6, P5).

Every term below is a tensor shape times bytes per element, an optimizer byte count per parameter, or a count of
micro-batches in flight; nothing is fitted. Checked against the measured H200 proxy runs by
``fp4moe.analysis.calibration`` (results/scale/calibration.md): the saved activations (b) agree with the measured
``saved_activation_bytes_per_micro_batch`` to 76 B (bf16, mxfp4) or 0.004 % (fp8: real routing's expert padding) in
every leak-free run, every recipe x recompute scope x micro-batch. The PEAK is static + saved + the largest of three
phase transients (e): the head's, the last MoE layer's forward and its routed experts' backward, each from tensor
shapes; calibration.md says in which cells it is within 5 % and what the others miss. What nvidia-smi shows beyond
that (CUDA context, NCCL and DeepEP buffers, the allocator's gap) is part (f), measured terms.
No torch import: configs and arithmetic only.

Units: bytes internally; ``Breakdown.gb(component)`` and ``total_gb`` are GB = 2**30 bytes (GiB, as torch memory reports are usually read;
an "80 GB" H100/H800 has 80 GiB of HBM). Whether the paper's "% of 80 GB" uses 10**9 or 2**30 is not known.

(a) Parameters, gradients, optimizer state (megatron-core's DDP and optimizer, the config's ``optimizer`` group)
-----------------------------------------------------------------------------------------------------------------
Exactly as megatron-core 0.16.1 lays them out on one rank: ``fp4moe.scale.optimizer_state.rank_bytes`` for every
model chunk of the rank, from the config's ``optimizer`` group (``fp4moe.config.OptimizerSetting``; a config from
before that group, the archived runs' params, falls back to ``parallel.distributed_optimizer`` with FP32 grads):

    parameters     BF16 (``train.params_dtype``), in the distributed optimizer's padded parameter buffer
    gradients      the DDP gradient buffer, FP32 or BF16 (``main_grads_dtype``), full size on every rank
    optimizer      FP32 main params + Adam m, v of the elements the rank owns (its 1/d of every bucket with the
                   distributed optimizer, d = DP x CP for dense parameters, expert-DP for routed experts under EP),
                   + the FP32 gradient copy of megatron's HybridDeviceOptimizer with BF16 main grads (16 B per
                   owned element instead of 12); the offloaded share lives in host memory (``optimizer_host``, not
                   in the GPU total)

    FP8 weight copies  with ``train.fp8_weight_cache`` (fp4moe.ops.weight_cache) or Transformer Engine's weight
                   workspaces (``MemoryAssumptions.fp8_weight_workspaces``, the lab's stack): every FP8-computed
                   [N, K] weight's 128x128 copies for fprop and dgrad, ``2 N K + 8 N K / 128^2`` B, held from the
                   first forward of a step to the next step (``fp8_weight_cache``); 0 without either

The distributed optimizer gives the data-parallel ranks of a stage slightly different shares (bucket padding):
each pipeline rank's Breakdown is its most loaded data-parallel rank's, ``optimizer_mean_bytes`` the mean over its
data-parallel ranks (``mean_total_bytes``). ``MemoryAssumptions.main_grad_resident='after_first_micro_batch'``
describes the trainer before megatron's DDP (the archived H200 runs): its FP32 gradient accumulators existed only
once a step had finished its first micro-batch.

Parameters of a pipeline stage: the letters of ``parallel.pipeline_layout`` (``config.parse_pipeline_layout``:
E embedding, t transformer layer, m MTP layer, L final norm + output head + loss), else num_layers / PP
contiguous layers with E on the first and m, L on the last stage. Transformer layer i < moe.first_k_dense is a
dense layer (MLA + SwiGLU MLP), the others MoE (MLA + router + E/EP routed experts + shared experts). An 'm'
stage also holds a copy of the embedding (megatron-core's MTP needs it on the last stage). Dense matrices are
divided by TP, norms and the router replicated, expert matrices divided by ETP (exact for TP = ETP = 1, the
paper's likely layout; approximate otherwise: megatron duplicates some MLA down-projections over TP).

(b) Activations saved for backward, one micro-batch, tensor by tensor
---------------------------------------------------------------------
T = micro_batch x seq_length / CP tokens on the GPU (/ TP as well for hidden-size tensors with sequence
parallelism); R = T x topk rows reach the experts of a GPU (balanced routing: each GPU sends T x k rows and, on
average, receives as many). Per element: bf16 2 B, fp32 4 B, int64 8 B; a GEMM input saved by an FP8 linear
as FP8 rows + FP8 columns (Float8BlockScaling's 1x128 groups, our ``fp8_linear``) costs
``M K + 4 M K/128 + K Mp + 4 K Mp/128`` (~2.06 B/elem; Mp = rows padded to 128 per expert); the columns alone
(Transformer Engine, ``MemoryAssumptions.fp8_saves_columnwise``) ``K M + 4 K Mp/128`` (~1.03 B/elem); saved as
MXFP4 (``save_fp4``) ``M K/2 + M K/32`` (0.53 B/elem). These are the formulas of ``fp4moe.ops.fp8_linear
.linear_saved_bytes``, ``fp4moe.ops.grouped_experts.expert_saved_bytes`` (checked equal in the tests).

A tensor held by several consumers is counted once (a ledger of holders; a recompute scope removes holders or
frees storage). What a layer saves without recompute (names as in ``layer_saved_tensors``):

MLA attention (both layer kinds)
    attn.ln_in        [T,H] bf16        input_layernorm input (the residual stream)
    attn.ln_rstd      [T] fp32          RMSNorm 1/rms
    attn.ln_out       [T,H] bf16        input of q_down / kv_down (held by BF16 linears)
    attn.q_latent     [T,q_lora] bf16   q_layernorm input (q_down output)      (no q_lora: absent)
    attn.q_ln_out     [T,q_lora] bf16   q_up input
    attn.kv_latent    [T,kv_lora+rope]  kv_down output (kv_layernorm input and the shared RoPE key)
    attn.kv_ln_out    [T,kv_lora] bf16  kv_up input
    attn.q / k / v    [T,n,192/192/128] core-attention inputs (flash attention keeps them)
    attn.o            [T,n*v] bf16      flash-attention output = linear_proj input
    attn.lse          [n,T] fp32        flash-attention softmax log-sum-exp (no [T,T] softmax is stored)
    attn.rope_cos_sin [2,seq,rope] fp32 RoPE cos and sin, per layer, sized by the sequence, not the micro-batch
    *_q               quantized copies when a dense linear is in the recipe's scope (scope all_linears); a dense
                      linear whose in/out features are not multiples of 128 stays BF16 and holds its input
                      (MLA's kv_down_proj: H -> kv_lora + rope = 576)
Dense SwiGLU MLP (the first first_k_dense layers)
    mlp.ln_in, mlp.ln_rstd, mlp.ln_out [T,H]; mlp.swiglu_in [T,2F] bf16 (megatron's fused SwiGLU saves its
    input only); mlp.fc2_in [T,F]
MoE layer
    moe.ln_in, moe.ln_rstd, moe.ln_out (held by the router, which saves its BF16 input, and by a BF16 shared fc1)
    moe.router_scores, moe.router_aux  [T,E] fp32 (sigmoid output; normalized scores of the seq aux loss)
    moe.router_topk_idx [T,k] int64 x 2; moe.router_topk_probs [T,k] fp32; moe.router_norm [T] fp32 x 2
    moe.routing_map [E,T] bool; moe.routing_probs [E,T] fp32; moe.seq_aux_stats [b,E] fp32 x 2 (seq aux loss)
    moe.routing_idx   [R] int64 (x 2 with the MXFP4 dispatch: fp4moe's dispatcher keeps a second one)
    moe.expert_fc1_in [R,H]   bf16 | FP8 row+col | MXFP4 (expert_input_fp4 or save_fp4)
    moe.expert_swiglu_in [R,2F] bf16 | MXFP4 (activation_fp4_store)
    moe.expert_fc2_in [R,F]   bf16 | FP8 row+col | MXFP4 (save_fp4)
    moe.expert_probs  [R] fp32
    moe.shared_fc1_in_q, moe.shared_swiglu_in [T,2Fs] bf16 | MXFP4 (activation_fp4_store), moe.shared_fc2_in [T,Fs]
    (routing probabilities are applied inside the SwiGLU, megatron's and our order, so the combine saves nothing;
    the dispatch/combine buffers are transient, part (d))
Head (stage with L): head.ln_in, head.ln_rstd, head.ln_out [T,H]; head.softmax [T,V/TP] fp32 (vocab-parallel
    cross entropy keeps the fp32 softmax) and head.ce_target [T] int64 + bool (masked target, target mask). MTP (m): an MLA + MoE layer as above, mtp.eh_in [T,2H] bf16, the
    norm inputs of the embedding and hidden streams (2 x [T,H]) and its own head tensors.

Recompute scopes (conf/recompute/*.yaml) and what each keeps:

    none             everything above
    attn_ln_experts  core_attn: attn.lse dropped; q, k, v kept (they are the checkpoint's inputs); attn.o kept
                     (linear_proj input). layernorm (output-discarding, input/pre-MLP norms): *.ln_out storage
                     and *.ln_rstd freed, *.ln_in kept; quantized copies made from ln_out are kept. moe_expert:
                     expert_fc1_in / swiglu_in / fc2_in dropped; the checkpoint keeps the dispatched rows
                     (moe.expert_ckpt_in: MXFP4 when dispatch_fp4 and expert_input_fp4, else [R,H] bf16) + probs.
    attn_ln_mlp      core_attn + layernorm as above; mlp (dense MLPs only, normal checkpoint): dense-MLP internals
                     dropped, its input kept (= mlp.ln_out, freed anyway by the layernorm recompute). Routed
                     experts keep everything: why BF16/FP8 OOM in the paper.
    mla_up_proj      q/kv up-projections + RoPE recomputed inside a checkpoint whose inputs are the q/kv layernorm
                     outputs (attn.q_ln_out, attn.kv_ln_out kept; the norms keep their inputs and rstd); the
                     up-projections' saved inputs and attn.q/k/v freed; RoPE keeps its [seq, rope] fp32 frequencies
                     instead of cos + sin; attn.o and attn.lse kept. Everything else as none.
    Under ``recompute_cache_fp4`` (the mxfp4 preset) every checkpoint inside a layer stores its inputs MXFP4
    (fp4moe.model.recompute): the norm checkpoints' inputs (*.ln_in), core attention's q/k/v, the dense mlp
    checkpoint's input (a surviving MXFP4 copy, mlp.ckpt_in) and mla_up_proj's inputs (+ k_pos_emb's own copy).
    full             megatron full/uniform, 1 layer per chunk: each transformer layer keeps only its input [T,H]
                     bf16; the head/MTP tensors are not recomputed.

``MemoryAssumptions.attn_recompute``: the paper's "attention" is the FP8-Flow-MoE fork's ``attn`` module, mapped
by conf/recompute/attn_ln_*.yaml to megatron's ``core_attn``. If the fork's module recomputes the whole
self-attention block, use ``attn_recompute='self_attention'`` (what conf/recompute/attn_block_*.yaml run, fp4moe's
``self_attention`` module; such a config sets it itself): then only the block input (attn.ln_out, freed by the
layernorm recompute) is kept from the attention, plus under mxfp4's recompute caches the block checkpoint's MXFP4
copy of it (attn.ckpt_in).
experiment=paper_t1 runs the whole block (conf/experiment/paper_t1.yaml says why); results/scale/paper_t1.md has
both readings.

Recompute transient: while a layer's backward runs, what the scope recomputed exists again for that layer and
micro-batch. At the routed experts' backward (part (e)) that is: attn_ln_experts, the experts' recomputed tensors
(``expert_swiglu_in``, ``expert_fc2_in``, and ``expert_fc1_in`` when its format differs from the checkpoint's kept
input) plus the recomputed output [R,H] bf16 that the checkpoint holds through the backward; full, the whole layer
(saved under none - saved under full) plus its output [T,H]; attn_ln_experts and attn_ln_mlp, the pre-MLP norm's
output-discarding checkpoint, recomputed when the MoE layer's output gradient arrives: megatron's
``CheckpointWithoutOutput._recompute`` keeps its recomputation's output [T,H] and refills the discarded output's
storage with a copy (2 x [T,H] bf16), plus the decoded input [T,H] when its cache is MXFP4; the attention's and the
input norm's recomputation runs later, in the attention's backward. A dense layer's is (saved under none - saved
under scope).

The lab's stack: the paper's runs used megatron-core with Transformer Engine 2.8 and the paper release's patches,
not fp4moe's own linears and experts. Where that code keeps other bytes, a ``MemoryAssumptions`` switch says so
(each off by default, i.e. fp4moe's code as calibration.md checks it; ``LAB_STACK`` turns all of them on):

    fp8_any_shape           every linear FP8 whatever its shape (kv_down_proj, H -> 576, too)
    fp8_weight_workspaces   every FP8 linear's weight copies cached for the run (part (a))
    fp8_saves_columnwise    an FP8 linear saves the column-wise copy of its input only (~1.03 B/elem)
    save_original_input     under the layernorm recompute, the FP8 linears reading a discarded norm output save
                            that output (refilled by the recompute), no copy of their own
    fused_norm_linears      the dense pre-MLP norm and MLA's q / kv norms inside TE LayerNormLinears: not
                            recomputed by 'layernorm', their output saved as an FP8 copy under fp8 and mxfp4; the
                            mla_up_proj checkpoint holds the latents before the norms
    dense_swiglu_fp4        under activation_fp4_store the dense MLPs' SwiGLU input MXFP4 too (fp4moe: BF16)
    te_grouped_experts      the routed experts' backward as TE's grouped MLP runs it, wgrad into the main grads

(c) Micro-batches in flight (1F1B)
----------------------------------
M = global_batch / (micro_batch x DP) micro-batches per step. Without interleaving, pipeline rank r holds the
activations of min(PP - r, M) micro-batches at its peak (PP on the first stage, 1 on the last). With
``virtual_pipeline`` v > 1 (megatron's interleaved schedule) rank r holds min((PP - r - 1) x 2 + (v - 1) x PP + 1,
M v) model chunks in flight; each is charged the mean per-micro-batch activation of the rank's chunks (an
approximation). Each rank's peak is taken at the end of its warm-up; the model reports every rank and
``per_gpu_memory`` the one with the largest total.

(d) All-to-all buffers (transient, one MoE layer and micro-batch at a time)
---------------------------------------------------------------------------
send + receive buffers of the largest of the four all-to-alls of a MoE layer: dispatch forward (R rows of the
dispatch codec + fp32 probs), combine forward (R x 2H bf16), and the two gradient all-to-alls (R rows of
``recipe.backward_a2a``). Pre-allocated communication buffers (NCCL, DeepEP) are outside PyTorch's allocator: (f).

(e) The peak: the largest of three phases (one micro-batch, one layer at a time)
------------------------------------------------------------------------------
    allocated = params + grads + optimizer + activations + max(head, moe_forward, backward)

    head          the BF16 logits [T, V/TP] beside the saved fp32 softmax (``loss_transient``): the end of the
                  forward / the start of the backward of the stage with the head.
    moe_forward   the last MoE layer's dispatch buffers (d) - the head's saved tensors (not allocated yet then).
    backward      the routed experts' backward (``expert_backward``) + what the scope recomputed there (above)
                  - the head's saved tensors (freed by then); on a stage without a MoE layer, its dense layers'
                  recompute transient + 2 x [T,H] instead. Taken at the MoE layer where it is largest: without
                  pipelining fp4moe.train keeps every BF16 .grad until the step, so a deeper layer adds the
                  gradients of the layers after it and frees their saved activations (``backward_depth_bytes``:
                  > 0 under full recompute, whose layers save little; the last MoE layer otherwise).

``expert_backward``, the tensors live at the experts' backward peak besides the saved ones, per MoE layer and
micro-batch (R rows on the GPU, H hidden, F expert FFN, all bf16 unless said):
    fp8 / mxfp4 (fp4moe.ops.grouped_experts): the larger of fc1's dgrad, dY [R,H] (the combine's gradient),
        dH [R,2F], its FP8 rows [R,2F] + 1x128 scales, dX [R,H], and fc1's wgrad after it, dY, dH, dX, dH's FP8
        column copy [2F,Mp] + scales and, when x was saved as MXFP4, x's FP8 column copy [H,Mp] + scales rebuilt
        from it (mxfp4: the wgrad is the larger); the code of the first H200 archives also kept an unused
        [R,H] output buffer in the FP8 GEMM wrapper (dgrad), dZ [R,F] and (activation_fp4_store) the decoded H
        [R,2F] (``MemoryAssumptions.expert_backward_keeps_dead``).
    bf16 in fp4moe's grouped experts (``MemoryAssumptions.bf16_experts='grouped'``, P2's MoE layer): fc1's wgrad as
        above without FP8 copies, plus one expert's [2F,H] product before it is copied into dW1.
    bf16 (megatron's SequentialMLP): dY, the per-expert dX pieces and their concatenation, 3 x [R,H]; under
        attn_ln_experts its recomputation's forward peaks at the concatenation of the recomputed outputs: dY + the
        recomputed tensors + the pieces and their concatenation, if that is larger.
    TE's grouped MLP (``MemoryAssumptions.te_grouped_experts``, the lab's stack; every recipe): the largest of fc2's
        backward, dY [R,H] + its FP8 rows and columns (FP8 recipes) + dZ [R,F]; the SwiGLU's, dZ + the decoded H
        [R,2F] (stored MXFP4) + dH [R,2F]; and fc1's, dH + its FP8 rows and columns + dX [R,H] + x's FP8 column
        copy rebuilt from MXFP4 (mxfp4); no weight gradients (accumulated into the main-gradient buffer). Under
        attn_ln_experts dY stays live through the SwiGLU's and fc1's backward (the checkpoint holds it).
    plus the layer's output gradient and input gradient, 2 x [T,H].

(f) Memory outside PyTorch's allocated bytes (what nvidia-smi adds; ``fp4moe.scale.outside_torch``)
---------------------------------------------------------------------------------------------------
    total = allocated + CUDA context + NCCL communicators + DeepEP buffers + the allocator's reserved - allocated

Each a named ``MemoryAssumptions`` field in bytes with its scaling rule (``fp4moe.scale.outside_torch``'s
docstring): 0 and ``outside_torch_source='not measured'`` unless the caller gives them (the H200 measurement:
``fp4moe.analysis.outside_torch_measured.measured_assumptions``).
``total_bytes`` is the headline (the paper's "% of 80 GB" read as what nvidia-smi shows);
``allocated_bytes`` is ``torch.cuda.max_memory_allocated``'s peak, which fp4moe.analysis.calibration checks.

Not modelled: the forward peak inside attention or a dense MLP; Transformer Engine's workspaces (cuBLAS, the
kernels' own buffers) beyond what the measured outside-PyTorch terms hold.
"""
from __future__ import annotations

import copy
import functools
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

# The formats' numbers and bytes: fp4moe_kernels' torch-free modules (the same formulas the ops count with).
from fp4moe_kernels.constants import FP8_GROUP, MX_BLOCK
from fp4moe_kernels.sizes import FP8_SCALE_BYTES, fp8_row_col_bytes, mxfp4_bytes
from fp4moe_kernels.sizes import pad_to_group as _pad128

from ..paths import conf_dir
from ..recipe import Recipe
from ..settings import SCHEMAS
from . import outside_torch, optimizer_state

GB = 2**30  # bytes per "GB" in this module (GiB)
BF16, FP32, INT64 = 2, 4, 8  # bytes per element

SCOPES = ("none", "attn_ln_experts", "attn_ln_mlp", "mla_up_proj", "full")
ATTN_RECOMPUTE = ("core_attn", "self_attention")
CONF = conf_dir()   # fp4moe.paths: $FP4MOE_CONF_DIR, else the checkout's conf/
NOT_MEASURED = "not measured"   # MemoryAssumptions.outside_torch_source when no measured terms are given


# ---------------------------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class MemoryAssumptions:
    """Every assumption of the model that is not in the config, with its unit (the optimizer is the config's
    ``optimizer`` group). Measured quantities default to 0 (not measured): the caller gives them."""

    param_bytes: int = 2             # B/param of autograd's .grad of a weight (BF16 model weights)
    attn_recompute: str = "core_attn"   # what the scopes' "attention" recomputes (module docstring)
    # (f) outside PyTorch's allocated bytes, per GPU (fp4moe.scale.outside_torch: what each is and how it scales);
    # 0 unless measured (fp4moe.analysis.outside_torch_measured gives the H200's; outside_torch_source says where from)
    cuda_context_bytes: int = 0            # per process
    nccl_communicator_bytes: int = 0       # per communicator a step uses
    nccl_peer_bytes: int = 0               # per peer of a communicator's collectives (its ring neighbours)
    nccl_p2p_peer_bytes: int = 0           # per send / recv peer (NCCL's all-to-all, the pipeline's p2p)
    allocator_gap_bytes: int = 0           # reserved - allocated at the peak, measured at
    allocator_gap_ref_elements: int = 0    # this tokens x hidden per micro-batch
    outside_torch_source: str = NOT_MEASURED
    # True: the all-to-all runs on DeepEP (megatron's flex dispatcher, the lab's): its cudaMalloc'd buffers
    # (outside_torch.deepep_buffer_bytes) and an EP communicator without all-to-all peers; False: NCCL's all-to-all
    deepep_buffers: bool = False
    outside_torch_scale: float = 1.0    # multiplies every term of (f) (a sensitivity: 0.5 / 1.5)
    # FP8 column copies of the routed experts' inputs are padded to 128 rows per expert: 'balanced' = every expert
    # gets exactly R/E rows (the hand-checkable case); 'expected' = real routing, whose per-expert counts have a
    # residue mod 128 spread uniformly, so (128 - 1) / 2 padding rows per expert on average.
    expert_padding: str = "balanced"
    # When the FP32 main-gradient buffer exists at the peak: 'always' (megatron DDP's persistent grad buffer), or
    # 'after_first_micro_batch' (fp4moe.train.optim: Optimizer.accumulate creates the FP32 accumulators after the
    # first micro-batch's backward and zero_grad frees them after the step; the peak is in a backward, so they
    # count only when a step has 2 or more micro-batches).
    main_grad_resident: str = "always"
    # The BF16 recipe's routed experts: 'sequential' (megatron's SequentialMLP, the trainer) or 'grouped' (fp4moe's
    # GroupedExpertMLP on BF16 GEMMs, P2's MoE layer: the same backward as the FP8 recipes' without FP8 copies)
    bf16_experts: str = "sequential"
    # True: the routed experts' backward as the first H200 archives measured it, which kept an unused
    # [R, H] GEMM output buffer, dZ [R, F] and the decoded H [R, 2F] until it returned (module docstring, (e)).
    expert_backward_keeps_dead: bool = False
    # True: the norm checkpoints' MXFP4 caches (recompute_cache_fp4 under attn_ln_*) as the first H200 archives
    # measured them, where megatron's checkpoint function kept each norm input [T, H] BF16 beside its MXFP4 copy (it
    # saved them as leaves that require grad, which autograd holds itself): 2 x [T, H] bf16 per layer more, not in the
    # saved bytes (``held_bytes``)
    norm_cache_keeps_bf16: bool = False
    # True: megatron's token dispatchers as the trainer ran them before it dropped their state after each forward
    # (results/manifest.yaml says which archives measured that code), keeping the routing probabilities of their
    # last forward until the step's backward had passed. Under full recompute that forward is the
    # recomputation inside the backward, whose graph holds the layer's detached input and its gradient: every MoE
    # layer after the one whose experts are being differentiated keeps its input [T, H] and (all but the next one,
    # whose input gradient is this layer's output gradient) that gradient (``backward_depth_bytes``). Since then the
    # trainer drops them when the MoE layer's forward returns (fp4moe.model.gpt_model.release_dispatcher_after_forward).
    dispatcher_keeps_recompute_graph: bool = False
    # routed rows this GPU's experts receive, / T x k (the rows its own tokens send): 1 = balanced routing (on one
    # GPU exactly 1). A MEASURED routing statistic where a run logged it (fp4moe.analysis.calibration reads it from the
    # trainer's a2a/dispatch_forward_received_rows / _sent_rows, or in older runs the recipe dispatcher's bytes);
    # scales every tensor of the experts'.
    expert_rows_factor: float = 1.0
    # the measured rows of each local expert (a benchmark that logged them, fp4moe.bench.moe_layer): when given, the FP8
    # column copies are padded as those counts pad (sum of each count rounded up to 128), whatever expert_padding
    # says; their sum must be the rows that expert_rows_factor gives
    expert_counts: tuple = ()
    # ---- the paper lab's stack: megatron-core with Transformer Engine 2.8 and the paper release's patches, where it
    # keeps other bytes than fp4moe's own code (docs/paper-scale.md, "The lab's stack"). All False: fp4moe's code,
    # what calibration.md checks; ``LAB_STACK`` turns them all on (fp4moe.analysis.paper_t1.paper_setup()).
    # True: every linear in the recipe's scope computes in FP8 whatever its shape (TE needs the input's rows to be a
    # multiple of 8 and its features of 16: utils.py assert_dim_for_fp8_exec; MLA's kv_down_proj, H -> 576, too);
    # False: fp4moe keeps a dense linear whose features are not multiples of 128 in BF16.
    fp8_any_shape: bool = False
    # True: every FP8 linear keeps its weight's FP8 copies (rows for fprop, columns for dgrad, 128 x 128 scales) for
    # the whole run, as with ``train.fp8_weight_cache``: megatron's TE wrappers pass ``is_first_microbatch`` (not
    # None unless --disable-parameter-transpose-cache) and TE then caches the quantized weight in the module
    # (linear.py / grouped_linear.py ``get_weight_workspace(cache_name="weight")``), updated in place each step.
    fp8_weight_workspaces: bool = False
    # True: an FP8 linear keeps only the column-wise FP8 copy of its input for backward (the wgrad operand; TE drops
    # the rows it used in fprop: linear.py "Discard row-wise data since it is not needed in backward pass",
    # grouped_linear.py and layernorm_linear.py ``update_usage(rowwise_usage=False)``); False: fp4moe's fp8_linear and
    # grouped experts keep rows and columns. No effect on MXFP4-saved inputs (save_fp4).
    fp8_saves_columnwise: bool = False
    # True: under the layernorm recompute (attn_ln_*) an FP8 linear that reads a norm's discarded output saves that
    # original input (its storage refilled by the recompute) instead of a quantized copy of its own: megatron's
    # TransformerLayer calls ``set_save_original_input`` on q_down / kv_down (MLA's
    # ``set_for_recompute_input_layernorm``), the shared expert's fc1 (MoELayer's
    # ``set_for_recompute_pre_mlp_layernorm``) and a dense MLP's fc1 behind a separate norm, whenever config.fp8 is
    # set (fp8 and mxfp4; TE's save_fp4 requires ``not save_original_input``). False: fp4moe saves its own copy.
    save_original_input: bool = False
    # True: the norms that feed a single linear are fused into it (megatron's TE layer spec: a dense layer's pre-MLP
    # norm into fc1, MLA's q / kv layernorms into q_up / kv_up, all ``TELayerNormColumnParallelLinear``; the dense
    # layer's pre_mlp_layernorm is an IdentityOp, so the layernorm recompute leaves it alone). Such a linear saves
    # the norm's input, 1/rms and its own copy of the norm output: BF16, or FP8 under fp8 and mxfp4 alike (the
    # release's TE patch gives save_fp4 to Linear and GroupedLinear only, not to layernorm_linear.py). The
    # mla_up_proj checkpoint then holds the q / kv latents before their norms (the norms run inside it). False:
    # fp4moe's separate norms.
    fused_norm_linears: bool = False
    # True: under ``activation_fp4_store`` the dense MLPs' SwiGLU input is stored MXFP4 as well (the release's
    # megatron-0.15.0rc7.diff: MLP.forward passes ``fp4_input_store=config.activation_func_fp4_input_store`` to
    # bias_swiglu_impl); False: fp4moe's dense MLP (megatron's own) keeps it BF16.
    dense_swiglu_fp4: bool = False
    # True: the routed experts are TE's grouped MLP (megatron's TEGroupedMLP: GroupedLinear fc1, the weighted SwiGLU,
    # GroupedLinear fc2, each its own autograd node) with megatron's default gradient-accumulation fusion, so the
    # wgrad GEMMs write into the main-gradient buffer (grouped_linear.py ``wgrad_list = main_grads``): the experts'
    # backward holds no weight-gradient buffer, and each step's gradient is freed once the next one has it, except the
    # combine's gradient dY, which an enclosing moe_expert checkpoint holds through its whole backward (module
    # docstring, (e)). False: fp4moe's grouped experts / megatron's SequentialMLP (``bf16_experts``).
    te_grouped_experts: bool = False

    def __post_init__(self):
        if self.attn_recompute not in ATTN_RECOMPUTE:
            raise ValueError(f"attn_recompute={self.attn_recompute!r}: pick one of {ATTN_RECOMPUTE}")
        if self.expert_padding not in ("balanced", "expected"):
            raise ValueError(f"expert_padding={self.expert_padding!r}: 'balanced' or 'expected'")
        if self.main_grad_resident not in ("always", "after_first_micro_batch"):
            raise ValueError(f"main_grad_resident={self.main_grad_resident!r}: 'always' or 'after_first_micro_batch'")
        if self.bf16_experts not in ("sequential", "grouped"):
            raise ValueError(f"bf16_experts={self.bf16_experts!r}: 'sequential' or 'grouped'")
        for name in ("cuda_context_bytes", "nccl_communicator_bytes", "nccl_peer_bytes", "nccl_p2p_peer_bytes",
                     "allocator_gap_bytes", "allocator_gap_ref_elements", "outside_torch_scale"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")


# The lab's-stack switches of MemoryAssumptions (module docstring, "The lab's stack"), all on:
# ``replace(assumptions, **LAB_STACK)``.
LAB_STACK = {name: True for name in ("fp8_any_shape", "fp8_weight_workspaces", "fp8_saves_columnwise",
                                     "save_original_input", "fused_norm_linears", "dense_swiglu_fp4",
                                     "te_grouped_experts")}


def compose_cfg(model: str, parallel: str, recompute: str, precision: str, optimizer: str = "gpu_fp32") -> DictConfig:
    """The five groups this model reads, loaded from conf/<group>/<name>.yaml (no Hydra; an ``optimizer`` file's
    ``defaults`` list, e.g. ``[gpu_fp32, _self_]``, is merged in). ``optimizer``: conf/optimizer/<name>.yaml
    (default train.yaml's, ``gpu_fp32``)."""
    return OmegaConf.create({g: _load_group(g, n) for g, n in
                             (("model", model), ("parallel", parallel), ("recompute", recompute),
                              ("precision", precision), ("optimizer", optimizer))})


def _load_group(group: str, name: str) -> DictConfig:
    """conf/<group>/<name>.yaml with its ``defaults`` merged in, a fresh copy each call (each file parsed once)."""
    return OmegaConf.create(copy.deepcopy(_group_container(CONF, group, name)))


@functools.lru_cache(maxsize=256)
def _group_container(conf: Any, group: str, name: str) -> dict:
    path = conf / group / f"{name}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in (conf / group).glob("*.yaml")))
        raise ValueError(f"{group}={name}: no conf/{group}/{name}.yaml; pick one of {names}")
    node = OmegaConf.load(path)
    # the group's schema (fp4moe.settings, a ConfigStore node, not a file) is Hydra's: its types are not needed here
    bases = [d for d in node.pop("defaults", []) if d != "_self_" and d not in SCHEMAS.get(group, {})]
    if bases:
        node = OmegaConf.merge(*(_load_group(group, b) for b in bases), node)
    return OmegaConf.to_container(node, resolve=False)


@functools.lru_cache(maxsize=512)
def _experiment(overrides: tuple[str, ...]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    return cfg


def experiment_cfg(experiment: str, *overrides: str) -> DictConfig:
    """What ``python -m fp4moe.train experiment=<experiment> <overrides>`` composes (Hydra, conf/train.yaml), one
    cell: e.g. ``experiment_cfg("paper_t1", "precision=fp8", "recompute=mla_up_proj")``. A fresh copy each call."""
    return copy.deepcopy(_experiment((f"experiment={experiment}", *overrides)))


def _as_cfg(cfg: Any) -> DictConfig:
    return cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)


def _scope(cfg: DictConfig) -> str:
    r = cfg.recompute
    name = r.get("name")
    if name in SCOPES:
        return name
    gran = r.get("granularity")
    if gran is None:
        return "none"
    if gran == "full":
        return "full"
    mods = set(r.get("megatron_modules") or []) | set(r.get("fp4moe_modules") or [])
    mods = {"core_attn" if m == "self_attention" else m for m in mods}   # which attention: _with_cfg_attention
    for s, want in (("attn_ln_experts", {"core_attn", "layernorm", "moe_expert"}),
                    ("attn_ln_mlp", {"core_attn", "layernorm", "mlp"}), ("mla_up_proj", {"mla_up_proj"})):
        if mods == want:
            return s
    raise ValueError(f"recompute modules {sorted(mods)} are not one of the modelled scopes {SCOPES}")


def recomputes_attention_block(cfg: DictConfig) -> bool:
    """Whether the config recomputes the whole attention block (``recompute.fp4moe_modules: [self_attention, ...]``
    under selective granularity, conf/recompute/attn_block_*.yaml)."""
    r = cfg.recompute
    return r.get("granularity") == "selective" and "self_attention" in (r.get("fp4moe_modules") or [])


def _with_cfg_attention(cfg: DictConfig, a: MemoryAssumptions) -> MemoryAssumptions:
    """``a`` with ``attn_recompute='self_attention'`` where the config recomputes the whole attention block
    (``recomputes_attention_block``); else ``a``."""
    return replace(a, attn_recompute="self_attention") if recomputes_attention_block(cfg) else a


@dataclass
class _Dims:
    h: int; n: int; q_lora: int | None; kv_lora: int; nope: int; rope: int; v: int
    ffn: int; e: int; k: int; f: int; fs: int; vocab: int; first_dense: int
    t_tok: int; t_hid: int; tp: int; ep: int; etp: int; seq: int = 0; seq_aux: bool = False
    rows: int = 0   # routed rows this GPU's experts receive (T x k times MemoryAssumptions.expert_rows_factor)


def _dims(cfg: DictConfig, rows_factor: float = 1.0) -> _Dims:
    m, p = cfg.model, cfg.parallel
    tp, cp = int(p.tensor), int(p.context)
    t_tok = int(p.micro_batch) * int(p.seq_length) // cp
    sp = bool(p.get("sequence_parallel", False)) and tp > 1
    etp = int(p.expert_tensor) if p.get("expert_tensor") is not None else tp
    d = _Dims(h=int(m.hidden_size), n=int(m.num_attention_heads), q_lora=m.mla.get("q_lora_rank"),
                 kv_lora=int(m.mla.kv_lora_rank), nope=int(m.mla.qk_head_dim), rope=int(m.mla.qk_pos_emb_head_dim),
                 v=int(m.mla.v_head_dim), ffn=int(m.ffn_hidden_size), e=int(m.moe.num_experts),
                 k=int(m.moe.router_topk), f=int(m.moe.ffn_hidden_size),
                 fs=int(m.moe.ffn_hidden_size) * int(m.moe.get("shared_experts", 0) or 0),
                 vocab=int(m.vocab_size), first_dense=int(m.moe.first_k_dense),
                 t_tok=t_tok, t_hid=t_tok // tp if sp else t_tok, tp=tp, ep=int(p.expert), etp=etp,
                 seq=int(p.seq_length) // cp, seq_aux=m.moe.get("load_balancing_type") == "seq_aux_loss")
    d.rows = round(d.t_tok * d.k * rows_factor)
    return d


# ---------------------------------------------------------------------------------------------- (b) ledger

@dataclass
class SavedTensor:
    """One tensor saved for backward: ``bytes`` for one micro-batch; ``holders`` the autograd nodes / checkpoints
    that keep it; ``tag`` 'ln_out' / 'ln_rstd' marks what an output-discarding layernorm recompute frees; ``source``
    the saved tensor a linear's quantized copy was made from ('' for the others)."""

    name: str
    shape: tuple
    fmt: str
    bytes: int
    holders: set = field(default_factory=set)
    tag: str = ""
    source: str = ""


class _Ledger:
    def __init__(self):
        self.t: dict[str, SavedTensor] = {}

    def add(self, name, shape, fmt, nbytes, holders, tag="", source=""):
        self.t[name] = SavedTensor(name, tuple(shape), fmt, int(nbytes), set(holders), tag, source)

    def drop(self, *names):
        for n in names:
            self.t.pop(n, None)

    def drop_prefix(self, prefix, keep=()):
        for n in [n for n in self.t if n.startswith(prefix) and n not in keep]:
            del self.t[n]

    def tensors(self) -> list[SavedTensor]:
        return [s for s in self.t.values() if s.holders]


def _linear_input(led: _Ledger, src: str, consumer: str, m: int, k: int, kind: str, recipe: Recipe,
                  a: MemoryAssumptions, mp: int | None = None, n_out: int | None = None) -> None:
    """A linear ``[k] -> [n_out]`` that reads the saved tensor ``src`` [m, k]: a BF16 linear holds ``src``; an FP8
    one saves its own quantized copy ``<consumer>_q`` (FP8 row+col, or MXFP4 under save_fp4) and does not hold
    ``src``. In fp4moe a dense linear whose in or out features are not multiples of 128 stays BF16
    (``fp4moe.model.recipe_dense``; MLA's kv_down_proj, H -> kv_lora + rope = 576, is one); with
    ``a.fp8_any_shape`` (Transformer Engine) it is FP8 too."""
    blockable = (a.fp8_any_shape or kind != "dense" or n_out is None
                 or (k % FP8_GROUP == 0 and n_out % FP8_GROUP == 0))
    if recipe.fp8_compute and recipe.applies_to(kind) and blockable:
        if recipe.save_fp4:
            led.add(f"{consumer}_q", (m, k), "mxfp4", mxfp4_bytes(m, k), {consumer}, source=src)
        else:
            fmt, nbytes = _fp8_saved(m, k, mp, a)
            led.add(f"{consumer}_q", (m, k), fmt, nbytes, {consumer}, source=src)
    else:
        led.t[src].holders.add(consumer)


def fp8_col_bytes(m: int, k: int, mp: int | None = None) -> int:
    """Transformer Engine's column-wise FP8 copy of an [m, k] input: E4M3 [k, m] + one FP32 scale per 1x128 group
    along m (``mp``: m padded to 128 per segment, default one segment)."""
    mp = _pad128(m) if mp is None else mp
    return k * m + FP8_SCALE_BYTES * k * (mp // FP8_GROUP)


def _fp8_saved(m: int, k: int, mp: int | None, a: MemoryAssumptions) -> tuple[str, int]:
    """(format, bytes) an FP8 linear saves of its [m, k] input: rows + columns (fp4moe), or the columns alone
    (``a.fp8_saves_columnwise``, Transformer Engine)."""
    if a.fp8_saves_columnwise:
        return "fp8_col", fp8_col_bytes(m, k, mp)
    return "fp8_row_col", fp8_row_col_bytes(m, k, mp)


def _norm(led: _Ledger, prefix: str, norm: str, t: int, width: int, out_holders=(), fused: bool = False) -> None:
    """A norm's saved tensors; ``fused``: inside a TE LayerNormLinear, whose output the layernorm recompute does not
    discard (untagged)."""
    led.add(f"{prefix}.ln_in", (t, width), "bf16", BF16 * t * width, {norm})
    led.add(f"{prefix}.ln_rstd", (t,), "fp32", FP32 * t, {norm}, tag="" if fused else "ln_rstd")
    led.add(f"{prefix}.ln_out", (t, width), "bf16", BF16 * t * width, set(out_holders), tag="" if fused else "ln_out")


def _norm_linear_input(led: _Ledger, src: str, consumer: str, m: int, k: int, recipe: Recipe,
                       a: MemoryAssumptions) -> None:
    """The input a dense linear that follows a norm saves: ``_linear_input``, or with ``a.fused_norm_linears`` TE's
    LayerNormLinear, which saves an FP8 copy of the norm output under fp8 and mxfp4 alike (no save_fp4 hook)."""
    if not a.fused_norm_linears:
        _linear_input(led, src, consumer, m, k, "dense", recipe, a)
    elif recipe.fp8_compute and recipe.applies_to("dense"):
        led.add(f"{consumer}_q", (m, k), *_fp8_saved(m, k, None, a), {consumer}, source=src)
    else:
        led.t[src].holders.add(consumer)


def _attention(led: _Ledger, d: _Dims, recipe: Recipe, a: MemoryAssumptions) -> None:
    t, th, n = d.t_tok, d.t_hid, d.n // d.tp
    qk = d.nope + d.rope
    _norm(led, "attn", "input_ln", th, d.h)
    if d.q_lora:
        _linear_input(led, "attn.ln_out", "attn.q_down_in", th, d.h, "dense", recipe, a)
        led.add("attn.q_latent", (t, d.q_lora), "bf16", BF16 * t * d.q_lora, {"q_ln"})
        led.add("attn.q_ln_rstd", (t,), "fp32", FP32 * t, {"q_ln"})
        led.add("attn.q_ln_out", (t, d.q_lora), "bf16", BF16 * t * d.q_lora, set())
        _norm_linear_input(led, "attn.q_ln_out", "attn.q_up_in", t, d.q_lora, recipe, a)
    else:
        _linear_input(led, "attn.ln_out", "attn.q_proj_in", th, d.h, "dense", recipe, a)
    _linear_input(led, "attn.ln_out", "attn.kv_down_in", th, d.h, "dense", recipe, a, n_out=d.kv_lora + d.rope)
    led.add("attn.kv_latent", (t, d.kv_lora + d.rope), "bf16", BF16 * t * (d.kv_lora + d.rope), {"kv_ln"})
    led.add("attn.kv_ln_rstd", (t,), "fp32", FP32 * t, {"kv_ln"})
    led.add("attn.kv_ln_out", (t, d.kv_lora), "bf16", BF16 * t * d.kv_lora, set())
    _norm_linear_input(led, "attn.kv_ln_out", "attn.kv_up_in", t, d.kv_lora, recipe, a)
    for name, w in (("q", qk), ("k", qk), ("v", d.v)):
        led.add(f"attn.{name}", (t, n, w), "bf16", BF16 * t * n * w, {"core_attn"})
    led.add("attn.o", (t, n * d.v), "bf16", BF16 * t * n * d.v, {"core_attn"})
    _linear_input(led, "attn.o", "attn.proj_in", t, n * d.v, "dense", recipe, a)
    led.add("attn.lse", (n, t), "fp32", FP32 * n * t, {"core_attn"})
    # MLA's RoPE: cos and sin [seq, 1, 1, rope] fp32 saved by the rotary application of every layer; sized by the
    # sequence, not by the micro-batch (the H200 probe: 8 388 608 B = 4 layers x 2 x 4096 x 64 x 4 at micro-batch 8
    # and 16 alike).
    led.add("attn.rope_cos_sin", (2, d.seq, d.rope), "fp32", 2 * FP32 * d.seq * d.rope, {"rope"})


def _dense_mlp(led: _Ledger, d: _Dims, recipe: Recipe, a: MemoryAssumptions) -> None:
    th, f = d.t_hid, d.ffn // d.tp
    _norm(led, "mlp", "pre_mlp_ln", th, d.h, fused=a.fused_norm_linears)
    _norm_linear_input(led, "mlp.ln_out", "mlp.fc1_in", th, d.h, recipe, a)
    if recipe.activation_fp4_store and a.dense_swiglu_fp4:
        led.add("mlp.swiglu_in", (d.t_tok, 2 * f), "mxfp4", mxfp4_bytes(d.t_tok, 2 * f), {"mlp.swiglu"})
    else:
        led.add("mlp.swiglu_in", (d.t_tok, 2 * f), "bf16", BF16 * d.t_tok * 2 * f, {"mlp.swiglu"})
    led.add("mlp.fc2_in", (d.t_tok, f), "bf16", BF16 * d.t_tok * f, set())
    _linear_input(led, "mlp.fc2_in", "mlp.fc2", d.t_tok, f, "dense", recipe, a)


def _expert_rows(d: _Dims, padding: str = "balanced", counts: tuple = ()) -> tuple[int, int, int]:
    """(R rows on this GPU's experts, local experts, Mp = rows padded to 128 per expert): balanced routing, or
    ('expected') R plus (128 - 1) / 2 padding rows per expert, rounded to a row; with measured per-expert
    ``counts``, their own padding."""
    r = d.rows
    el = d.e // d.ep
    if counts:
        if sum(counts) != r or len(counts) != el:
            raise ValueError(f"expert_counts: {len(counts)} experts with {sum(counts)} rows, but the config gives "
                             f"{el} local experts with {r} rows (set expert_rows_factor to the counts' sum / T k)")
        return r, el, sum(_pad128(c) for c in counts)
    if padding == "expected":
        return r, el, r + (el * (FP8_GROUP - 1) + 1) // 2
    per = -(-r // el)
    return r, el, el * _pad128(per)


def _moe(led: _Ledger, d: _Dims, recipe: Recipe, a: MemoryAssumptions) -> None:
    t, th = d.t_tok, d.t_hid
    h, f, fs = d.h, d.f // d.etp, d.fs // d.tp
    r, _, mp = _expert_rows(d, a.expert_padding, a.expert_counts)
    _norm(led, "moe", "pre_mlp_ln", th, h, out_holders={"router"})
    # megatron-core 0.16.1's sigmoid top-k router with the sequence aux loss (moe/router.py, moe_utils.py), as
    # listed by fp4moe.ops.accounting on the model (plain torch ops, the same on CPU and GPU):
    led.add("moe.router_scores", (t, d.e), "fp32", FP32 * t * d.e, {"router"})          # sigmoid output
    led.add("moe.router_aux", (t, d.e), "fp32", FP32 * t * d.e, {"router"})             # aux-loss scores
    led.add("moe.router_topk_idx", (2, t, d.k), "int64", 2 * INT64 * t * d.k, {"router"})  # top-k gather/scatter
    led.add("moe.router_topk_probs", (t, d.k), "fp32", FP32 * t * d.k, {"router"})
    led.add("moe.router_norm", (2, t), "fp32", 2 * FP32 * t, {"router"})               # top-k sum, aux denominator
    led.add("moe.routing_map", (d.e, t), "bool", d.e * t, {"permute"})
    led.add("moe.routing_probs", (d.e, t), "fp32", FP32 * d.e * t, {"permute"})
    if d.seq_aux:   # the sequence aux loss: per-sequence expert load and score sums [b, E] fp32
        b = max(1, t // d.seq) if d.seq else 1
        led.add("moe.seq_aux_stats", (2, b, d.e), "fp32", 2 * FP32 * b * d.e, {"router"})
    # permutation index of the R dispatched rows; fp4moe's MXFP4 dispatcher keeps a second one (the scales' rows)
    n_idx = 2 if recipe.dispatch_fp4 else 1
    sent = t * d.k   # this GPU's own tokens' rows (the experts receive d.rows, ``r``)
    led.add("moe.routing_idx", (n_idx, sent), "int64", n_idx * INT64 * sent, {"permute"})
    fp8 = recipe.fp8_compute
    if not fp8:
        x_fmt, x_b = "bf16", BF16 * r * h
    elif recipe.expert_input_fp4 or recipe.save_fp4:
        x_fmt, x_b = "mxfp4", mxfp4_bytes(r, h)
    else:
        x_fmt, x_b = _fp8_saved(r, h, mp, a)
    led.add("moe.expert_fc1_in", (r, h), x_fmt, x_b, {"experts"})
    if recipe.activation_fp4_store:
        led.add("moe.expert_swiglu_in", (r, 2 * f), "mxfp4", mxfp4_bytes(r, 2 * f), {"experts"})
    else:
        led.add("moe.expert_swiglu_in", (r, 2 * f), "bf16", BF16 * r * 2 * f, {"experts"})
    if not fp8:
        led.add("moe.expert_fc2_in", (r, f), "bf16", BF16 * r * f, {"experts"})
    elif recipe.save_fp4:
        led.add("moe.expert_fc2_in", (r, f), "mxfp4", mxfp4_bytes(r, f), {"experts"})
    else:
        led.add("moe.expert_fc2_in", (r, f), *_fp8_saved(r, f, mp, a), {"experts"})
    led.add("moe.expert_probs", (r,), "fp32", FP32 * r, {"experts"})
    if fs:
        _linear_input(led, "moe.ln_out", "moe.shared_fc1_in", th, h, "shared_expert", recipe, a)
        # the fused SwiGLU saves its input: BF16, or MXFP4 under activation_fp4_store (the shared expert too, as
        # fp4moe.model.recipe_moe builds it: measured on the model with fp4moe.ops.accounting)
        if recipe.activation_fp4_store:
            led.add("moe.shared_swiglu_in", (t, 2 * fs), "mxfp4", mxfp4_bytes(t, 2 * fs), {"shared.swiglu"})
        else:
            led.add("moe.shared_swiglu_in", (t, 2 * fs), "bf16", BF16 * t * 2 * fs, {"shared.swiglu"})
        led.add("moe.shared_fc2_in", (t, fs), "bf16", BF16 * t * fs, set())
        _linear_input(led, "moe.shared_fc2_in", "moe.shared_fc2", t, fs, "shared_expert", recipe, a)


def _to_mxfp4(led: _Ledger, name: str) -> None:
    """Store the saved tensor ``name`` as MXFP4 rows instead (a recompute cache under ``recompute_cache_fp4``)."""
    x = led.t[name]
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    led.t[name] = SavedTensor(name, x.shape, "mxfp4", mxfp4_bytes(m, k), x.holders, x.tag)


def _apply_scope(led: _Ledger, kind: str, scope: str, d: _Dims, recipe: Recipe, a: MemoryAssumptions) -> None:
    if scope == "none":
        return
    if scope == "full":
        led.t.clear()
        led.add("layer.input", (d.t_hid, d.h), "bf16", BF16 * d.t_hid * d.h, {"full_ckpt"})
        return
    if scope in ("attn_ln_experts", "attn_ln_mlp"):
        # layernorm (output-discarding): outputs and rstd freed, inputs kept.
        freed = [s.name for s in led.t.values() if s.tag in ("ln_out", "ln_rstd")]
        led.drop(*freed)
        if a.save_original_input and recipe.fp8_compute:
            # the FP8 linears reading a discarded output keep that output, not a copy of their own
            led.drop(*[s.name for s in led.t.values() if s.source in freed])
        # attention
        if a.attn_recompute == "core_attn":
            led.drop("attn.lse")
            for x in ("attn.q", "attn.k", "attn.v"):
                led.t[x].holders = {"core_attn_ckpt"}
            if "attn.o" in led.t:
                led.t["attn.o"].holders.discard("core_attn")
                if not led.t["attn.o"].holders:
                    del led.t["attn.o"]
        else:  # whole self-attention block: only its input (attn.ln_out, freed by the layernorm recompute) kept
            led.drop_prefix("attn.", keep=("attn.ln_in",))
            if recipe.recompute_cache_fp4:
                # the block checkpoint keeps its argument, the (discarded) input norm output: an MXFP4 copy survives
                led.add("attn.ckpt_in", (d.t_hid, d.h), "mxfp4", mxfp4_bytes(d.t_hid, d.h), {"attn_ckpt"})
        if scope == "attn_ln_experts" and kind == "moe":
            led.drop("moe.expert_fc1_in", "moe.expert_swiglu_in", "moe.expert_fc2_in")
            r = d.rows
            if recipe.dispatch_fp4 and recipe.expert_input_fp4:
                led.add("moe.expert_ckpt_in", (r, d.h), "mxfp4", mxfp4_bytes(r, d.h), {"moe_expert_ckpt"})
            else:
                led.add("moe.expert_ckpt_in", (r, d.h), "bf16", BF16 * r * d.h, {"moe_expert_ckpt"})
            if not recipe.fp8_compute:   # bf16: RecomputedSequentialMLP's checkpoint also keeps tokens_per_expert
                led.add("moe.expert_ckpt_counts", (d.e // d.ep,), "int64", INT64 * (d.e // d.ep), {"moe_expert_ckpt"})
        if scope == "attn_ln_mlp" and kind == "dense":
            # mlp checkpoint input = mlp.ln_out, already freed (fused norm: the layer's hidden state, mlp.ln_in)
            led.drop_prefix("mlp.", keep=("mlp.ln_in",))
        if scope == "attn_ln_mlp" and kind == "dense" and recipe.recompute_cache_fp4 and not a.fused_norm_linears:
            # the mlp checkpoint keeps its argument, the (discarded) pre-MLP norm output: an MXFP4 copy survives
            led.add("mlp.ckpt_in", (d.t_hid, d.h), "mxfp4", mxfp4_bytes(d.t_hid, d.h), {"mlp_ckpt"})
        if recipe.recompute_cache_fp4:
            # the norm checkpoints' inputs and core attention's checkpointed q, k, v are stored MXFP4
            # (fp4moe.model.recompute: every checkpoint inside a TransformerLayer)
            # (a fused dense pre-MLP norm has no checkpoint: its input stays BF16)
            for name in ("attn.ln_in", "moe.ln_in", "attn.q", "attn.k", "attn.v") + (
                    () if a.fused_norm_linears else ("mlp.ln_in",)):
                if name in led.t and a.attn_recompute == "core_attn" or name.endswith("ln_in") and name in led.t:
                    _to_mxfp4(led, name)
        return
    if scope == "mla_up_proj":
        # megatron's mla_up_proj checkpoint re-runs q_up / kv_up + RoPE from its inputs, the q/kv layernorm outputs
        # (kept: the norms stay outside it, with their inputs and 1/rms); under recompute_cache_fp4 those inputs are
        # stored MXFP4 (fp4moe.model.recompute). The up-projections' own saved inputs and q, k, v are freed.
        led.drop("attn.q_up_in_q", "attn.kv_up_in_q", "attn.q", "attn.k", "attn.v")
        if a.fused_norm_linears:
            # the q / kv norms are inside the up-projections, inside the checkpoint: it holds their inputs, the
            # latents (kv_latent with the RoPE key, a view of the same storage); the norms save nothing
            led.drop("attn.q_ln_rstd", "attn.q_ln_out", "attn.kv_ln_rstd", "attn.kv_ln_out")
            for name in ("attn.q_latent", "attn.kv_latent"):
                if name in led.t:
                    led.t[name].holders = {"mla_up_proj_ckpt"}
                    if recipe.recompute_cache_fp4:
                        _to_mxfp4(led, name)
            led.add("attn.rope_cos_sin", (d.seq, d.rope), "fp32", FP32 * d.seq * d.rope, {"mla_up_proj_ckpt"})
            return
        for name in ("attn.q_ln_out", "attn.kv_ln_out"):
            if name in led.t:
                led.t[name].holders = {"mla_up_proj_ckpt"}
                if recipe.recompute_cache_fp4:
                    _to_mxfp4(led, name)
        if recipe.recompute_cache_fp4:   # k_pos_emb: a view of kv_latent in BF16, its own MXFP4 copy here
            led.add("attn.k_pos_emb_ckpt", (d.t_tok, d.rope), "mxfp4", mxfp4_bytes(d.t_tok, d.rope),
                    {"mla_up_proj_ckpt"})
        # RoPE runs inside the checkpoint: it keeps the rotary frequencies [seq, rope] fp32, not cos and sin
        led.add("attn.rope_cos_sin", (d.seq, d.rope), "fp32", FP32 * d.seq * d.rope, {"mla_up_proj_ckpt"})
        return
    raise ValueError(f"unknown recompute scope {scope!r}: one of {SCOPES}")


def recipe_of(cfg: Any, recipe: Recipe | None = None) -> Recipe:
    """``recipe`` when the caller parsed it already (``Settings.precision``, or an enclosing function's), else
    ``cfg.precision`` parsed: each entry point of the scale model parses it once and passes it down."""
    return recipe if recipe is not None else Recipe.from_config(_as_cfg(cfg).precision)


def layer_saved_tensors(cfg: Any, kind: str, scope: str | None = None,
                        assumptions: MemoryAssumptions | None = None, recipe: Recipe | None = None) -> list[SavedTensor]:
    """Tensors one transformer layer of ``kind`` ('dense' | 'moe') saves for backward for ONE micro-batch under
    the config's recipe (``recipe``: already parsed, else ``cfg.precision``'s, :func:`recipe_of`) and ``scope``
    (default: the config's recompute scope)."""
    cfg = _as_cfg(cfg)
    a = _with_cfg_attention(cfg, assumptions or MemoryAssumptions())
    d = _dims(cfg, a.expert_rows_factor)
    recipe = recipe_of(cfg, recipe)
    scope = scope or _scope(cfg)
    led = _Ledger()
    _attention(led, d, recipe, a)
    if kind == "dense":
        _dense_mlp(led, d, recipe, a)
    elif kind == "moe":
        _moe(led, d, recipe, a)
    else:
        raise ValueError(f"kind={kind!r}: 'dense' or 'moe'")
    _apply_scope(led, kind, scope, d, recipe, a)
    return led.tensors()


# what P2's standalone MoE layer (fp4moe.moe.MoELayer) does not have of a transformer layer's MoE block: the pre-MLP
# norm's own saved tensors (its output is the layer's input, which the layer saves for its router and shared expert)
NOT_IN_STANDALONE_LAYER = ("moe.ln_in", "moe.ln_rstd")


def standalone_moe_layer_peak(cfg: Any, assumptions: MemoryAssumptions | None = None,
                              recipe: Recipe | None = None) -> tuple[int, str]:
    """(bytes, phase): the memory peak of P2's MoE layer (``fp4moe.moe.MoELayer``, recompute none) over one forward
    + backward as ``fp4moe.bench.moe_layer`` measures it, above its base (weights, the input x and the output gradient dy
    allocated before; every ``.grad`` None), for the config's MoE shape at ``micro_batch x seq_length`` tokens;
    phase 'backward' or 'forward', the larger:

        backward  at the routed experts' fc1 wgrad (``_expert_backward`` with the layer's own BF16 ``.grad`` and,
                  for bf16, fp4moe's grouped experts): the saved tensors less the layer's input (in the base) and
                  the shared expert's (its backward ran first), plus its weight gradients; the two [T, H] terms of
                  ``_expert_backward`` are here the layer's output and the shared expert's input gradient.
        forward   the saved tensors less the shared expert's (it runs last) and two [T*k, H] bf16 rows tensors, the
                  most MoELayer.forward holds at once besides what autograd saves (the experts' output and its
                  un-permuted copy, that copy and the combine's received one); an upper estimate, never the peak
                  at the shapes measured (results/scale/calibration.md).

    ``recipe``: the config's, already parsed (else parsed here once, :func:`recipe_of`).
    """
    cfg = _as_cfg(cfg)
    recipe = recipe_of(cfg, recipe)
    a = replace(assumptions or MemoryAssumptions(), main_grad_resident="after_first_micro_batch",
                bf16_experts="grouped")
    tensors = [t for t in layer_saved_tensors(cfg, "moe", "none", a, recipe)
               if t.name.startswith("moe.") and t.name not in NOT_IN_STANDALONE_LAYER + ("moe.ln_out",)]  # x: base
    d = _dims(cfg, a.expert_rows_factor)
    saved = sum(t.bytes for t in tensors)
    shared = sum(t.bytes for t in tensors if t.name.startswith("moe.shared_"))
    backward = saved - shared + _expert_backward(d, recipe, a) + a.param_bytes * 3 * d.h * d.fs
    forward = saved - shared + 2 * BF16 * d.rows * d.h
    return (backward, "backward") if backward >= forward else (forward, "forward")


def _head_tensors(d: _Dims) -> list[SavedTensor]:
    t = d.t_hid
    return [SavedTensor("head.ln_in", (t, d.h), "bf16", BF16 * t * d.h, {"final_ln"}),
            SavedTensor("head.ln_rstd", (t,), "fp32", FP32 * t, {"final_ln"}),
            SavedTensor("head.ln_out", (t, d.h), "bf16", BF16 * t * d.h, {"output_layer"}),
            SavedTensor("head.softmax", (d.t_tok, d.vocab // d.tp), "fp32", FP32 * d.t_tok * (d.vocab // d.tp),
                        {"cross_entropy"}),
            # megatron's vocab-parallel cross entropy also saves the masked target (int64) and the target mask (bool)
            SavedTensor("head.ce_target", (d.t_tok,), "int64+bool", (INT64 + 1) * d.t_tok, {"cross_entropy"})]


def _mtp_extra_tensors(d: _Dims) -> list[SavedTensor]:
    t = d.t_hid
    return [SavedTensor("mtp.enorm_in", (t, d.h), "bf16", BF16 * t * d.h, {"mtp.enorm"}),
            SavedTensor("mtp.hnorm_in", (t, d.h), "bf16", BF16 * t * d.h, {"mtp.hnorm"}),
            SavedTensor("mtp.eh_in", (t, 2 * d.h), "bf16", BF16 * t * 2 * d.h, {"mtp.eh_proj"})]


# ---------------------------------------------------------------------------------------------- (a) params

def _attn_params(d: _Dims) -> tuple[int, int]:
    """(matrix params, replicated norm params) of one MLA block."""
    qk = d.nope + d.rope
    if d.q_lora:
        q_mat, q_norm = d.h * d.q_lora + d.q_lora * d.n * qk, d.q_lora
    else:
        q_mat, q_norm = d.h * d.n * qk, 0
    kv_mat = d.h * (d.kv_lora + d.rope) + d.kv_lora * d.n * (d.nope + d.v)
    return q_mat + kv_mat + d.n * d.v * d.h, q_norm + d.kv_lora


def _stage_params(letters: str, first_layer: int, d: _Dims) -> tuple[float, float]:
    """(dense params, routed-expert params) held by one GPU of a stage with these layout letters."""
    attn_mat, attn_norm = _attn_params(d)
    dense, expert = 0.0, 0.0
    moe_dense = attn_mat / d.tp + attn_norm + 2 * d.h + d.h * d.e + 3 * d.h * d.fs / d.tp
    moe_expert = (d.e // d.ep) * 3 * d.h * d.f / d.etp
    layer = first_layer
    for c in letters:
        if c == "E":
            dense += d.vocab * d.h / d.tp
        elif c == "t":
            if layer < d.first_dense:
                dense += attn_mat / d.tp + attn_norm + 2 * d.h + 3 * d.h * d.ffn / d.tp
            else:
                dense += moe_dense
                expert += moe_expert
            layer += 1
        elif c == "m":  # MTP: enorm, hnorm, eh_proj, final norm, a MoE layer, and a copy of the embedding
            dense += 3 * d.h + 2 * d.h * d.h / d.tp + moe_dense + d.vocab * d.h / d.tp
            expert += moe_expert
        elif c == "L":
            dense += d.h + d.vocab * d.h / d.tp
    return dense, expert


def _fp8_matrix_bytes(n: int, k: int, any_shape: bool = False) -> int:
    """The cached FP8 copies of one [N, K] weight (fprop + dgrad data, their 128x128 FP32 scales, one per started
    block); 0 for a matrix that is not a multiple of 128 both ways (it stays BF16 in fp4moe:
    fp4moe.model.recipe_dense) unless ``any_shape`` (``MemoryAssumptions.fp8_any_shape``)."""
    if not n or not k or (not any_shape and (n % FP8_GROUP or k % FP8_GROUP)):
        return 0
    return 2 * n * k + 2 * 4 * (-(-n // FP8_GROUP)) * (-(-k // FP8_GROUP))


def _fp8_weight_cache_bytes(letters: str, first_layer: int, d: _Dims, recipe: Recipe, any_shape: bool = False) -> int:
    """``train.fp8_weight_cache``: bytes of the FP8 weight copies one GPU of a stage holds (every matrix the recipe
    computes in FP8; dense matrices / TP, expert matrices / ETP)."""
    if not recipe.fp8_compute:
        return 0
    qk = d.nope + d.rope
    attn = ([(d.q_lora, d.h), (d.n * qk, d.q_lora)] if d.q_lora else [(d.n * qk, d.h)]) + [
        (d.kv_lora + d.rope, d.h), (d.n * (d.nope + d.v), d.kv_lora), (d.h, d.n * d.v)]
    dense_on, shared_on = recipe.applies_to("dense"), recipe.applies_to("shared_expert")

    def mats(pairs, div):
        return sum(_fp8_matrix_bytes(n, k, any_shape) for n, k in pairs) // div

    attn_b = mats(attn, d.tp) if dense_on else 0
    shared_b = mats([(2 * d.fs, d.h), (d.h, d.fs)], d.tp) if shared_on and d.fs else 0
    expert_b = (d.e // d.ep) * mats([(2 * d.f, d.h), (d.h, d.f)], d.etp)
    out, layer = 0, first_layer
    for c in letters:
        if c == "t":
            if layer < d.first_dense:
                out += attn_b + (mats([(2 * d.ffn, d.h), (d.h, d.ffn)], d.tp) if dense_on else 0)
            else:
                out += attn_b + shared_b + expert_b
            layer += 1
        elif c == "m":  # an MTP layer: its eh_proj and a MoE transformer layer
            out += (mats([(d.h, 2 * d.h)], d.tp) if dense_on else 0) + attn_b + shared_b + expert_b
    return out


def _stages(cfg: DictConfig) -> list[str]:
    """The layout letters of every model chunk (``optimizer_state.stages``); a layout whose 'm' letters are not
    ``model.mtp_num_layers`` raises (the MTP layers come from the config, once)."""
    letters = optimizer_state.stages(cfg)
    n_mtp = int(cfg.model.get("mtp_num_layers", 0) or 0)
    if "".join(letters).count("m") != n_mtp:
        raise ValueError(f"parallel.pipeline_layout={cfg.parallel.get('pipeline_layout')!r} has "
                         f"{''.join(letters).count('m')} 'm' (MTP) layers but model.mtp_num_layers={n_mtp}: put "
                         f"{n_mtp} 'm' in the layout or set model.mtp_num_layers")
    return letters


# ---------------------------------------------------------------------------------------------- output

@dataclass
class Breakdown:
    """Predicted peak memory of one GPU (one pipeline rank, its most loaded data-parallel rank), by named component.
    Bytes in ``*_bytes``; GB (2**30 B) properties. ``allocated_bytes``: PyTorch's allocated peak (what calibration.md
    checks on 1-2 H200s); ``total_bytes``: that plus the memory outside it (part (f)), what nvidia-smi shows."""

    pipeline_rank: int
    stage_letters: str
    recipe: str
    scope: str
    in_flight: int                 # micro-batches (model chunks with vpp) whose activations are held
    params_bytes: int              # model weights (the distributed optimizer's padded parameter buffer)
    grads_bytes: int               # the DDP main-gradient buffer (FP32 or BF16)
    optimizer_bytes: int           # optimizer state on the GPU, this (most loaded) data-parallel rank's share
    activations_bytes: int         # in_flight x per-micro-batch saved activations of this stage
    a2a_buffers_bytes: int         # send + receive of the largest all-to-all of a MoE layer (transient)
    recompute_transient_bytes: int  # tensors the scope recomputes, for one layer and micro-batch (transient)
    per_microbatch_activation_bytes: int
    dense_params: float
    expert_params: float
    tensors: list = field(default_factory=list, repr=False)   # (layer letter/index, SavedTensor) per micro-batch
    # BF16 [T, V/TP] logits beside the saved fp32 softmax: the output at the end of the forward, or its gradient
    # at the start of the backward (the stage with the head only; transient)
    loss_transient_bytes: int = 0
    # tensors live at the routed experts' backward peak besides the saved ones (module docstring, (e); 0 without MoE)
    expert_backward_bytes: int = 0
    # the head's saved tensors (fp32 softmax, final norm): not allocated yet in the last MoE layer's forward and
    # freed before its backward (0 on a stage without the head)
    head_saved_bytes: int = 0
    # activations alive besides the saved ones, all micro-batches in flight (MemoryAssumptions.norm_cache_keeps_bf16)
    held_bytes: int = 0
    # the backward phase at the MoE layer where it is largest, relative to the last one: BF16 gradients of the
    # parameters after that layer (fp4moe.train without pipelining keeps each .grad until the step) minus the saved
    # activations of the layers after it (freed by then); > 0 when the scope saves little (full), else 0
    backward_depth_bytes: int = 0
    # the FP8 weight copies of train.fp8_weight_cache or TE's weight workspaces (part (a)); 0 without either
    fp8_weight_cache_bytes: int = 0
    optimizer_mean_bytes: int = 0  # optimizer state on the GPU, mean over the stage's data-parallel ranks
    optimizer_host_bytes: int = 0  # the offloaded optimizer state in host memory (this rank's; not in the totals)
    # (f) outside PyTorch's allocated bytes
    cuda_context_bytes: int = 0
    nccl_bytes: int = 0
    deepep_bytes: int = 0
    allocator_gap_bytes: int = 0

    @property
    def phases(self) -> dict[str, int]:
        """Transient bytes above static + saved at each candidate peak (module docstring, (e)); negative: that
        phase holds less than all saved activations (the head's are not live there)."""
        out = {"backward": self.expert_backward_bytes + self.recompute_transient_bytes - self.head_saved_bytes
               + self.backward_depth_bytes}
        if self.a2a_buffers_bytes:
            out["moe_forward"] = self.a2a_buffers_bytes - self.head_saved_bytes
        if self.loss_transient_bytes:
            out["head"] = self.loss_transient_bytes
        return out

    @property
    def peak_phase(self) -> str:
        """Where the predicted peak is: 'head', 'moe_forward' or 'backward'."""
        ph = self.phases
        return max(ph, key=ph.get)

    @property
    def transient_bytes(self) -> int:
        """The largest phase transient (may be negative: see ``phases``)."""
        return max(self.phases.values())

    @property
    def allocated_bytes(self) -> int:
        """PyTorch's allocated peak (``torch.cuda.max_memory_allocated``), parts (a)-(e)."""
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.fp8_weight_cache_bytes
                + self.activations_bytes + self.held_bytes + self.transient_bytes)

    @property
    def outside_torch_bytes(self) -> int:
        """Part (f): CUDA context + NCCL + DeepEP buffers + the allocator's reserved - allocated."""
        return self.cuda_context_bytes + self.nccl_bytes + self.deepep_bytes + self.allocator_gap_bytes

    @property
    def total_bytes(self) -> int:
        """What nvidia-smi shows at the peak: allocated + outside PyTorch's allocated bytes."""
        return self.allocated_bytes + self.outside_torch_bytes

    @property
    def mean_total_bytes(self) -> int:
        """``total_bytes`` averaged over the stage's data-parallel ranks (their optimizer shares differ)."""
        return self.total_bytes - self.optimizer_bytes + self.optimizer_mean_bytes

    @property
    def total_gb(self) -> float:
        return self.total_bytes / GB

    @property
    def allocated_gb(self) -> float:
        return self.allocated_bytes / GB

    def fits(self, gpu_memory_gb: float) -> bool:
        """Whether the predicted peak (``total_bytes``) is at most ``gpu_memory_gb`` GB (2**30 B); no margin."""
        return self.total_gb <= gpu_memory_gb

    def gb(self, component: str) -> float:
        """One component in GB (2**30 B): any ``<name>_bytes`` field or property (params, grads, optimizer,
        activations, transient, allocated, outside_torch, total, ...)."""
        return getattr(self, f"{component}_bytes") / GB

    def table(self) -> list[tuple[str, float]]:
        """(component, GB) rows: the allocated parts, the peak's transient (its phase), the allocated peak, the
        parts outside PyTorch, the total; then the terms the phases are made of (not added again)."""
        labels = {"params": "params", "activations": f"activations ({self.in_flight} in flight)",
                  "transient": f"transient at the peak ({self.peak_phase.replace('_', ' ')})"}
        rows = [(labels.get(c, c.replace("_", " ")), self.gb(c)) for c in COMPONENTS
                if c != "fp8_weight_cache" or self.fp8_weight_cache_bytes]
        rows += [("allocated (max_memory_allocated)", self.allocated_gb)]
        rows += [(c.replace("_", " "), self.gb(c)) for c in OUTSIDE_TORCH]
        parts = [(f"  of which: {c.replace('_', ' ')}", self.gb(c)) for c in PHASE_TERMS]
        return rows + [("total (nvidia-smi)", self.total_gb)] + parts


# what allocated_bytes adds; what outside_torch_bytes adds; the phase terms the transient is the largest combination of
COMPONENTS = ("params", "grads", "optimizer", "fp8_weight_cache", "activations", "held", "transient")
OUTSIDE_TORCH = ("cuda_context", "nccl", "deepep", "allocator_gap")
PHASE_TERMS = ("loss_transient", "a2a_buffers", "expert_backward", "recompute_transient", "head_saved")


def _a2a_buffer_bytes(d: _Dims, recipe: Recipe) -> int:
    r = d.t_tok * d.k
    disp = (d.h // 2 + d.h // MX_BLOCK) if recipe.dispatch_fp4 else BF16 * d.h
    bwd = (d.h + FP8_SCALE_BYTES * d.h // FP8_GROUP) if recipe.backward_a2a == "fp8" else BF16 * d.h
    rows = max(disp + FP32, BF16 * d.h, bwd)
    return 2 * r * rows  # send + receive


def _expert_backward(d: _Dims, recipe: Recipe, a: MemoryAssumptions, recomputed: int = 0) -> int:
    """Bytes live at the routed experts' backward peak besides the saved tensors, one MoE layer and micro-batch,
    with ``recomputed`` bytes of the experts' own tensors rebuilt by an attn_ln_experts checkpoint (module
    docstring, (e)). Includes the layer's output and input gradients (2 x [T, H] bf16)."""
    r = d.rows
    h, f = d.h, d.f // d.etp
    grads = 2 * BF16 * d.t_hid * d.h
    rows_h = BF16 * r * h                      # one [R, H] bf16 buffer
    # the layer's own expert weight gradients (autograd's .grad, in the parameters' dtype) in fp4moe's grouped
    # experts: fc2's [E_local, H, F] exists from fc2's backward on, fc1's [E_local, 2F, H] once fc1's wgrad has run
    # (fp4moe.train keeps every .grad until the step; seen in the full-recompute memory traces). With a resident
    # main-gradient buffer ('always', megatron's DDP) each .grad is folded into it as soon as it is made: only fc1's,
    # the output of the wgrad GEMM running, is live then.
    if a.te_grouped_experts:
        return _te_expert_backward(d, recipe, a, recomputed) + grads
    e_local = d.e // d.ep
    dw2, dw1 = a.param_bytes * e_local * h * f, a.param_bytes * e_local * 2 * f * h
    if a.main_grad_resident == "always":
        dw2 = 0
    dh = BF16 * r * 2 * f
    if not recipe.fp8_compute and a.bf16_experts == "grouped":
        # fp4moe's grouped experts on BF16 (fc1's wgrad is the larger): dY, dH, dX, dW2, dW1 (its output) and one
        # expert's [2F, H] product before it is copied into dW1
        live = rows_h + dh + rows_h + dw2 + dw1 + BF16 * 2 * f * h
        return live + (recomputed + rows_h if recomputed else 0) + grads
    if not recipe.fp8_compute:
        # megatron's SequentialMLP: dY, the per-expert dX pieces, their concatenation; under attn_ln_experts the
        # recomputation's forward ends with the recomputed outputs' pieces and their concatenation beside dY. No
        # expert weight gradients: bf16's traced peaks (its H200 memory traces) are at the head or in a
        # recomputed forward, before the layer's own gradients exist, and the head peaks sit within 0.2 % of this
        # phase as it is
        backward = 3 * rows_h
        recompute_fwd = rows_h + recomputed + 2 * rows_h if recomputed else 0
        return max(backward, recompute_fwd) + grads
    _, _, mp = _expert_rows(d, a.expert_padding, a.expert_counts)

    def fp8_col(k: int) -> int:                # an FP8 column copy [k, Mp] + its 1x128 scales
        return k * mp + FP8_SCALE_BYTES * k * mp // FP8_GROUP

    dh_rows = r * 2 * f + FP8_SCALE_BYTES * r * (2 * f // FP8_GROUP)
    dgrad = rows_h + dh + dh_rows + rows_h + dw2  # fc1's dgrad: dY, dH, dH's FP8 rows, dX (its output), dW2
    # fc1's wgrad, after it: dY, dH, dX, dH's FP8 column copy, x's FP8 column copy when x was saved as MXFP4
    # (rebuilt by FP4RowToFP8Col; an FP8 recipe saved it, counted in the saved bytes), dW2 and dW1 (its output)
    x_col = fp8_col(h) if (recipe.expert_input_fp4 or recipe.save_fp4) else 0
    wgrad = rows_h + dh + rows_h + fp8_col(2 * f) + x_col + dw2 + dw1
    if a.expert_backward_keeps_dead:
        dead = BF16 * r * f + (BF16 * r * 2 * f if recipe.activation_fp4_store else 0)  # dZ, the decoded H
        dgrad += rows_h + dead                 # + the GEMM wrapper's unused output buffer
        wgrad += dead
    live = max(dgrad, wgrad)
    if recomputed:
        live += recomputed + rows_h            # + the checkpoint's recomputed output, held through its backward
    return live + grads


def _te_expert_backward(d: _Dims, recipe: Recipe, a: MemoryAssumptions, recomputed: int = 0) -> int:
    """``_expert_backward`` of TE's grouped MLP (``MemoryAssumptions.te_grouped_experts``; module docstring, (e)),
    without the two [T, H] layer gradients: the largest of fc2's, the SwiGLU's and fc1's backward, each holding its
    input gradient, that gradient's FP8 rows + columns (FP8 recipes: TE's split_quantize for dgrad and wgrad) and its
    output gradient; weight gradients go into the main-gradient buffer. Under an attn_ln_experts checkpoint dY is
    held throughout, with ``recomputed`` bytes and the recomputed output [R, H]."""
    r, h, f = d.rows, d.h, d.f // d.etp
    _, _, mp = _expert_rows(d, a.expert_padding, a.expert_counts)
    dy, dz, dh = BF16 * r * h, BF16 * r * f, BF16 * r * 2 * f
    quant = recipe.fp8_compute
    fc2 = dy + (fp8_row_col_bytes(r, h, mp) if quant else 0) + dz
    swiglu = dz + (dh if recipe.activation_fp4_store else 0) + dh   # the decoded H beside dH when stored MXFP4
    x_col = fp8_col_bytes(r, h, mp) if quant and (recipe.expert_input_fp4 or recipe.save_fp4) else 0
    fc1 = dh + (fp8_row_col_bytes(r, 2 * f, mp) if quant else 0) + dy + x_col   # dX: an [R, H] bf16 like dY
    if not recomputed:
        return max(fc2, swiglu, fc1)
    return max(fc2, swiglu + dy, fc1 + dy) + recomputed + dy   # + the recomputed output [R, H], held throughout


def _norm_recompute(d: _Dims, recipe: Recipe, scope: str) -> int:
    """Bytes the pre-MLP norm's output-discarding checkpoint holds through the MoE layer's backward under the
    attn_ln_* scopes (module docstring, "Recompute transient"): megatron's ``CheckpointWithoutOutput._recompute``
    keeps its recomputation's output [T, H] and refills the discarded output's storage with a copy (2 x [T, H]
    bf16), and runs on the decoded input [T, H] bf16 when the cache is MXFP4 (``recompute_cache_fp4``)."""
    if scope not in ("attn_ln_experts", "attn_ln_mlp"):
        return 0
    return (3 if recipe.recompute_cache_fp4 else 2) * BF16 * d.t_hid * d.h


def _moe_recomputed(none_moe: list[SavedTensor], scoped: list[SavedTensor], scope: str, d: _Dims) -> int:
    """Bytes an attn_ln_experts / full checkpoint rebuilds of a MoE layer that are live at its experts' backward
    (module docstring, "Recompute transient"); 0 for the other scopes."""
    none = {t.name: t for t in none_moe}
    if scope == "attn_ln_experts":
        kept = {t.name: t for t in scoped}["moe.expert_ckpt_in"]
        fc1 = none["moe.expert_fc1_in"]
        return (none["moe.expert_swiglu_in"].bytes + none["moe.expert_fc2_in"].bytes
                + (fc1.bytes if fc1.fmt != kept.fmt else 0))
    if scope == "full":
        return sum(t.bytes for t in none_moe) - sum(t.bytes for t in scoped) + BF16 * d.t_hid * d.h
    return 0


def _backward_depth(letters: str, first_layer: int, d: _Dims, tensors: list, a: MemoryAssumptions,
                    scope: str = "") -> int:
    """``Breakdown.backward_depth_bytes`` of a single-stage run (module docstring, (e)): the largest, over the MoE
    layers, of BF16 gradients of the parameters after the layer minus the saved activations of the transformer
    layers after it, relative to the last MoE layer. The gradients count 0 when the FP32 main gradients take every
    gradient as it is made (``main_grad_resident='always'``: counted in the grads). With
    ``dispatcher_keeps_recompute_graph`` under full recompute, the MoE layers after it free nothing and all but the
    next one keep their input gradient [T, H] too."""
    keeps = a.dispatcher_keeps_recompute_graph and scope == "full"
    if a.main_grad_resident == "always" and not keeps:
        return 0
    saved: dict[int, int] = {}
    for tag, t in tensors:
        if tag.startswith("t"):
            saved[int(tag[1:])] = saved.get(int(tag[1:]), 0) + t.bytes
    layer, depth = first_layer, []   # per MoE layer: gradients made before its backward - activations freed
    for j, c in enumerate(letters):
        if c != "t":
            continue
        if layer >= d.first_dense:
            dn, ex = _stage_params(letters[j + 1:], layer + 1, d)
            grads = 0 if a.main_grad_resident == "always" else round((dn + ex) * a.param_bytes)
            later_moe = [k for k in saved if k > layer and k >= d.first_dense]
            freed = sum(b for k, b in saved.items() if k > layer and not (keeps and k in later_moe))
            kept_grads = BF16 * d.t_hid * d.h * max(0, len(later_moe) - 1) if keeps else 0
            depth.append(grads - freed + kept_grads)
        layer += 1
    return max(depth) - depth[-1] if depth else 0


def _state_key(cfg: DictConfig, a: MemoryAssumptions) -> tuple[str, int]:
    """What :func:`_rank_state_of` reads of ``cfg``, as a key (the same model / layout / optimizer gives the same
    bytes whatever the recipe, but the expert order, bf16 or not, and the recompute scope), and the parameters'
    bytes per element."""
    params_bytes = 4 if str(cfg.get("train", {}).get("params_dtype", "bf16")) == "fp32" else a.param_bytes
    key = {g: OmegaConf.to_container(cfg[g], resolve=True) if cfg.get(g) is not None else None
           for g in ("model", "parallel", "optimizer")}
    key["precision"] = {"name": str(cfg.get("precision", {}).get("name", "bf16"))}
    return json.dumps(key, sort_keys=True), params_bytes


@functools.lru_cache(maxsize=1024)
def _rank_state_of(key: str, chunks: tuple[int, ...], params_bytes: int) -> tuple[optimizer_state.RankBytes, int, int]:
    """(the most loaded data-parallel rank's RankBytes summed over its model ``chunks``, the mean over the
    data-parallel ranks of their optimizer state on the GPU, that rank's state in host memory), for the config
    :func:`_state_key` made ``key`` of. Data-parallel rank r of a stage is expert-data-parallel rank r // EP
    (megatron's rank order with TP = CP = 1)."""
    cfg = OmegaConf.create(json.loads(key))
    dp, ep = int(cfg.parallel.data) * int(cfg.parallel.context), int(cfg.parallel.expert)
    by_chunk = [optimizer_state.ranks_bytes(cfg, i, [(r, r // ep) for r in range(dp)], params_bytes=params_bytes)
                for i in chunks]
    per_rank = [optimizer_state.RankBytes(*(sum(getattr(c[r], f) for c in by_chunk) for f in
                                            ("params", "grads", "state_device", "state_host"))) for r in range(dp)]
    top = max(per_rank, key=lambda x: (x.params + x.grads + x.state_device, x.state_host))
    return top, round(sum(x.state_device for x in per_rank) / dp), top.state_host


def _outside_torch(cfg: DictConfig, d: _Dims, a: MemoryAssumptions, has_moe: bool, rank: int) -> dict[str, int]:
    """Part (f) for one GPU, by field (fp4moe.scale.outside_torch: how each term scales)."""
    deepep = a.deepep_buffers and has_moe and d.ep > 1
    terms = {"cuda_context_bytes": a.cuda_context_bytes,
             "nccl_bytes": outside_torch.nccl_bytes(cfg, a.nccl_communicator_bytes, a.nccl_peer_bytes,
                                                    a.nccl_p2p_peer_bytes, nccl_all_to_all=not a.deepep_buffers,
                                                    pipeline_rank=rank),
             "deepep_bytes": outside_torch.deepep_buffer_bytes(d.h, d.ep) if deepep else 0,
             "allocator_gap_bytes": outside_torch.allocator_gap(a.allocator_gap_bytes, a.allocator_gap_ref_elements,
                                                                d.t_tok, d.h)}
    return {k: round(v * a.outside_torch_scale) for k, v in terms.items()}


def per_stage_memory(cfg: Any, assumptions: MemoryAssumptions | None = None,
                     recipe: Recipe | None = None) -> list[Breakdown]:
    """One ``Breakdown`` per pipeline rank (see the module docstring for every term). ``recipe``: the config's,
    already parsed (``Settings.precision``; else parsed here once, :func:`recipe_of`)."""
    cfg = _as_cfg(cfg)
    a = _with_cfg_attention(cfg, assumptions or MemoryAssumptions())
    p = cfg.parallel
    d = _dims(cfg, a.expert_rows_factor)
    recipe = recipe_of(cfg, recipe)
    scope = _scope(cfg)
    pp, vpp = int(p.pipeline), int(p.get("virtual_pipeline") or 1)
    micro = int(p.micro_batch) * int(p.data)
    n_micro = max(1, int(p.global_batch) // micro)
    stages = _stages(cfg)
    weight_cache = bool(OmegaConf.select(cfg, "train.fp8_weight_cache", default=False)) or a.fp8_weight_workspaces
    if len(stages) != pp * vpp:
        raise ValueError(f"{len(stages)} pipeline stages for pipeline x virtual_pipeline = {pp * vpp}")
    # first transformer-layer index of every stage
    firsts, idx = [], 0
    for s in stages:
        firsts.append(idx)
        idx += s.count("t")
    per_layer = {kind: layer_saved_tensors(cfg, kind, scope, a, recipe) for kind in ("dense", "moe")}
    none_layer = {kind: layer_saved_tensors(cfg, kind, "none", a, recipe) for kind in ("dense", "moe")}
    size = {k: sum(t.bytes for t in v) for k, v in per_layer.items()}
    # dense layer: what its scope recomputes; MoE layer: what is live at its experts' backward (part (e))
    dense_transient = sum(t.bytes for t in none_layer["dense"]) - size["dense"] + 2 * BF16 * d.t_hid * d.h
    moe_recomputed = _moe_recomputed(none_layer["moe"], per_layer["moe"], scope, d)
    expert_recomputed = moe_recomputed if scope == "attn_ln_experts" else 0
    expert_bwd = _expert_backward(d, recipe, a, expert_recomputed)
    moe_rec = (0 if scope == "attn_ln_experts" else moe_recomputed) + _norm_recompute(d, recipe, scope)  # (ale:
    # the experts' recomputed tensors are inside expert_bwd)

    def chunk(i: int):
        letters, layer = stages[i], firsts[i]
        tensors, trans, has_moe = [], 0, False
        for c in letters:
            if c == "t":
                kind = "dense" if layer < d.first_dense else "moe"
                tensors += [(f"t{layer}", x) for x in per_layer[kind]]
                if kind == "dense":
                    trans = max(trans, dense_transient)
                has_moe |= kind == "moe"
                layer += 1
            elif c == "m":
                tensors += [("m", x) for x in per_layer["moe"] + _mtp_extra_tensors(d) + _head_tensors(d)]
                has_moe = True
            elif c == "L":
                tensors += [("L", x) for x in _head_tensors(d)]
            elif c == "E":
                tensors.append(("E", SavedTensor("embed.ids", (d.t_tok,), "int64", INT64 * d.t_tok, {"embedding"})))
        return tensors, trans, has_moe

    state_key, params_bytes = _state_key(cfg, a)
    out = []
    for rank in range(pp):
        chunks = [rank + j * pp for j in range(vpp)]
        dense_p = expert_p = 0.0
        tensors, trans, has_moe, act_sum, wcache = [], 0, False, 0, 0
        for i in chunks:
            if weight_cache:
                wcache += _fp8_weight_cache_bytes(stages[i], firsts[i], d, recipe, a.fp8_any_shape)
            dn, ex = _stage_params(stages[i], firsts[i], d)
            dense_p, expert_p = dense_p + dn, expert_p + ex
            ts, tr, hm = chunk(i)
            tensors += ts
            trans, has_moe = max(trans, tr), has_moe or hm
            act_sum += sum(x.bytes for _, x in ts)
        if vpp == 1:
            in_flight = min(pp - rank, n_micro)
            per_mb = act_sum
        else:
            in_flight = min((pp - rank - 1) * 2 + (vpp - 1) * pp + 1, n_micro * vpp)
            per_mb = act_sum // vpp  # mean over the rank's chunks
        held, held_mean, host = _rank_state_of(state_key, tuple(chunks), params_bytes)
        if a.main_grad_resident == "after_first_micro_batch" and n_micro == 1:
            held = replace(held, grads=0)
        has_head = any("L" in stages[i] or "m" in stages[i] for i in chunks)
        head_saved = sum(x.bytes for x in _head_tensors(d)) if has_head else 0
        n_layers = sum(stages[i].count("t") + stages[i].count("m") for i in chunks)
        held_per_mb = (2 * BF16 * d.t_hid * d.h * n_layers if a.norm_cache_keeps_bf16 and recipe.recompute_cache_fp4
                       and scope in ("attn_ln_experts", "attn_ln_mlp") else 0)
        depth = _backward_depth(stages[chunks[0]], firsts[chunks[0]], d, tensors, a, scope) if pp == 1 and vpp == 1 else 0
        out.append(Breakdown(
            pipeline_rank=rank, stage_letters="|".join(stages[i] for i in chunks), recipe=recipe.name, scope=scope,
            in_flight=in_flight, params_bytes=held.params, grads_bytes=held.grads, optimizer_bytes=held.state_device,
            fp8_weight_cache_bytes=wcache,
            activations_bytes=in_flight * per_mb, held_bytes=in_flight * held_per_mb // max(1, vpp),
            a2a_buffers_bytes=_a2a_buffer_bytes(d, recipe) if has_moe else 0,
            recompute_transient_bytes=moe_rec if has_moe else trans,
            per_microbatch_activation_bytes=per_mb, dense_params=dense_p, expert_params=expert_p, tensors=tensors,
            loss_transient_bytes=BF16 * d.t_tok * (d.vocab // d.tp) if has_head else 0,
            expert_backward_bytes=expert_bwd if has_moe else 0, head_saved_bytes=head_saved,
            backward_depth_bytes=depth if has_moe else 0, optimizer_mean_bytes=held_mean, optimizer_host_bytes=host,
            **_outside_torch(cfg, d, a, has_moe, rank)))
    return out


def per_gpu_memory(cfg: Any, assumptions: MemoryAssumptions | None = None,
                   pipeline_rank: int | None = None, recipe: Recipe | None = None) -> Breakdown:
    """Predicted peak memory of one GPU: the pipeline rank with the largest total (or ``pipeline_rank``);
    ``recipe`` as :func:`per_stage_memory`'s."""
    stages = per_stage_memory(cfg, assumptions, recipe)
    if pipeline_rank is not None:
        return stages[pipeline_rank]
    return max(stages, key=lambda b: b.total_bytes)


def mean_total_bytes(stages: list[Breakdown]) -> int:
    """What nvidia-smi shows at the peak, averaged over every GPU of the job (pipeline ranks x their data-parallel
    ranks; every stage has the same number of data-parallel ranks)."""
    return round(sum(b.mean_total_bytes for b in stages) / len(stages))


__all__ = ["GB", "LAB_STACK", "SCOPES", "Breakdown", "MemoryAssumptions", "SavedTensor", "compose_cfg", "experiment_cfg",
           "fp8_col_bytes", "fp8_row_col_bytes", "layer_saved_tensors", "mean_total_bytes", "mxfp4_bytes", "NOT_IN_STANDALONE_LAYER",
           "per_gpu_memory", "per_stage_memory", "recipe_of", "standalone_moe_layer_peak"]
