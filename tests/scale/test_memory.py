"""The paper-scale memory / all-to-all model (fp4moe.scale, issue 6 P5): hand-checked small configs, orderings
that hold by construction, payload ratios, and a T1 *report* (structural checks only, no paper numbers).

Fast: configs and arithmetic only (the cross-checks against fp4moe.ops import torch and skip without it).
"""
import math
from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from fp4moe.config import param_counts
from fp4moe.scale import comm, memory, optimizer_state, outside_torch
from fp4moe.scale.memory import (SCOPES, MemoryAssumptions, _dims, _stage_params, compose_cfg, layer_saved_tensors,
                                 mean_total_bytes, per_gpu_memory, per_stage_memory)

# the model's terms outside PyTorch set to 0 (whatever the H200 measurement file says): the allocated parts alone
NO_OUTSIDE = MemoryAssumptions(cuda_context_bytes=0, nccl_communicator_bytes=0, nccl_peer_bytes=0,
                               allocator_gap_bytes=0)

RECIPES = ("bf16", "fp8", "mxfp4")
PAPER_SCOPES = ("attn_ln_experts", "attn_ln_mlp", "mla_up_proj")


def _cfg(model="tiny_cpu", parallel="cpu", recompute="none", precision="bf16", optimizer="gpu_fp32", **par):
    cfg = compose_cfg(model, parallel, recompute, precision, optimizer)
    for k, v in par.items():
        cfg.parallel[k] = v
    return cfg


def _layer_bytes(cfg, kind, scope=None, **kw):
    return sum(t.bytes for t in layer_saved_tensors(cfg, kind, scope, MemoryAssumptions(**kw)))


# ---------------------------------------------------------------------------------------------- tiny by hand
# tiny_cpu: H 256, 4 heads, q_lora 128, kv_lora 128, nope 32, rope 32, v 32, dense ffn 512, 8 experts top-2,
# moe ffn 128, 1 shared, vocab 512, layers: 0 dense, 1 MoE. parallel=cpu: micro 2 x seq 128 -> T = 256 tokens.
H, NH, QL, KVL, NOPE, ROPE, V, FFN, E, K, F, FS, VOCAB = 256, 4, 128, 128, 32, 32, 32, 512, 8, 2, 128, 128, 512
SEQ = 128
T = 2 * SEQ
R = T * K
DW1, DW2 = 2 * E * 2 * F * H, 2 * E * H * F   # one MoE layer's expert weight gradients, BF16 (EP 1: all 8 local)
ROPE_CACHE = 2 * SEQ * ROPE * 4      # cos + sin [seq, rope] fp32 per layer, independent of the micro-batch

ATTN_MAT = (H * QL + QL * NH * (NOPE + ROPE)) + (H * (KVL + ROPE) + KVL * NH * (NOPE + V)) + NH * V * H
ATTN_NORMS = QL + KVL
DENSE_LAYER = ATTN_MAT + ATTN_NORMS + 2 * H + 3 * H * FFN
MOE_LAYER = ATTN_MAT + ATTN_NORMS + 2 * H + H * E + 3 * H * F * 1 + E * 3 * H * F
EMBED, HEAD = VOCAB * H, VOCAB * H + H

# bf16, no recompute, one micro-batch
ATTN_ACT = (2 * T * H + 4 * T + 2 * T * H            # input norm: in, rstd, out (q_down/kv_down input)
            + 2 * T * QL + 4 * T + 2 * T * QL        # q latent, q_ln rstd, q_up input
            + 2 * T * (KVL + ROPE) + 4 * T + 2 * T * KVL   # kv latent (+ rope key), kv_ln rstd, kv_up input
            + 2 * T * NH * (NOPE + ROPE) * 2 + 2 * T * NH * V   # q, k, v
            + 2 * T * NH * V + 4 * NH * T            # o, lse
            + ROPE_CACHE)
DENSE_MLP_ACT = 2 * T * H + 4 * T + 2 * T * H + 2 * T * 2 * FFN + 2 * T * FFN
# router: scores, aux scores [T,E] fp32; 2 x top-k indices [T,K] int64; top-k probs [T,K] fp32; 2 x [T] fp32;
# routing map [E,T] bool, routing probs [E,T] fp32; the permutation index [R] int64 (x2 with an MXFP4 dispatch);
# the sequence aux loss's per-sequence load and score sums [micro-batch 2, E] fp32 x 2
ROUTER = 4 * T * E * 2 + 8 * T * K * 2 + 4 * T * K + 4 * T * 2 + E * T + 4 * E * T + 8 * R + 4 * 2 * E * 2
MOE_ACT = (2 * T * H + 4 * T + 2 * T * H             # pre-MLP norm in, rstd, out (router input)
           + ROUTER                                  # router + dispatcher
           + 2 * R * H + 2 * R * 2 * F + 2 * R * F + 4 * R   # experts fc1 in, SwiGLU in, fc2 in, probs
           + 2 * T * 2 * FS + 2 * T * FS)            # shared SwiGLU in, fc2 in (fc1 input = the norm output)
HEAD_ACT = 2 * T * H + 4 * T + 2 * T * H + 4 * T * VOCAB + 9 * T   # + masked target int64, target mask bool
EMBED_ACT = 8 * T


def test_tiny_params_by_hand():
    assert EMBED + DENSE_LAYER + MOE_LAYER + HEAD == param_counts(OmegaConf.load(memory.CONF / "model/tiny_cpu.yaml"))["total"]
    b = per_gpu_memory(_cfg())
    n = EMBED + DENSE_LAYER + MOE_LAYER + HEAD
    assert b.dense_params + b.expert_params == n
    assert b.params_bytes == 2 * n and b.grads_bytes == 4 * n
    assert b.optimizer_bytes == 12 * n          # parallel=cpu: no distributed optimizer -> unsharded


