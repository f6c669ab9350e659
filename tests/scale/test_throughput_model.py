"""The throughput model (fp4moe.scale.throughput) with its own inputs: FLOP arithmetic on a small hand-checkable
config, recompute adding exactly the re-run forward FLOPs, and each time term from rates this file states (round
numbers, not measurements). The measured rates and the checks against the H200 runs: tests/analysis/test_throughput_calibration.py.
Fast: configs and arithmetic (no torch)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from fp4moe.scale import throughput as T
from fp4moe.scale.memory import compose_cfg

# Rates of this file's own (TFLOP/s, GB/s, ms per glue_tokens tokens, s per element)
RATES = T.Rates(fp8_fprop=1000.0, fp8_dgrad=800.0, fp8_wgrad=500.0, bf16_dense=600.0, grouped_fp8_fraction=0.5,
                bf16_expert=600.0, quant_fp8_row=4000.0, quant_fp8_col=3000.0, bf16_to_fp4=3000.0,
                fp4_to_fp8_row=2000.0, fp4_to_fp8_col=2000.0, fused_fp4_fp8row=2500.0, fp4_to_bf16=3500.0,
                weight_quant_s_per_param=1e-12, glue_ms_fp8=400.0, glue_ms_mxfp4=420.0, glue_tokens=262144,
                prof_attention_ms=(200.0, 190.0), prof_micro_batch=32, prof_scope="attn_ln_mlp",
                swiglu_s_per_elem=(("fp8", (1e-12, 2e-12)), ("mxfp4", (1.5e-12, 2.5e-12))),
                swiglu_fused_fp4_store=True, dispatch_quantize_per_token=True, attn_block_glue_ms=(50.0, 60.0))


def tiny(scope="none", recipe="fp8"):
    """H 256, 2 heads, q_lora 128, kv_lora 128, nope 64, rope 64, v 64, dense ffn 512, 4 experts top-2 of ffn 128,
    1 shared, vocab 1024, 2 layers (1 dense), one GPU, micro-batch 1, sequence 8."""
    cfg = compose_cfg("proxy_h200", "single_gpu", scope, recipe)
    cfg.model = OmegaConf.create({
        "num_layers": 2, "hidden_size": 256, "num_attention_heads": 2, "ffn_hidden_size": 512, "vocab_size": 1024,
        "mtp_num_layers": 0,
        "mla": {"q_lora_rank": 128, "kv_lora_rank": 128, "qk_head_dim": 64, "qk_pos_emb_head_dim": 64,
                "v_head_dim": 64},
        "moe": {"first_k_dense": 1, "num_experts": 4, "shared_experts": 1, "ffn_hidden_size": 128,
                "router_topk": 2}})
    cfg.parallel.micro_batch = 1
    cfg.parallel.global_batch = 1
    cfg.parallel.seq_length = 8
    cfg.precision.scope = "all_linears"
    return cfg


# forward FLOPs per token, by hand (2 per multiply-add)
HAND = {
    "attn.q_down": 2 * 256 * 128,            # 65536
    "attn.q_up": 2 * 128 * 2 * 128,          # 65536 (qk = 64 + 64 per head)
    "attn.kv_down": 2 * 256 * 192,           # 98304, out 192: not a multiple of 128 -> stays BF16
    "attn.kv_up": 2 * 128 * 2 * 128,         # 65536 (nope + v = 128 per head)
    "attn.core": 2 * (128 + 64) * 9,         # 3456: n (qk + v) (s + 1)
    "attn.o_proj": 2 * 128 * 256,            # 65536
    "mlp.fc1": 2 * 256 * 1024, "mlp.fc2": 2 * 512 * 256,
    "moe.router": 2 * 256 * 4,
    "experts.fc1": 2 * 2 * 256 * 256, "experts.fc2": 2 * 2 * 128 * 256,
    "shared.fc1": 2 * 256 * 256, "shared.fc2": 2 * 128 * 256,
}
ATTN = ("attn.q_down", "attn.q_up", "attn.kv_down", "attn.kv_up", "attn.core", "attn.o_proj")


def test_layer_gemms_hand_checked():
    dense = {g.name: g for g in T.layer_gemms(tiny(), "dense")}
    moe = {g.name: g for g in T.layer_gemms(tiny(), "moe")}
    assert set(dense) == set(ATTN) | {"mlp.fc1", "mlp.fc2"}
    assert set(moe) == set(ATTN) | {"moe.router", "experts.fc1", "experts.fc2", "shared.fc1", "shared.fc2"}
    for name, g in {**dense, **moe}.items():
        assert g.flops == HAND[name], name
    assert dense["attn.kv_down"].kind == "bf16" and dense["attn.q_down"].kind == "dense"
    assert moe["experts.fc1"].kind == "expert" and moe["experts.fc1"].rows == 2
    assert T.layer_flops(tiny(), "dense")["forward"] == 1150336
    assert T.layer_flops(tiny(), "moe")["forward"] == 955776
    assert T.head_gemms(tiny())[0].flops == 2 * 256 * 1024


@pytest.mark.parametrize("scope,dense_rerun,moe_rerun", [
    ("none", (), ()),
    ("attn_ln_experts", ("attn.core",), ("attn.core", "experts.fc1", "experts.fc2")),
    ("attn_ln_mlp", ("attn.core", "mlp.fc1", "mlp.fc2"), ("attn.core",)),
    ("mla_up_proj", ("attn.q_up", "attn.kv_up"), ("attn.q_up", "attn.kv_up")),
    ("attn_block_ln_experts", ATTN, ATTN + ("experts.fc1", "experts.fc2")),
    ("attn_block_ln_mlp", ATTN + ("mlp.fc1", "mlp.fc2"), ATTN),
])
def test_recompute_adds_exactly_the_rerun_forward(scope, dense_rerun, moe_rerun):
    for kind, rerun in (("dense", dense_rerun), ("moe", moe_rerun)):
        f, base = T.layer_flops(tiny(scope), kind), T.layer_flops(tiny("none"), kind)
        assert f["recompute"] == sum(HAND[n] for n in rerun)
        assert f["total"] - base["total"] == sum(HAND[n] for n in rerun)
        assert f["backward"] == 2 * f["forward"] == 2 * base["forward"]


def test_whole_block_configs_are_their_own_scope():
    """conf/recompute/attn_block_*.yaml (recompute module self_attention) are the whole-block scopes, not the
    core-attention ones that fp4moe.scale.memory names them by."""
    for scope in ("attn_block_ln_experts", "attn_block_ln_mlp", "attn_ln_experts", "mla_up_proj"):
        assert T.recompute_scope(tiny(scope)) == scope
    with pytest.raises(ValueError, match="unknown recompute scope 'block'"):
        T.recomputed("block", "attn.core")


def test_whole_block_adds_its_elementwise_work_once():
    """attn_block_* add attn_block_glue_ms (per glue_tokens, over the proxy's 4 layers) to the glue of their attn_ln_*
    scope, per layer of the stage (tiny: 2 layers); nothing where it is not given."""
    for core, blk in T.BLOCK_OF.items():
        for rec, i in (("fp8", 0), ("mxfp4", 1)):
            a = T.time_per_token(tiny(blk, rec), RATES).terms["glue"]
            b = T.time_per_token(tiny(core, rec), RATES).terms["glue"]
            assert a - b == pytest.approx(RATES.attn_block_glue_ms[i] * 1e-3 / RATES.glue_tokens * 2 / 4, rel=1e-12)
            none = replace(RATES, attn_block_glue_ms=(0.0, 0.0))
            assert (T.time_per_token(tiny(blk, rec), none).terms["glue"]
                    == T.time_per_token(tiny(core, rec), none).terms["glue"])


def test_swiglu_term_counts_elements_and_reruns():
    """fp4moe's fused SwiGLU per element it writes: k f routed + fs shared per token and MoE layer, forward once more
    where the scope re-runs the experts (tiny: k 2, f 128, fs 128, one MoE layer); bf16 has no such term (megatron's
    SwiGLU is in its glue), nor rates without SwiGLU kernels (the SwiGLU in the glue)."""
    fwd, bwd = dict(RATES.swiglu_s_per_elem)["fp8"]
    none = T.time_per_token(tiny("none", "fp8"), RATES).terms["swiglu"]
    assert none == pytest.approx((2 * 128 + 128) * (fwd + bwd), rel=1e-12)
    experts = T.time_per_token(tiny("attn_ln_experts", "fp8"), RATES).terms["swiglu"]
    assert experts - none == pytest.approx(2 * 128 * fwd, rel=1e-12)
    full = T.time_per_token(tiny("full", "fp8"), RATES).terms["swiglu"]
    assert full - none == pytest.approx((2 * 128 + 128) * fwd, rel=1e-12)
    assert T.time_per_token(tiny("none", "bf16"), RATES).terms.get("swiglu", 0.0) == 0.0
    in_glue = replace(RATES, swiglu_s_per_elem=(), glue_expert_swiglu_ms=200.0)
    assert "swiglu" not in T.time_per_token(tiny("none", "fp8"), in_glue).terms


def test_swiglu_in_the_glue_is_taken_off_where_the_experts_are_not_rerun():
    """With the SwiGLU in the glue (glue_expert_swiglu_ms, measured at attn_ln_experts), its forward share (1/4) comes
    off for the scopes that do not re-run the experts; full re-runs the whole forward: x 4/3."""
    r = replace(RATES, swiglu_s_per_elem=(), glue_expert_swiglu_ms=200.0, prof_scope="attn_ln_experts")
    glue = {sc: T.time_per_token(tiny(sc, "fp8"), r).terms["glue"] for sc in ("attn_ln_experts", "none", "full")}
    per_ms = 1e-3 / r.glue_tokens * 2 / 4   # tiny: 2 of the proxy's 4 layers
    assert glue["attn_ln_experts"] == pytest.approx(400.0 * per_ms, rel=1e-12)
    assert glue["none"] == pytest.approx((400.0 - 50.0) * per_ms, rel=1e-12)
    assert glue["full"] == pytest.approx((400.0 - 50.0) * 4 / 3 * per_ms, rel=1e-12)


def test_fused_fp4_swiglu_store_is_not_a_separate_conversion():
    """With the MXFP4 store of the SwiGLU input fused into the SwiGLU kernels, mxfp4's conversions lose exactly the
    separate encode (each forward) and decode (backward) of experts.fc1's and shared.fc1's output [rows, 2F] (tiny:
    2 routed rows and 1 shared row per token, 2F = 256)."""
    apart = replace(RATES, swiglu_fused_fp4_store=False)
    fused = T.time_per_token(tiny("none", "mxfp4"), RATES).terms["conversion"]
    sep = T.time_per_token(tiny("none", "mxfp4"), apart).terms["conversion"]
    n, fp4 = 256, 256 / 2 + 256 / 32
    per_row = (2 * n + fp4) / (RATES.bf16_to_fp4 * 1e9) + (fp4 + 2 * n) / (RATES.fp4_to_bf16 * 1e9)
    assert sep - fused == pytest.approx((2 + 1) * per_row, rel=1e-9)


def test_dispatch_quantized_per_token_encodes_one_row_per_token():
    """With the dispatch quantized per token, mxfp4's conversions lose the BF16 -> MXFP4 encode of k - 1 of each
    token's k dispatched rows [H] (tiny: k 2, H 256, one MoE layer); fp8 and bf16 do not change."""
    rows = replace(RATES, dispatch_quantize_per_token=False)
    per_token = T.time_per_token(tiny("none", "mxfp4"), RATES).terms["conversion"]
    per_row = T.time_per_token(tiny("none", "mxfp4"), rows).terms["conversion"]
    h = 256
    assert per_row - per_token == pytest.approx((2 - 1) * (2 * h + h / 2 + h / 32) / (RATES.bf16_to_fp4 * 1e9),
                                                rel=1e-9)
    for rec in ("fp8", "bf16"):
        assert T.time_per_token(tiny("none", rec), RATES).total == T.time_per_token(tiny("none", rec), rows).total


def test_full_recompute_reruns_the_whole_forward():
    for kind in ("dense", "moe"):
        f = T.layer_flops(tiny("full"), kind)
        assert f["recompute"] == f["forward"] and f["total"] == 4 * f["forward"]


def test_recompute_time_is_rerun_flops_over_rate():
    """GEMM time of a scope minus none = the re-run forward FLOPs / the forward rate of their kind."""
    rates = replace(RATES, attention=500.0, glue=False)
    none = T.time_per_token(tiny("none", "bf16"), rates)
    mlp = T.time_per_token(tiny("attn_ln_mlp", "bf16"), rates)
    extra = (HAND["mlp.fc1"] + HAND["mlp.fc2"]) / 600e12 + 2 * HAND["attn.core"] / 500e12
    assert mlp.total - none.total == pytest.approx(extra, rel=1e-12)
    fp8_none = T.time_per_token(tiny("none", "fp8"), rates)
    fp8_up = T.time_per_token(tiny("mla_up_proj", "fp8"), rates)
    gemm = (HAND["attn.q_up"] + HAND["attn.kv_up"]) * 2 / 1000e12   # 2 layers, FP8 fprop rate
    assert fp8_up.group("gemm") - fp8_none.group("gemm") == pytest.approx(gemm, rel=1e-12)
    assert fp8_up.terms["conversion"] > fp8_none.terms["conversion"]   # the re-run quantizes its inputs again


def test_attention_rate_is_derived_from_the_profiled_time():
    """attention = 0: the core attention's FLOPs of the profiled setting (proxy_h200, 4 layers, forward + re-run where
    the scope re-runs it + 2 x forward backward, glue_tokens tokens) over the mean profiled time."""
    cfg = compose_cfg("proxy_h200", "single_gpu", "attn_ln_mlp", "fp8")
    cfg.parallel.micro_batch = 32
    core = next(g for g in T.layer_gemms(cfg, "moe") if g.name == "attn.core").flops
    want = 4 * core * 4 * RATES.glue_tokens / (195.0 * 1e-3) / 1e12
    assert T.attention_rate_from_profile(RATES) == pytest.approx(want, rel=1e-12)


def test_bf16_has_no_conversion_and_ep_needs_a_bandwidth():
    tb = T.time_per_token(tiny("none", "bf16"), RATES)
    assert tb.terms["conversion"] == 0 and "weight_quant" not in tb.terms
    cfg = compose_cfg("dsv3_671b", "paper_671b", "attn_ln_experts", "mxfp4")
    with pytest.raises(ValueError, match="link_bandwidth"):
        T.time_per_token(cfg, RATES)
    a = T.time_per_token(cfg, RATES, link_bandwidth_gb_s=150.0, weight_quant_per="step")
    b = T.time_per_token(cfg, RATES, link_bandwidth_gb_s=40.0, weight_quant_per="step")
    assert b.terms["a2a"] == pytest.approx(a.terms["a2a"] * 150 / 40, rel=1e-12)