def test_tiny_activations_by_hand():
    cfg = _cfg()
    assert _layer_bytes(cfg, "dense") == ATTN_ACT + DENSE_MLP_ACT
    assert _layer_bytes(cfg, "moe") == ATTN_ACT + MOE_ACT
    b = per_gpu_memory(cfg)
    assert b.in_flight == 1  # PP = 1
    assert b.activations_bytes == EMBED_ACT + 2 * ATTN_ACT + DENSE_MLP_ACT + MOE_ACT + HEAD_ACT
    assert b.a2a_buffers_bytes == 2 * R * (2 * H + 4)  # send + receive of the dispatch (bf16 rows + fp32 prob)
    assert b.recompute_transient_bytes == 0 and b.held_bytes == 0
    assert b.loss_transient_bytes == 2 * T * VOCAB   # the BF16 logits (or their gradient) beside the fp32 softmax
    # megatron's SequentialMLP backward: dY, the per-expert dX pieces, their concatenation + 2 [T, H] layer gradients
    # (no expert weight gradients for bf16, under either gradient setup: memory.py's _expert_backward says why)
    assert b.expert_backward_bytes == 3 * 2 * R * H + 2 * 2 * T * H
    trainer = MemoryAssumptions(main_grad_resident="after_first_micro_batch")
    assert per_gpu_memory(cfg, trainer).expert_backward_bytes == b.expert_backward_bytes
    assert b.head_saved_bytes == HEAD_ACT
    assert b.phases == {"head": 2 * T * VOCAB, "moe_forward": b.a2a_buffers_bytes - HEAD_ACT,
                        "backward": b.expert_backward_bytes - HEAD_ACT}
    assert b.peak_phase == "head"   # the tiny model's vocabulary is large next to its experts
    assert b.allocated_bytes == (b.params_bytes + b.grads_bytes + b.optimizer_bytes + b.activations_bytes
                                 + 2 * T * VOCAB)
    assert b.total_bytes == b.allocated_bytes + b.outside_torch_bytes
    assert math.isclose(b.total_gb, b.total_bytes / 2**30) and math.isclose(b.allocated_gb, b.allocated_bytes / 2**30)
    labels = [r[0] for r in b.table()]
    i = labels.index("allocated (max_memory_allocated)")
    assert labels[i - 1] == "transient at the peak (head)" and labels[i + 5] == "total (nvidia-smi)"
    assert b.fits(b.total_gb) and not b.fits(b.total_gb * 0.999)  # the measured outside-PyTorch terms included


def test_expert_backward_by_hand():
    """What is live in fp4moe's grouped experts' backward (fp8, mxfp4), besides the saved tensors, at the larger of
    fc1's dgrad, dY [R, H], dH [R, 2F] and its FP8 rows (+ one fp32 scale per 128), dX [R, H], and fc1's wgrad,
    dY, dH, dX, dH's FP8 column copy [2F, Mp], (mxfp4, x saved as MXFP4) x's [H, Mp] and its output dW1, + the
    layer's 2 [T, H] gradients; fp4moe.train, which keeps every .grad until the step, adds fc2's dW2 to both. The
    code measured up to 38f25cd also kept an unused [R, H] GEMM output (dgrad), dZ [R, F] and (mxfp4) the decoded H
    [R, 2F]."""
    grads = 2 * 2 * T * H
    mp = E * 128                       # balanced routing: R / E = 64 rows per expert, padded to 128
    col = lambda k: k * mp + 4 * k * mp // 128   # noqa: E731  (an FP8 column copy + its scales)
    dgrad = 2 * R * H + 2 * R * 2 * F + (R * 2 * F + 4 * R * 2 * F // 128) + 2 * R * H
    wgrad = {"fp8": 2 * R * H + 2 * R * 2 * F + 2 * R * H + col(2 * F) + DW1}
    wgrad["mxfp4"] = wgrad["fp8"] + col(H)
    dead = {"fp8": 2 * R * F, "mxfp4": 2 * R * F + 2 * R * 2 * F}
    for rec in ("fp8", "mxfp4"):
        cfg = _cfg(precision=rec)
        assert per_gpu_memory(cfg).expert_backward_bytes == max(dgrad, wgrad[rec]) + grads
        old = per_gpu_memory(cfg, MemoryAssumptions(expert_backward_keeps_dead=True))
        assert old.expert_backward_bytes == max(dgrad + 2 * R * H, wgrad[rec]) + dead[rec] + grads
        trainer = MemoryAssumptions(main_grad_resident="after_first_micro_batch")
        assert per_gpu_memory(cfg, trainer).expert_backward_bytes == max(dgrad, wgrad[rec]) + DW2 + grads
    # on the proxy (thousands of rows per expert, none padded when balanced) fc1's wgrad is the larger for both: for
    # fp8 by exactly its output dW1 (dH's column copy is as large as its FP8 rows), for mxfp4 by x's column copy more
    for rec in ("fp8", "mxfp4"):
        cfg = compose_cfg("proxy_h200", "single_gpu", "none", rec)
        d = _dims(cfg)
        r, h, f = d.rows, d.h, d.f
        dgrad_p = 2 * r * h + 2 * r * 2 * f + (r * 2 * f + 4 * r * 2 * f // 128) + 2 * r * h + 2 * 2 * d.t_hid * h
        x_col = h * r + 4 * h * r // 128 if rec == "mxfp4" else 0
        assert per_gpu_memory(cfg).expert_backward_bytes - dgrad_p == 2 * d.e * 2 * f * h + x_col


def test_standalone_moe_layer_peak_by_hand():
    """P2's MoE layer in its benchmark (every .grad None, the input and dy allocated before the base): the peak is
    fc1's wgrad in the backward: the saved tensors less the layer's input and the shared expert's, the experts'
    live tensors with both BF16 weight gradients (bf16: fp4moe's grouped experts, no FP8 copies, plus one expert's
    [2F, H] product), the layer's output and the shared expert's input gradient (2 [T, H]) and the shared expert's
    weight gradients. The forward phase (saved less the shared expert's + 2 [R, H]) is smaller here."""
    mp = E * 128
    col = lambda k: k * mp + 4 * k * mp // 128   # noqa: E731
    live = {"bf16": 2 * R * H + 2 * R * 2 * F + 2 * R * H + DW2 + DW1 + 2 * 2 * F * H}
    live["fp8"] = 2 * R * H + 2 * R * 2 * F + 2 * R * H + col(2 * F) + DW1 + DW2
    live["mxfp4"] = live["fp8"] + col(H)
    for rec in RECIPES:
        cfg = _cfg(precision=rec)
        tensors = [t for t in layer_saved_tensors(cfg, "moe", "none") if t.name.startswith("moe.")]
        kept = sum(t.bytes for t in tensors if t.name not in ("moe.ln_in", "moe.ln_rstd", "moe.ln_out")
                   and not t.name.startswith("moe.shared_"))
        peak, phase = memory.standalone_moe_layer_peak(cfg)
        assert (peak, phase) == (kept + live[rec] + 2 * 2 * T * H + 2 * 3 * H * FS, "backward"), rec
        assert kept + 2 * 2 * R * H < peak
    with pytest.raises(ValueError, match="bf16_experts='loop'"):
        memory._expert_backward(_dims(_cfg()), memory.Recipe.preset("bf16"), MemoryAssumptions(bf16_experts="loop"))


def test_norm_recompute_at_the_moe_backward():
    """attn_ln_*: the pre-MLP norm's output-discarding checkpoint recomputes when the MoE layer's output gradient
    arrives and holds its recomputation's output and the refilled original (2 x [T, H] bf16), + the decoded input
    [T, H] when its cache is MXFP4; nothing under the other scopes."""
    for scope in SCOPES:
        for rec in RECIPES:
            b = per_gpu_memory(_cfg(precision=rec, recompute=scope))
            want = (3 if rec == "mxfp4" else 2) * 2 * T * H if scope in ("attn_ln_experts", "attn_ln_mlp") else 0
            if scope != "full":
                assert b.recompute_transient_bytes == want, (rec, scope)


def test_full_recompute_peaks_at_the_first_moe_layer():
    """Without pipelining fp4moe.train keeps each BF16 .grad until the step: under full recompute (one [T, H] saved
    per layer) the backward phase is largest at the first MoE layer, with the gradients of the layers after it;
    under none the last MoE layer's saved activations outweigh them (depth 0). megatron's DDP buffer ('always')
    counts every gradient in the static part instead."""
    cfg = compose_cfg("proxy_h200", "single_gpu", "full", "mxfp4")
    trainer = MemoryAssumptions(main_grad_resident="after_first_micro_batch")
    b = per_gpu_memory(cfg, trainer)
    d = _dims(cfg)
    # relative to the last MoE layer (3): at MoE layer 1, the gradients of MoE layers 2 and 3 exist and their saved
    # inputs [T, H] are freed (the head's gradients exist at both)
    grads_after = 2 * round(2 * sum(_stage_params("t", 1, d)))
    assert b.stage_letters == "EttttL" and b.backward_depth_bytes == grads_after - 2 * 2 * d.t_hid * d.h
    none = compose_cfg("proxy_h200", "single_gpu", "none", "mxfp4")
    assert per_gpu_memory(none, trainer).backward_depth_bytes == 0
    assert per_gpu_memory(cfg).backward_depth_bytes == 0   # main_grad_resident: always
    # the trainer up to e431a41: the dispatchers kept the recomputed graphs, so MoE layers 2 and 3 freed nothing and
    # layer 3 kept its input gradient too (layer 2's is layer 1's output gradient, in expert_backward already)
    kept = replace(trainer, dispatcher_keeps_recompute_graph=True)
    assert per_gpu_memory(cfg, kept).backward_depth_bytes == grads_after + 2 * d.t_hid * d.h
    assert per_gpu_memory(none, kept).backward_depth_bytes == 0   # only full recompute's graphs come from a backward


def test_attn_ln_experts_recompute_at_the_experts_backward():
    """attn_ln_experts: the experts' recomputed tensors + the checkpoint's recomputed output [R, H] are live at the
    experts' backward; fc1's input is rebuilt only where its saved format differs from the checkpoint's kept input
    (fp8: FP8 rows + columns from the BF16 rows; mxfp4: the kept MXFP4 rows themselves; bf16: views of them)."""
    def expert_tensors(rec):
        return {t.name: t.bytes for t in layer_saved_tensors(_cfg(precision=rec), "moe", "none")}
    for rec in RECIPES:
        b = per_gpu_memory(_cfg(precision=rec, recompute="attn_ln_experts"))
        none = per_gpu_memory(_cfg(precision=rec))
        x = expert_tensors(rec)
        rebuilt = x["moe.expert_swiglu_in"] + x["moe.expert_fc2_in"] + (x["moe.expert_fc1_in"] if rec == "fp8" else 0)
        # the experts' are counted inside expert_backward; the pre-MLP norm's recompute is the transient
        assert b.recompute_transient_bytes == (3 if rec == "mxfp4" else 2) * 2 * T * H
        if rec == "bf16":   # the recomputation's forward: dY + rebuilt + the recomputed pieces and their concatenation
            assert b.expert_backward_bytes == max(3 * 2 * R * H, 2 * R * H + rebuilt + 2 * 2 * R * H) + 2 * 2 * T * H
        else:
            assert b.expert_backward_bytes == none.expert_backward_bytes + rebuilt + 2 * R * H


def test_norm_cache_bf16_inputs_held_under_the_old_code():
    """MemoryAssumptions.norm_cache_keeps_bf16 (the code up to 38f25cd): under mxfp4's recompute caches and
    attn_ln_*, each layer's two norm inputs [T, H] also stayed BF16 (held, not saved); not under other scopes or
    recipes without MXFP4 caches."""
    old = MemoryAssumptions(norm_cache_keeps_bf16=True)
    for scope in SCOPES:
        for rec in RECIPES:
            b = per_gpu_memory(_cfg(precision=rec, recompute=scope), old)
            want = 2 * 2 * T * H * 2 if rec == "mxfp4" and scope in ("attn_ln_experts", "attn_ln_mlp") else 0
            assert b.held_bytes == want, (rec, scope)
            assert per_gpu_memory(_cfg(precision=rec, recompute=scope)).held_bytes == 0


def test_tiny_mxfp4_moe_by_hand():
    # mxfp4 preset, no recompute: experts save MXFP4 fc1 in [R,H], SwiGLU in [R,2F], fc2 in [R,F]; the shared
    # expert's FP8 linears save MXFP4 copies of their inputs; the router still holds the bf16 norm output.
    cfg = _cfg(precision="mxfp4")
    fp4 = lambda m, k: m * k // 2 + m * k // 32
    moe = (2 * T * H + 4 * T + 2 * T * H + ROUTER + 8 * R      # the MXFP4 dispatch keeps a second index
           + fp4(R, H) + fp4(R, 2 * F) + fp4(R, F) + 4 * R
           + fp4(T, H) + fp4(T, 2 * FS) + fp4(T, FS))         # shared SwiGLU input MXFP4 (activation_fp4_store)
    assert _layer_bytes(cfg, "moe") == ATTN_ACT + moe


def test_tiny_two_stage_pipeline_by_hand():
    # PP=2 (world 2, DP 1): stage 0 = embedding + dense layer, stage 1 = MoE layer + head. M = 4 / (2 x 1) = 2.
    for layout in (None, "Et|tL"):
        st = per_stage_memory(_cfg(pipeline=2, world_size=2, pipeline_layout=layout))
        assert [s.stage_letters for s in st] == ["Et", "tL"]
        assert [s.in_flight for s in st] == [2, 1]
        assert st[0].dense_params + st[0].expert_params == EMBED + DENSE_LAYER
        assert st[1].dense_params + st[1].expert_params == MOE_LAYER + HEAD
        assert st[0].activations_bytes == 2 * (EMBED_ACT + ATTN_ACT + DENSE_MLP_ACT)
        assert st[1].activations_bytes == ATTN_ACT + MOE_ACT + HEAD_ACT
        assert st[0].a2a_buffers_bytes == 0 and st[1].a2a_buffers_bytes > 0


def test_optimizer_group_is_megatrons_layout_on_the_most_loaded_rank():
    """Part (a) is optimizer_state.rank_bytes of the config's optimizer group, at the data-parallel rank that holds the
    most (tiny on 4 ranks: DP 4, EP 2, expert-DP 2; DP rank r is expert-DP rank r // EP), and its mean over them;
    the distributed optimizer shards 12 B per element over DP (dense) and expert-DP (experts), up to padding."""
    cfg = _cfg(world_size=4, data=4, expert=2, global_batch=8, optimizer="distributed")
    b = per_gpu_memory(cfg, NO_OUTSIDE)
    ranks = [optimizer_state.rank_bytes(cfg, 0, r, r // 2) for r in range(4)]
    assert b.optimizer_bytes == max(x.state_device for x in ranks)
    assert b.optimizer_mean_bytes == round(sum(x.state_device for x in ranks) / 4)
    assert (b.params_bytes, b.grads_bytes) == (ranks[0].params, ranks[0].grads) and b.optimizer_host_bytes == 0
    dense = EMBED + DENSE_LAYER + MOE_LAYER + HEAD - E * 3 * H * F
    expert = (E // 2) * 3 * H * F
    assert (b.dense_params, b.expert_params) == (dense, expert)
    assert 12 * (dense / 4 + expert / 2) <= b.optimizer_bytes < 12 * (dense / 4 + expert / 2) + 12 * 64 * 20
    assert b.mean_total_bytes == b.total_bytes - b.optimizer_bytes + b.optimizer_mean_bytes
    assert mean_total_bytes([b]) == b.mean_total_bytes <= b.total_bytes
    # the lab's setup: BF16 main grads, FP32 main params + moments + the FP32 gradient copy (16 B) on the host
    off = per_gpu_memory(_cfg(world_size=4, data=4, expert=2, global_batch=8, optimizer="offload"), NO_OUTSIDE)
    assert off.optimizer_bytes == off.optimizer_mean_bytes == 0
    assert off.optimizer_host_bytes == 16 * b.optimizer_bytes // 12 and off.grads_bytes == b.grads_bytes // 2


def test_old_trainer_grads_exist_only_from_the_second_micro_batch():
    """main_grad_resident='after_first_micro_batch' (the trainer before megatron's DDP, the archived runs): no FP32
    gradient accumulators with one micro-batch per step, megatron's buffer with more."""
    a = replace(NO_OUTSIDE, main_grad_resident="after_first_micro_batch")
    n = EMBED + DENSE_LAYER + MOE_LAYER + HEAD
    assert per_gpu_memory(_cfg(global_batch=2), a).grads_bytes == 0      # micro 2 x DP 1: one micro-batch
    assert per_gpu_memory(_cfg(global_batch=4), a).grads_bytes == 4 * n


def test_mtp_comes_from_the_config():
    """MTP layers are the config's model.mtp_num_layers, once: a layout whose 'm' letters disagree is refused with the
    fix; with one MTP layer the last stage holds it (a MoE layer, its norms and eh_proj, an embedding copy)."""
    cfg = _cfg(pipeline=2, world_size=2, pipeline_layout="Et|tmL")
    with pytest.raises(ValueError, match="1 'm' .*mtp_num_layers=0: put 0 'm' in the layout"):
        per_stage_memory(cfg)
    cfg.model.mtp_num_layers = 1
    last = per_stage_memory(cfg, NO_OUTSIDE)[-1]
    plain = per_stage_memory(_cfg(pipeline=2, world_size=2, pipeline_layout="Et|tL"), NO_OUTSIDE)[-1]
    # enorm, hnorm, its final norm, eh_proj [H, 2H], a MoE layer and the embedding copy
    assert last.dense_params + last.expert_params - (plain.dense_params + plain.expert_params) == \
        3 * H + 2 * H * H + MOE_LAYER + EMBED
    assert last.activations_bytes > plain.activations_bytes


# ---------------------------------------------------------------------------------------------- cross-checks

def test_byte_formulas_match_the_ops():
    pytest.importorskip("torch")
    from fp4moe.ops.all_to_all import payload_row_bytes
    from fp4moe.ops.fp8_linear import linear_saved_bytes
    from fp4moe.ops.grouped_experts import expert_saved_bytes
    from fp4moe.recipe import Recipe
    for rec in RECIPES:
        recipe = Recipe.preset(rec)
        ts = {t.name: t.bytes for t in layer_saved_tensors(_cfg(precision=rec), "moe", "none")}
        experts = sum(ts[n] for n in ("moe.expert_fc1_in", "moe.expert_swiglu_in", "moe.expert_fc2_in",
                                      "moe.expert_probs"))
        assert experts == expert_saved_bytes([R // E] * E, H, F, recipe)
        if rec != "bf16":
            assert ts["moe.shared_fc1_in_q"] == linear_saved_bytes(T, H, recipe, layer_kind="shared_expert")
            assert ts["moe.shared_fc2_q"] == linear_saved_bytes(T, FS, recipe, layer_kind="shared_expert")
    for h in (256, 2048, 7168):
        for codec in comm.CODECS:
            assert comm.payload_row_bytes(h, codec) == payload_row_bytes(h, codec)


# ---------------------------------------------------------------------------------------------- orderings

@pytest.mark.parametrize("scope", ("none",) + PAPER_SCOPES)
def test_recipe_order_at_equal_scope(scope):
    """mxfp4 < bf16 < fp8 per MoE layer: MXFP4 stores 0.53 B/elem, FP8 keeps row + column copies (2.06 B/elem)."""
    b = {r: _layer_bytes(compose_cfg("dsv3_671b", "paper_671b", scope, r), "moe") for r in RECIPES}
    assert b["mxfp4"] < b["bf16"] < b["fp8"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("attn", memory.ATTN_RECOMPUTE)
def test_lighter_scopes_keep_more(recipe, attn):
    cfg = compose_cfg("dsv3_671b", "paper_671b", "none", recipe)
    b = {s: _layer_bytes(cfg, "moe", s, attn_recompute=attn) for s in memory.SCOPES}
    assert b["full"] < b["attn_ln_experts"] < b["attn_ln_mlp"] < b["none"]
    assert b["full"] < b["mla_up_proj"] < b["none"]
    d = {s: _layer_bytes(cfg, "dense", s, attn_recompute=attn) for s in memory.SCOPES}
    assert d["attn_ln_mlp"] < d["attn_ln_experts"] < d["none"]   # dense layers: the mlp module is the one that bites
    if attn == "self_attention":   # whole-block attention recompute: the paper's order of the three rows
        assert b["attn_ln_mlp"] < b["mla_up_proj"]


def test_more_pipeline_stages_fewer_params_per_gpu():
    prev = None
    for pp in (1, 2, 4, 7):
        cfg = _cfg("moe_16b", "paper_16b", pipeline=pp, world_size=pp * 32)
        p = max(s.params_bytes for s in per_stage_memory(cfg))
        assert prev is None or p < prev
        prev = p


def test_in_flight_1f1b_decreases_per_stage():
    st = per_stage_memory(compose_cfg("dsv3_671b", "paper_671b", "attn_ln_experts", "mxfp4"))
    assert [s.in_flight for s in st] == list(range(32, 0, -1))
    assert st[0].stage_letters == "E" and st[-1].stage_letters == "tL"   # the lab's layout: no MTP


# ---------------------------------------------------------------------------------------------- all-to-all

def test_dispatch_payload_ratio_at_7168():
    assert comm.payload_row_bytes(7168, "mxfp4") == 3808
    assert comm.payload_row_bytes(7168, "fp8") == 7392
    assert comm.payload_row_bytes(7168, "mxfp4") / comm.payload_row_bytes(7168, "bf16") == 3808 / 14336
    a = {r: comm.a2a_per_layer(_cfg("dsv3_671b", "paper_671b", "attn_ln_experts", r, dispatcher="alltoall"))
         for r in RECIPES}
    rows = 4096 * 8
    assert a["mxfp4"].rows == rows
    assert a["mxfp4"].dispatch_fwd_bytes == rows * (3808 + 4) and a["bf16"].dispatch_fwd_bytes == rows * (14336 + 4)
    assert a["fp8"].dispatch_fwd_bytes == a["bf16"].dispatch_fwd_bytes   # the fp8 baseline dispatches BF16
    for r in RECIPES:   # combine and gradients stay BF16 in the presets
        assert a[r].combine_fwd_bytes == a[r].combine_bwd_bytes == a[r].dispatch_bwd_bytes == rows * 14336
    t = comm.a2a_time_s(a["mxfp4"], link_bandwidth_gb_s=100.0)
    assert math.isclose(t["dispatch fwd"], rows * 3812 * 7 / 8 / 100e9)
    with pytest.raises(TypeError):
        comm.a2a_time_s(a["mxfp4"])   # no default bandwidth


def test_flex_dispatch_deduplicates_ranks():
    # DeepSeek-V3 at EP8: 8 groups = 8 ranks, top-4 groups -> at most 4 distinct ranks per token.
    d = comm.expected_distinct_ranks(256, 8, 8, 8, 4)
    assert 1 < d < 4
    assert math.isclose(comm.expected_distinct_ranks(8, 1, 4), 1.0)
    assert math.isclose(comm.expected_distinct_ranks(4, 4, 4), 4.0)


# ---------------------------------------------------------------------------------------------- (f) outside PyTorch

def test_outside_torch_terms_and_how_they_scale():
    """Part (f) on the lab's PP32 EP8 layout: the context once per GPU; NCCL, per communicator a step uses (world,
    DP, EP, pipeline, model-parallel; expert-DP = 1 has none), its ring peer and its send / recv peers (NCCL's
    all-to-all: EP - 1, none with DeepEP, whose buffers come instead; the pipeline's neighbour stages); the
    allocator's gap in proportion to tokens x hidden; all of it scaled by outside_torch_scale; total = allocated +
    outside."""
    cfg = compose_cfg("dsv3_671b", "paper_671b", "mla_up_proj", "mxfp4", "offload")
    a = MemoryAssumptions(cuda_context_bytes=1000, nccl_communicator_bytes=100, nccl_peer_bytes=10,
                          nccl_p2p_peer_bytes=1, allocator_gap_bytes=7000, allocator_gap_ref_elements=2048 * 4096)
    st = per_stage_memory(cfg, a)
    mid, last = st[5], st[-1]
    assert mid.cuda_context_bytes == 1000
    assert mid.nccl_bytes == 5 * 100 + 5 * 10 + (7 + 2) * 1 and last.nccl_bytes == mid.nccl_bytes - 1
    assert mid.allocator_gap_bytes == round(7000 * 4096 * 7168 / (2048 * 4096)) and mid.deepep_bytes == 0
    assert mid.total_bytes == mid.allocated_bytes + 1000 + mid.nccl_bytes + mid.allocator_gap_bytes
    deep = per_stage_memory(cfg, replace(a, deepep_buffers=True))[5]
    assert deep.deepep_bytes == outside_torch.deepep_buffer_bytes(7168, 8) and deep.nccl_bytes == mid.nccl_bytes - 7
    assert per_stage_memory(cfg, replace(a, deepep_buffers=True))[0].deepep_bytes == 0   # the embedding stage: no MoE
    big = per_stage_memory(cfg, replace(a, outside_torch_scale=1.5))[5]
    assert big.outside_torch_bytes == (round(1.5 * 1000) + round(1.5 * mid.nccl_bytes)
                                       + round(1.5 * mid.allocator_gap_bytes))
    assert big.allocated_bytes == mid.allocated_bytes
    with pytest.raises(ValueError, match="cuda_context_bytes=-1: must be >= 0"):
        MemoryAssumptions(cuda_context_bytes=-1)


def test_components_add_up_on_the_paper_layout():
    """Every T1 cell of the paper layout: allocated = its components, the transient the largest phase, total =
    allocated + outside PyTorch, the mean over GPUs at most the most loaded GPU."""
    for scope in PAPER_SCOPES:
        for rec in RECIPES:
            st = per_stage_memory(compose_cfg("dsv3_671b", "paper_671b", scope, rec, "offload"))
            b = max(st, key=lambda x: x.total_bytes)
            assert all(math.isfinite(v) for _, v in b.table()) and b.total_gb > 0
            assert b.allocated_bytes == sum(getattr(b, f"{c}_bytes") for c in memory.COMPONENTS)
            assert b.total_bytes == b.allocated_bytes + sum(getattr(b, f"{c}_bytes") for c in memory.OUTSIDE_TORCH)
            assert b.transient_bytes == max(b.phases.values()) and b.peak_phase in b.phases
            assert mean_total_bytes(st) < b.total_bytes


# ---------------------------------------------------------------------------------------------- calibrated terms

def _proxy(recompute="none", precision="bf16", mb=1, gb=1):
    cfg = compose_cfg("proxy_h200", "single_gpu", recompute, precision)
    cfg.precision.scope = "all_linears"
    cfg.parallel.micro_batch, cfg.parallel.global_batch = mb, gb
    return cfg


def test_kv_down_proj_stays_bf16_under_all_linears():
    # proxy_h200: kv_down_proj is 2048 -> 512 + 64 = 576, not a multiple of 128: a BF16 linear holding the norm
    # output, while q_down_proj (2048 -> 768) saves its own FP8 row+col copy.
    ts = {t.name: t for t in layer_saved_tensors(_proxy(precision="fp8"), "dense", "none")}
    t = 4096
    assert "attn.kv_down_in_q" not in ts and ts["attn.ln_out"].holders == {"attn.kv_down_in"}
    assert ts["attn.q_down_in_q"].bytes == memory.fp8_row_col_bytes(t, 2048)
    assert ts["attn.ln_out"].bytes == 2 * t * 2048


def test_mla_up_proj_keeps_the_norm_outputs_and_mxfp4_caches():
    t, seq = 4096, 4096
    b = {t_.name: t_ for t_ in layer_saved_tensors(_proxy(precision="bf16"), "dense", "mla_up_proj")}
    assert b["attn.q_ln_out"].bytes == 2 * t * 768 and b["attn.kv_ln_out"].bytes == 2 * t * 512
    assert b["attn.rope_cos_sin"].bytes == 4 * seq * 64            # the frequencies, not cos + sin
    assert not {"attn.q", "attn.k", "attn.v"} & set(b)
    m = {t_.name: t_ for t_ in layer_saved_tensors(_proxy(precision="mxfp4"), "dense", "mla_up_proj")}
    assert m["attn.q_ln_out"].bytes == t * 768 // 2 + t * 768 // 32
    assert m["attn.k_pos_emb_ckpt"].bytes == t * 64 // 2 + t * 64 // 32


def test_mxfp4_recompute_caches_under_attn_ln():
    t, fp4 = 4096, (lambda m, k: m * k // 2 + m * k // 32)
    m = {x.name: x.bytes for x in layer_saved_tensors(_proxy(precision="mxfp4"), "dense", "attn_ln_mlp")}
    assert m["attn.ln_in"] == fp4(t, 2048) and m["mlp.ln_in"] == fp4(t, 2048) and m["mlp.ckpt_in"] == fp4(t, 2048)
    assert m["attn.q"] == fp4(t * 16, 192) and m["attn.v"] == fp4(t * 16, 128)
    f = {x.name: x.bytes for x in layer_saved_tensors(_proxy(precision="fp8"), "dense", "attn_ln_mlp")}
    assert f["attn.ln_in"] == 2 * t * 2048 and "mlp.ckpt_in" not in f


def test_expected_expert_padding_and_trainer_grads():
    # 32 experts, R = 4096 x 8 rows: balanced = 1024 rows each (no padding); expected adds (32 x 127 + 1) // 2 rows
    cfg = _proxy(precision="fp8")
    bal = {x.name: x.bytes for x in layer_saved_tensors(cfg, "moe", "none")}
    exp = {x.name: x.bytes for x in layer_saved_tensors(cfg, "moe", "none", MemoryAssumptions(expert_padding="expected"))}
    r, pad = 4096 * 8, (32 * 127 + 1) // 2
    assert exp["moe.expert_fc1_in"] - bal["moe.expert_fc1_in"] == 2048 * pad + 4 * 2048 * (r + pad) // 128 - 4 * 2048 * r // 128
    a = MemoryAssumptions(main_grad_resident="after_first_micro_batch")
    one, four = per_gpu_memory(_proxy(mb=8, gb=8), a), per_gpu_memory(_proxy(mb=8, gb=32), a)
    assert one.grads_bytes == 0 and four.grads_bytes == 4 * (four.dense_params + four.expert_params)


@pytest.mark.parametrize("recipe", ["bf16", "fp8", "mxfp4"])
def test_whole_attention_block_configs_are_the_self_attention_reading(recipe):
    """conf/recompute/attn_block_*.yaml (fp4moe_modules self_attention) are modelled as their core-attention scope
    with ``attn_recompute='self_attention'``: the attention keeps its input norm's input only, plus, under mxfp4's
    recompute caches, the block checkpoint's MXFP4 copy of its (discarded) input [T, H]."""
    for block, core in (("attn_block_ln_experts", "attn_ln_experts"), ("attn_block_ln_mlp", "attn_ln_mlp")):
        cfg_b = compose_cfg("proxy_h200", "single_gpu", block, recipe)
        cfg_c = compose_cfg("proxy_h200", "single_gpu", core, recipe)
        a = MemoryAssumptions(attn_recompute="self_attention")
        assert per_gpu_memory(cfg_b).total_bytes == per_gpu_memory(cfg_c, a).total_bytes
        assert per_gpu_memory(cfg_b).total_bytes < per_gpu_memory(cfg_c).total_bytes
        for kind in ("dense", "moe"):
            attn = {t.name: t for t in layer_saved_tensors(cfg_b, kind) if t.name.startswith("attn.")}
            d = _dims(cfg_b)
            if recipe == "mxfp4":
                assert set(attn) == {"attn.ln_in", "attn.ckpt_in"}
                assert (attn["attn.ckpt_in"].fmt, attn["attn.ckpt_in"].bytes) == ("mxfp4", d.t_hid * d.h * 17 // 32)
                assert attn["attn.ln_in"].fmt == "mxfp4"
            else:
                assert set(attn) == {"attn.ln_in"} and attn["attn.ln_in"].bytes == 2 * d.t_hid * d.h


def test_compose_cfg_gives_a_fresh_config_each_call():
    """compose_cfg parses each conf file once and hands out copies: changing one composed config changes no later
    one; an unknown name says which exist."""
    a = compose_cfg("proxy_h200", "single_gpu", "none", "fp8", "offload")
    a.model.hidden_size, a.optimizer.cpu_offload = 1, "changed"
    b = compose_cfg("proxy_h200", "single_gpu", "none", "fp8", "offload")
    assert b.model.hidden_size != 1 and b.optimizer.cpu_offload is True   # offload.yaml over its gpu_fp32 default
    with pytest.raises(ValueError, match="model=nope: no conf/model/nope.yaml; pick one of .*proxy_h200"):
        compose_cfg("nope", "single_gpu", "none", "fp8")


# ---------------------------------------------------------------------------------------------- the lab's stack
# MemoryAssumptions' lab-stack switches (megatron-core + Transformer Engine + the paper release's patches): each term
# by hand on the proxy (hidden 2048, MLA kv_down 2048 -> 576, 32 experts top-8, T = 4096 at micro-batch 1).

def test_fp8_any_shape_puts_kv_down_proj_in_fp8():
    """TE computes every linear in FP8 whose input rows are a multiple of 8 and features of 16: kv_down_proj (2048 ->
    576) saves its own FP8 copy instead of holding the norm output, and its weight is cached in FP8 (5 x 16 started
    128 x 128 blocks of scales per copy)."""
    t = 4096
    a = MemoryAssumptions(fp8_any_shape=True)
    ts = {x.name: x for x in layer_saved_tensors(_proxy(precision="fp8"), "dense", "none", a)}
    assert ts["attn.kv_down_in_q"].bytes == memory.fp8_row_col_bytes(t, 2048) and "attn.ln_out" not in ts
    bf16 = {x.name for x in layer_saved_tensors(_proxy(precision="bf16"), "dense", "none", a)}
    assert "attn.kv_down_in_q" not in bf16 and "attn.ln_out" in bf16          # no FP8 without FP8 compute
    cfg = _proxy(precision="fp8")
    cfg.train = {"fp8_weight_cache": True}
    cache = {on: per_gpu_memory(cfg, MemoryAssumptions(fp8_any_shape=on)).fp8_weight_cache_bytes for on in (0, 1)}
    assert cache[True] - cache[False] == 4 * (2 * 576 * 2048 + 2 * 4 * 5 * 16)   # kv_down of the proxy's 4 layers


def test_te_weight_workspaces_are_the_fp8_weight_cache():
    """TE caches every FP8 weight's copies for the run: the same bytes as fp4moe's train.fp8_weight_cache, none
    under bf16, on every pipeline stage; the rest of the breakdown is unchanged."""
    def cfg_of(rec):
        cfg = compose_cfg("dsv3_671b", "paper_671b", "mla_up_proj", rec, "offload")
        cfg.precision.scope = "all_linears"   # T1's scope: the dense layers' linears too
        return cfg

    for rec in RECIPES:
        cfg = cfg_of(rec)
        te = per_stage_memory(cfg, MemoryAssumptions(fp8_weight_workspaces=True))
        cfg.train = {"fp8_weight_cache": True}
        own = per_stage_memory(cfg)
        assert [b.fp8_weight_cache_bytes for b in te] == [b.fp8_weight_cache_bytes for b in own]
        assert all((b.fp8_weight_cache_bytes > 0) == (rec != "bf16" and "t" in b.stage_letters) for b in te)
        plain = per_stage_memory(cfg_of(rec))
        assert [b.allocated_bytes - b.fp8_weight_cache_bytes for b in te] == [b.allocated_bytes for b in plain]


def test_fp8_saves_columnwise_keeps_the_wgrad_copy_only():
    """TE's FP8 linears save the column-wise copy of their input only ([K, M] E4M3 + one FP32 scale per 1x128 group
    along M): the dense linears, the shared expert and the routed experts (1024 rows each, no padding) of the fp8
    recipe; MXFP4-saved inputs and BF16 are unchanged."""
    t, r, h = 4096, 4096 * 8, 2048
    a = MemoryAssumptions(fp8_saves_columnwise=True)
    te = {x.name: x for x in layer_saved_tensors(_proxy(precision="fp8"), "moe", "none", a)}
    own = {x.name: x for x in layer_saved_tensors(_proxy(precision="fp8"), "moe", "none")}
    assert (te["moe.expert_fc1_in"].fmt, te["moe.expert_fc1_in"].bytes) == ("fp8_col", h * r + 4 * h * r // 128)
    assert te["attn.q_down_in_q"].bytes == h * t + 4 * h * t // 128 == memory.fp8_col_bytes(t, h)
    assert te["moe.shared_fc1_in_q"].bytes == memory.fp8_col_bytes(t, h)
    for name, x in own.items():
        col = {"fp8_row_col": "fp8_col"}.get(x.fmt, x.fmt)
        assert te[name].fmt == col and (te[name].bytes < x.bytes if x.fmt == "fp8_row_col" else te[name].bytes == x.bytes)
    for rec in ("bf16", "mxfp4"):
        assert (_layer_bytes(_proxy(precision=rec), "moe", "none", fp8_saves_columnwise=True)
                == _layer_bytes(_proxy(precision=rec), "moe", "none"))
    assert memory.fp8_col_bytes(100, 256) == 256 * 100 + 4 * 256          # one started group of 128 rows
    assert te["moe.shared_fc2_q"].bytes == memory.fp8_col_bytes(t, 1024)   # the shared expert's fc2 input [T, Fs]


@pytest.mark.parametrize("recipe", RECIPES)
def test_save_original_input_under_the_layernorm_recompute(recipe):
    """With megatron's set_save_original_input the FP8 linears that read a norm's discarded output (q_down, kv_down,
    the dense fc1, the shared expert's fc1) keep nothing of their own under attn_ln_*: their quantized copies leave
    the ledger, exactly those; other scopes and bf16 are unchanged."""
    a = MemoryAssumptions(save_original_input=True, fp8_any_shape=True)
    cfg = _proxy(precision=recipe)
    for kind in ("dense", "moe"):
        for scope in ("attn_ln_experts", "attn_ln_mlp", "mla_up_proj", "none"):
            te = {x.name for x in layer_saved_tensors(cfg, kind, scope, a)}
            own = {x.name for x in layer_saved_tensors(cfg, kind, scope, replace(a, save_original_input=False))}
            gone = own - te
            assert te <= own
            if recipe == "bf16" or scope in ("mla_up_proj", "none"):
                assert not gone
            else:
                mlp = {"mlp.fc1_in_q"} if scope == "attn_ln_experts" else set()   # attn_ln_mlp: checkpointed
                assert gone == {"attn.q_down_in_q", "attn.kv_down_in_q"} | (
                    mlp if kind == "dense" else {"moe.shared_fc1_in_q"})


def test_fused_norm_linears():
    """TE's LayerNormLinear: the dense layer's pre-MLP norm keeps its input, 1/rms and fc1's own copy of its output
    under the layernorm recompute (BF16, or FP8 columns under fp8 and mxfp4: no save_fp4 hook); MLA's q / kv up-
    projections save an FP8 copy of their norm's output instead of MXFP4; under mla_up_proj the checkpoint holds the
    latents q [T, q_lora] and kv [T, kv_lora + rope] and no norm tensor."""
    t, h, ql = 4096, 2048, 768
    a = MemoryAssumptions(fused_norm_linears=True, fp8_saves_columnwise=True)
    for rec in RECIPES:
        ts = {x.name: x for x in layer_saved_tensors(_proxy(precision=rec), "dense", "attn_ln_experts", a)}
        assert ts["mlp.ln_in"].bytes == 2 * t * h and ts["mlp.ln_rstd"].bytes == 4 * t
        if rec == "bf16":
            assert ts["mlp.ln_out"].bytes == 2 * t * h and "mlp.fc1_in_q" not in ts
        else:
            assert (ts["mlp.fc1_in_q"].fmt, ts["mlp.fc1_in_q"].bytes) == ("fp8_col", memory.fp8_col_bytes(t, h))
            assert "mlp.ln_out" not in ts
        alm = {x.name for x in layer_saved_tensors(_proxy(precision=rec), "dense", "attn_ln_mlp", a)}
        assert {n for n in alm if n.startswith("mlp.")} == {"mlp.ln_in"}   # the mlp checkpoint's input
        none = {x.name: x for x in layer_saved_tensors(_proxy(precision=rec), "dense", "none", a)}
        if rec != "bf16":
            assert none["attn.q_up_in_q"].fmt == "fp8_col" == none["attn.kv_up_in_q"].fmt
        mla = {x.name: x for x in layer_saved_tensors(_proxy(precision=rec), "moe", "mla_up_proj", a)}
        assert mla["attn.q_latent"].holders == {"mla_up_proj_ckpt"} == mla["attn.kv_latent"].holders
        size = memory.mxfp4_bytes if rec == "mxfp4" else (lambda m, k: 2 * m * k)   # the preset's recompute caches
        assert (mla["attn.q_latent"].bytes, mla["attn.kv_latent"].bytes) == (size(t, ql), size(t, 512 + 64))
        assert not {"attn.q_ln_out", "attn.kv_ln_out", "attn.q_ln_rstd", "attn.kv_ln_rstd"} & set(mla)
    own = {x.name: x for x in layer_saved_tensors(_proxy(precision="mxfp4"), "dense", "none")}
    assert own["attn.q_up_in_q"].fmt == "mxfp4" and own["mlp.ln_rstd"].tag == "ln_rstd"   # fp4moe's separate norms


def test_dense_swiglu_fp4_under_the_release_patch():
    """The release's megatron patch stores the dense MLPs' SwiGLU input [T, 2 x 5376] MXFP4 under
    activation_fp4_store (mxfp4); bf16 / fp8 and the MoE layers are unchanged."""
    t, f = 4096, 5376
    a = MemoryAssumptions(dense_swiglu_fp4=True)
    ts = {x.name: x for x in layer_saved_tensors(_proxy(precision="mxfp4"), "dense", "none", a)}
    assert (ts["mlp.swiglu_in"].fmt, ts["mlp.swiglu_in"].bytes) == ("mxfp4", t * 2 * f // 2 + t * 2 * f // 32)
    assert (_layer_bytes(_proxy(precision="mxfp4"), "dense", "none")
            - _layer_bytes(_proxy(precision="mxfp4"), "dense", "none", dense_swiglu_fp4=True)) == 2 * t * 2 * f - ts["mlp.swiglu_in"].bytes
    for rec, kind in (("bf16", "dense"), ("fp8", "dense"), ("mxfp4", "moe")):
        assert (_layer_bytes(_proxy(precision=rec), kind, "none", dense_swiglu_fp4=True)
                == _layer_bytes(_proxy(precision=rec), kind, "none"))


def test_te_grouped_experts_backward_by_hand():
    """TE's grouped MLP backward on the proxy (R = 32768 rows, H 2048, F 1024, 1024 rows per expert: no padding):
    the largest of fc2's (dY + its FP8 rows and columns + dZ), the SwiGLU's (dZ + decoded H + dH) and fc1's (dH +
    its FP8 rows and columns + dX + x's column copy under mxfp4) + 2 [T, H]; no weight gradients; under
    attn_ln_experts dY held throughout, with the recomputed tensors and output."""
    t, r, h, f = 4096, 4096 * 8, 2048, 1024
    rc = memory.fp8_row_col_bytes
    grads = 2 * 2 * t * h
    a = MemoryAssumptions(te_grouped_experts=True)
    dy, dz, dh = 2 * r * h, 2 * r * f, 2 * r * 2 * f
    want = {"bf16": max(dy + dz, dz + dh, dh + dy),
            "fp8": max(dy + rc(r, h) + dz, dz + dh, dh + rc(r, 2 * f) + dy),
            "mxfp4": max(dy + rc(r, h) + dz, dz + 2 * dh, dh + rc(r, 2 * f) + dy + memory.fp8_col_bytes(r, h))}
    for rec, live in want.items():
        b = per_gpu_memory(_proxy(precision=rec), a)
        assert b.expert_backward_bytes == live + grads
        ale = per_gpu_memory(_proxy("attn_ln_experts", rec), a)
        none = {x.name: x for x in layer_saved_tensors(_proxy(precision=rec), "moe", "none", a)}
        kept = {x.name: x for x in layer_saved_tensors(_proxy("attn_ln_experts", rec), "moe", None, a)}
        fc1_in = none["moe.expert_fc1_in"]   # rebuilt unless the checkpoint keeps it as it is (bf16, mxfp4)
        recomputed = none["moe.expert_swiglu_in"].bytes + none["moe.expert_fc2_in"].bytes + (
            0 if kept["moe.expert_ckpt_in"].fmt == fc1_in.fmt else fc1_in.bytes)
        fc2, swi = dy + (rc(r, h) if rec != "bf16" else 0) + dz, dz + dh + (dh if rec == "mxfp4" else 0)
        fc1 = live if rec == "bf16" else dh + rc(r, 2 * f) + dy + (memory.fp8_col_bytes(r, h) if rec == "mxfp4" else 0)
        assert ale.expert_backward_bytes == max(fc2, swi + dy, fc1 + dy) + recomputed + dy + grads


def test_lab_stack_names_every_switch_each_off_by_default():
    """LAB_STACK turns on exactly the MemoryAssumptions switches the module docstring lists under "The lab's stack";
    each is off by default (fp4moe's code, what calibration.md checks)."""
    import dataclasses

    doc = memory.__doc__.split("The lab's stack:", 1)[1].split("\n\n", 2)[1]
    listed = [line.split()[0] for line in doc.splitlines() if line.startswith("    ") and not line.startswith("     ")]
    assert list(memory.LAB_STACK) == listed and all(v is True for v in memory.LAB_STACK.values())
    defaults = {f.name: f.default for f in dataclasses.fields(MemoryAssumptions)}
    assert all(defaults[name] is False for name in memory.LAB_STACK)
