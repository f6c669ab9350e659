"""Throughput side of the paper-scale model (issue 6, P5): RATIOS of tokens/GPU/s between recipes and recompute
scopes, from FLOPs per token and named measured rates. No torch import: configs and arithmetic only.

THIS MODEL PREDICTS RATIOS, NOT ABSOLUTE TOKENS/S. Its rates are H200 measurements of our kernels (and of
cuBLAS / cuDNN), its glue term is our unfused torch code's; the paper ran Transformer Engine and DeepGEMM-class
kernels on H100s. What is meant to carry over is the *relative* cost of a recipe or a recompute scope: how many
FLOPs a scope re-runs, how many bytes a recipe converts and sends. ``fp4moe.analysis.throughput_calibration`` holds the measured
rates, checks predicted against measured ratios on our H200 proxy and predicts T1.

Time per token of one GPU (seconds; the slowest pipeline stage bounds a pipeline, so at paper scale the stage
with the largest time is used; with TP = 1 every GPU of a stage does one token's worth of each layer per token):

    t = sum over GEMM groups g of  FLOPs_g / rate(recipe, kind_g, pass)       forward, recompute, dgrad, wgrad
      + conversion bytes / measured kernel bandwidth                          fp8 and mxfp4 only
      + FP8 weight quantization (per micro-batch, amortized over its tokens)  fp8 and mxfp4 only
      + all-to-all remote bytes / link bandwidth (caller states it; no overlap assumed)
      + glue: non-GEMM torch kernels per token (measured, named; optional)

FLOPs (2 per multiply-add) per token, forward, one layer; H hidden, n heads, qk = nope + rope, s sequence:

    MLA        q_down 2 H q_lora, q_up 2 q_lora n qk, kv_down 2 H (kv_lora + rope), kv_up 2 kv_lora n (nope + v),
               core attention (causal) n (qk + v) (s + 1)   [2 n qk + 2 n v per key, (s + 1)/2 keys on average],
               o_proj 2 n v H
    dense MLP  fc1 2 H 2F, fc2 2 F H                       (the first ``first_k_dense`` layers)
    MoE        router 2 H E; routed fc1 2 k H 2f, fc2 2 k f H; shared fc1 2 H 2fs, fc2 2 fs H
    head       output layer 2 H V (BF16: megatron's output layer is outside the FP8 linears); MTP: eh_proj 2 (2H) H
               + one MoE layer + a second head
    backward   2 x forward for every group (dgrad + wgrad for a GEMM; for flash attention this is an
               approximation: its backward re-computes the scores, ~2.5 x forward)

Recompute re-runs in backward (conf/recompute/*.yaml): attn_ln_experts core attention + layernorms + routed
experts' fc1 / SwiGLU / fc2; attn_ln_mlp core attention + layernorms + dense MLPs; mla_up_proj q_up + kv_up
(+ RoPE); full the whole layer forward (and its all-to-alls, ``fp4moe.scale.comm``); none nothing;
attn_block_ln_experts / attn_block_ln_mlp as attn_ln_* with the whole MLA block re-run (every projection and the
core: the reading of the paper's "attention" that fp4moe.analysis.paper_t1 supports). The layernorm and SwiGLU
re-runs are not GEMMs: they cost glue time only (``Rates``' glue terms).

Every rate is a field of ``Rates``, which the caller gives (the measured sets: ``fp4moe.analysis.throughput_calibration``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

from omegaconf import DictConfig

from fp4moe_kernels.constants import FP8_GROUP, MX_BLOCK
from fp4moe_kernels.sizes import FP8_SCALE_BYTES

from ..recipe import Recipe
from .comm import a2a_per_layer
from .memory import _as_cfg, _dims, _scope, _stages, compose_cfg, recipe_of, recomputes_attention_block

SCOPES = ("none", "attn_ln_experts", "attn_ln_mlp", "mla_up_proj", "full")


@dataclass(frozen=True)
class Rates:
    """The model's measured inputs: rates (TFLOP/s = 1e12 FLOP/s, GB/s = 1e9 B/s), the torch glue and the profile
    they were measured in. No defaults for what must be measured (``fp4moe.analysis.throughput_calibration`` builds the measured
    sets); the optional terms default to "not in this code". ``glue=False`` drops the glue term (what a fully fused
    stack would pay: ~0)."""

    fp8_fprop: float                 # dense FP8 GEMM, blockwise 1x128 x 128x128: forward
    fp8_dgrad: float                 # ... input gradient
    fp8_wgrad: float                 # ... weight gradient
    bf16_dense: float                # bf16 a @ b.t()
    grouped_fp8_fraction: float      # the grouped FP8 expert GEMM's rate / the dense FP8 rate of each pass
    bf16_expert: float               # megatron SequentialMLP, one cuBLAS bf16 GEMM per expert
    quant_fp8_row: float             # GB/s of BF16 -> FP8 1x128 row
    quant_fp8_col: float             # BF16 -> FP8 col
    bf16_to_fp4: float               # BF16ToFP4Row
    fp4_to_fp8_row: float            # FP4RowToFP8Row
    fp4_to_fp8_col: float            # FP4RowToFP8Col
    fused_fp4_fp8row: float          # fused BF16 -> (FP4, FP8 row)
    fp4_to_bf16: float               # MXFP4 -> BF16 (SwiGLU input decode)
    # 128x128 FP8 weight quantization, seconds per parameter per micro-batch (or per step: stage_time)
    weight_quant_s_per_param: float
    # Glue: torch elementwise / copy / cat / index kernels, ms over ``glue_tokens`` tokens of the proxy's 4 layers at
    # the profiled setting (``prof_micro_batch``, ``prof_scope``)
    glue_ms_fp8: float
    glue_ms_mxfp4: float
    glue_tokens: int
    # the profile's attention group (cuDNN flash), fp8 and mxfp4 runs, and the setting of the profiled runs
    prof_attention_ms: tuple
    prof_micro_batch: int
    prof_scope: str                  # also the scope the glue was measured at
    # cuDNN flash attention, fwd + bwd, TFLOP/s; 0: derived from the profile at call time (attention_rate_from_profile)
    attention: float = 0.0
    # bf16's own glue over the same tokens (megatron's SwiGLU and token permutation included); 0: fp8's (ASSUMED)
    glue_ms_bf16: float = 0.0
    # of the glue, the routed experts' float32 SwiGLU (fwd + re-run + bwd) where the SwiGLU is not a kernel of its own
    glue_expert_swiglu_ms: float = 0.0
    glue: bool = True
    # fp4moe's fused SwiGLU kernels, seconds per output element [rows, F] (routed and shared experts), forward and
    # backward, per recipe ((recipe, (fwd, bwd)), ...); empty: the SwiGLU is part of the glue
    swiglu_s_per_elem: tuple = ()
    # the mxfp4 SwiGLU kernels store / load the MXFP4 copy of their input themselves (no separate conversions)
    swiglu_fused_fp4_store: bool = False
    # the MLA block's forward elementwise work outside the core attention (q/k concatenations with the RoPE part,
    # RoPE, the q / kv norms, layout copies), ms per glue_tokens over the proxy's 4 layers, fp8 and mxfp4: what a
    # whole-block re-run (attn_block_*) adds to the glue; 0: not measured
    attn_block_glue_ms: tuple = (0.0, 0.0)
    # True: the MXFP4 dispatch quantizes each token once and gathers its k MXFP4 rows (FP4MOE_DISPATCH_QUANTIZE
    # unset); False: it quantizes the k permuted BF16 rows of each token (=rows, the older code)
    dispatch_quantize_per_token: bool = False


# ---------------------------------------------------------------------------------------------- FLOPs

@dataclass(frozen=True)
class Gemm:
    """One GEMM group of a layer: forward FLOPs per token and what runs it ('dense' FP8-able linear, 'bf16'
    linear that stays BF16, 'expert' grouped GEMM, 'attention' core attention). ``k_in`` / ``n_out`` / ``rows``
    (rows per token) size its conversions."""

    name: str
    kind: str
    flops: float
    k_in: int = 0
    n_out: int = 0
    rows: float = 1.0


def _blockable(k: int, n: int) -> bool:
    return k % FP8_GROUP == 0 and n % FP8_GROUP == 0


def layer_gemms(cfg: Any, kind: str) -> list[Gemm]:
    """Forward GEMM groups of one transformer layer (``kind`` 'dense' | 'moe'), FLOPs per token (module
    docstring). A linear whose dims are not multiples of 128 is 'bf16' (it stays BF16 under every recipe)."""
    d = _dims(_as_cfg(cfg))
    qk = d.nope + d.rope
    n = d.n // d.tp

    def lin(name, k_in, n_out, rows=1.0, k="dense"):
        kk = k if (k != "dense" or _blockable(k_in, n_out)) else "bf16"
        return Gemm(name, kk, 2.0 * rows * k_in * n_out, k_in, n_out, rows)

    out = []
    if d.q_lora:
        out += [lin("attn.q_down", d.h, d.q_lora), lin("attn.q_up", d.q_lora, n * qk)]
    else:
        out += [lin("attn.q_up", d.h, n * qk)]
    out += [lin("attn.kv_down", d.h, d.kv_lora + d.rope), lin("attn.kv_up", d.kv_lora, n * (d.nope + d.v)),
            Gemm("attn.core", "attention", float(n * (qk + d.v) * (d.seq + 1))),
            lin("attn.o_proj", n * d.v, d.h)]
    if kind == "dense":
        out += [lin("mlp.fc1", d.h, 2 * d.ffn), lin("mlp.fc2", d.ffn, d.h)]
    elif kind == "moe":
        out += [Gemm("moe.router", "bf16", 2.0 * d.h * d.e, d.h, d.e),
                lin("experts.fc1", d.h, 2 * d.f, d.k, "expert"), lin("experts.fc2", d.f, d.h, d.k, "expert")]
        if d.fs:
            out += [lin("shared.fc1", d.h, 2 * d.fs, 1, "shared"), lin("shared.fc2", d.fs, d.h, 1, "shared")]
    else:
        raise ValueError(f"kind={kind!r}: 'dense' or 'moe'")
    return out


def head_gemms(cfg: Any) -> list[Gemm]:
    d = _dims(_as_cfg(cfg))
    return [Gemm("head.output", "bf16", 2.0 * d.h * d.vocab / d.tp, d.h, d.vocab // d.tp)]


ATTN_BLOCK = ("attn.q_down", "attn.q_up", "attn.kv_down", "attn.kv_up", "attn.core", "attn.o_proj")
RECOMPUTED = {"none": (), "attn_ln_experts": ("attn.core", "experts.fc1", "experts.fc2"),
              "attn_ln_mlp": ("attn.core", "mlp.fc1", "mlp.fc2"), "mla_up_proj": ("attn.q_up", "attn.kv_up"),
              # the whole MLA block re-run (recompute module self_attention): every projection and the core
              "attn_block_ln_experts": ATTN_BLOCK + ("experts.fc1", "experts.fc2"),
              "attn_block_ln_mlp": ATTN_BLOCK + ("mlp.fc1", "mlp.fc2")}
BLOCK_OF = {"attn_ln_experts": "attn_block_ln_experts", "attn_ln_mlp": "attn_block_ln_mlp"}


def recompute_scope(cfg: Any) -> str:
    """The config's recompute scope as ``RECOMPUTED`` names it: memory's ``_scope`` (which names the whole-block
    configs by their core-attention scope and models the block through ``attn_recompute``), with ``attn_block_*``
    where ``recompute.fp4moe_modules`` holds ``self_attention`` (conf/recompute/attn_block_*.yaml)."""
    cfg = _as_cfg(cfg)
    scope = _scope(cfg)
    return BLOCK_OF[scope] if recomputes_attention_block(cfg) else scope


def recomputed(scope: str, gemm: str) -> bool:
    """Whether ``scope`` re-runs GEMM group ``gemm``'s forward in backward ('full': every layer group)."""
    if scope == "full":
        return not gemm.startswith("head.")
    if scope not in RECOMPUTED:
        raise ValueError(f"unknown recompute scope {scope!r}: one of {SCOPES + tuple(BLOCK_OF.values())}")
    return gemm in RECOMPUTED[scope]


def layer_flops(cfg: Any, kind: str, scope: str | None = None) -> dict[str, float]:
    """FLOPs per token of one layer: forward, backward (2 x forward) and recompute (the re-run forward)."""
    cfg = _as_cfg(cfg)
    scope = scope or recompute_scope(cfg)
    g = layer_gemms(cfg, kind)
    fwd = sum(x.flops for x in g)
    rec = sum(x.flops for x in g if recomputed(scope, x.name))
    return {"forward": fwd, "backward": 2 * fwd, "recompute": rec, "total": 3 * fwd + rec}


# ---------------------------------------------------------------------------------------------- time

def _fp8_bytes(k: int) -> float:
    return k + FP8_SCALE_BYTES * k / FP8_GROUP


def _fp4_bytes(k: int) -> float:
    return k / 2 + k / MX_BLOCK


@functools.lru_cache(maxsize=8)
def attention_rate_from_profile(rates: Rates) -> float:
    """TFLOP/s of cuDNN flash attention in the profiled runs (proxy_h200 at ``rates.prof_micro_batch`` and
    ``rates.prof_scope``: forward (+ re-run where the scope re-runs the core) + 2 x forward backward, 4 layers,
    ``rates.glue_tokens`` tokens) / the mean of their attention times."""
    cfg = compose_cfg("proxy_h200", "single_gpu", rates.prof_scope, "fp8")
    cfg.parallel.micro_batch = rates.prof_micro_batch
    core = next(x for x in layer_gemms(cfg, "moe") if x.name == "attn.core").flops
    passes = 3 + recomputed(rates.prof_scope, "attn.core")
    flops = passes * core * int(cfg.model.num_layers) * rates.glue_tokens
    ms = sum(rates.prof_attention_ms) / len(rates.prof_attention_ms)
    return flops / (ms * 1e-3) / 1e12


@dataclass
class TimeBreakdown:
    """Seconds per token of one GPU (the slowest pipeline stage), by term; ``ratio`` of two of them is the model's
    prediction of their tokens/GPU/s ratio (inverse time)."""

    recipe: str
    scope: str
    terms: dict = field(default_factory=dict)   # name -> seconds per token

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    def group(self, prefix: str) -> float:
        return sum(v for k, v in self.terms.items() if k.startswith(prefix))


def _gemm_time(g: Gemm, recipe: Recipe, rates: Rates, att: float, rec: bool) -> dict[str, float]:
    """GEMM seconds per token of one group: forward (+ re-run), dgrad, wgrad."""
    passes = 2 if rec else 1
    if g.kind == "attention":
        return {"gemm.attention": (passes + 2) * g.flops / (att * 1e12)}
    fp8 = recipe.fp8_compute and g.kind != "bf16" and recipe.applies_to(
        {"dense": "dense", "expert": "expert", "shared": "shared_expert"}[g.kind])
    key = "gemm.expert" if g.kind == "expert" else "gemm.dense"
    if not fp8:
        r = rates.bf16_expert if g.kind == "expert" else rates.bf16_dense
        return {key: (passes + 2) * g.flops / (r * 1e12)}
    f = rates.grouped_fp8_fraction if g.kind == "expert" else 1.0
    t = g.flops / (f * 1e12) * (passes / rates.fp8_fprop + 1 / rates.fp8_dgrad + 1 / rates.fp8_wgrad)
    return {key: t}


def _conv_time(g: Gemm, recipe: Recipe, rates: Rates, rec: bool) -> float:
    """Conversion-kernel seconds per token of one FP8 GEMM group (bytes = minimum read + write, module rates)."""
    if g.kind in ("attention", "bf16") or not recipe.fp8_compute:
        return 0.0
    if not recipe.applies_to({"dense": "dense", "expert": "expert", "shared": "shared_expert"}[g.kind]):
        return 0.0
    k, n, r = g.k_in, g.n_out, g.rows
    gb = 1e9
    passes = 2 if rec else 1
    # backward: dY (bf16 [r, n]) -> FP8 row for dgrad and FP8 col for wgrad (both recipes: gradients stay FP8)
    bwd = r * (2 * n + _fp8_bytes(n)) * (1 / (rates.quant_fp8_row * gb) + 1 / (rates.quant_fp8_col * gb))
    fp4_in = recipe.save_fp4 or (g.name == "experts.fc1" and recipe.expert_input_fp4)
    if not fp4_in:
        fwd = r * (2 * k + _fp8_bytes(k)) * (1 / (rates.quant_fp8_row * gb) + 1 / (rates.quant_fp8_col * gb))
        return passes * fwd + bwd
    if g.name == "experts.fc1" and recipe.expert_input_fp4:
        # the dispatched rows arrive MXFP4 (encoded in the dispatch, not per re-run: each token once, its k rows
        # gathered as MXFP4, or each of its r rows) and feed fc1 through FP4RowToFP8Row; wgrad rebuilds columns
        # with FP4RowToFP8Col
        enc_rows = 1.0 if rates.dispatch_quantize_per_token else r
        enc = enc_rows * (2 * k + _fp4_bytes(k)) / (rates.bf16_to_fp4 * gb) if recipe.dispatch_fp4 else 0.0
        fwd = r * (_fp4_bytes(k) + _fp8_bytes(k)) / (rates.fp4_to_fp8_row * gb)
    else:
        enc = 0.0
        fwd = r * (2 * k + _fp4_bytes(k) + _fp8_bytes(k)) / (rates.fused_fp4_fp8row * gb)
    col = r * (_fp4_bytes(k) + _fp8_bytes(k)) / (rates.fp4_to_fp8_col * gb)
    t = enc + passes * fwd + col + bwd
    if g.name in ("experts.fc1", "shared.fc1") and recipe.activation_fp4_store and not rates.swiglu_fused_fp4_store:
        # SwiGLU input [r, n] stored MXFP4: encode each forward, decode to BF16 in backward
        t += passes * r * (2 * n + _fp4_bytes(n)) / (rates.bf16_to_fp4 * gb)
        t += r * (_fp4_bytes(n) + 2 * n) / (rates.fp4_to_bf16 * gb)
    return t


def _glue(recipe: Recipe, scope: str, rates: Rates, scale: float) -> dict[str, float]:
    """Measured glue seconds per token x ``scale`` (bf16: its own where measured, else fp8's, ASSUMED). With the SwiGLU
    in the glue (``glue_expert_swiglu_ms`` > 0, measured at attn_ln_experts): the experts' SwiGLU forward share (1/4 of
    it: forward, re-run, 2 x backward) is taken off where the experts are not re-run. With the SwiGLU as its own
    term (``swiglu_s_per_elem``): the glue as measured for every scope. full re-runs the whole forward, so its glue is
    that of the measured scope x 4/3 (forward : backward glue = 1 : 2, ASSUMED). The layernorm and attention
    elementwise re-runs are left in the glue as measured (attn_ln_experts / attn_ln_mlp both re-run them), not taken
    off for none / mla_up_proj; attn_block_* add the MLA block's forward elementwise ops once more
    (``attn_block_glue_ms``; 0 where not measured)."""
    if not rates.glue:
        return {}
    mx = recipe.name == "mxfp4"
    ms = rates.glue_ms_mxfp4 if mx else rates.glue_ms_fp8
    if recipe.name == "bf16" and rates.glue_ms_bf16:
        ms = rates.glue_ms_bf16
    if rates.glue_expert_swiglu_ms:
        none = ms - rates.glue_expert_swiglu_ms / 4
        ms = {"attn_ln_experts": ms, "attn_block_ln_experts": ms, "full": none * 4 / 3}.get(scope, none)
    elif scope == "full":
        ms = ms * 4 / 3
    if scope in BLOCK_OF.values():
        ms += rates.attn_block_glue_ms[1 if mx else 0]
    return {"glue": scale * ms * 1e-3 / rates.glue_tokens}


def _swiglu(cfg: DictConfig, recipe: Recipe, scope: str, rates: Rates) -> float:
    """Seconds per token of fp4moe's fused SwiGLU kernels in one MoE layer (fp8 / mxfp4; bf16: megatron's, in the
    glue): elements k f (routed) + fs (shared) x (forward x passes + backward); the routed forward re-runs where the
    scope re-runs the experts, the shared one under full."""
    per = dict(rates.swiglu_s_per_elem)
    if recipe.name not in per:
        return 0.0
    fwd, bwd = per[recipe.name]
    d = _dims(cfg)
    routed, shared = d.k * d.f, d.fs
    r_pass = 1 + recomputed(scope, "experts.fc1")
    s_pass = 1 + (scope == "full")
    return routed * (fwd * r_pass + bwd) + shared * (fwd * s_pass + bwd)


def _gemms_of(cfg: DictConfig) -> Callable[[str], list[Gemm]]:
    """``layer_gemms(cfg, kind)``, computed once per kind (reading a config's attributes is slow; a stage has up to
    dozens of layers)."""
    memo: dict[str, list[Gemm]] = {}

    def of(kind: str) -> list[Gemm]:
        if kind not in memo:
            memo[kind] = layer_gemms(cfg, kind)
        return memo[kind]

    return of


def _params_fp8(cfg: DictConfig, letters: str, first: int, recipe: Recipe,
                gemms: Callable[[str], list[Gemm]] | None = None) -> float:
    """Parameters of a stage that an FP8 recipe quantizes each micro-batch (128x128 weights); ``gemms``: the layer
    GEMMs by kind (default: ``layer_gemms``)."""
    if not recipe.fp8_compute:
        return 0.0
    gemms = gemms or _gemms_of(cfg)
    d = _dims(cfg)
    tot, layer = 0.0, first
    for c in letters:
        if c not in "tm":
            continue
        kind = "dense" if (c == "t" and layer < d.first_dense) else "moe"
        for g in gemms(kind):
            if g.kind == "attention" or g.kind == "bf16":
                continue
            if not recipe.applies_to({"dense": "dense", "expert": "expert", "shared": "shared_expert"}[g.kind]):
                continue
            w = g.k_in * g.n_out
            tot += w * (d.e // d.ep if g.kind == "expert" else 1)
        layer += c == "t"
    return tot


def stage_time(cfg: Any, rates: Rates, *, link_bandwidth_gb_s: float | None = None,
               glue_scale: float = 1.0, weight_quant_per: str = "micro_batch",
               recipe: Recipe | None = None) -> list[TimeBreakdown]:
    """Seconds per token of every pipeline stage (module docstring); the a2a term needs ``link_bandwidth_gb_s``
    when EP > 1 (no default: the caller states it). ``glue_scale`` multiplies the measured per-layer glue (1 on
    the proxy). ``weight_quant_per``: 'micro_batch' (ours: every micro-batch re-quantizes its FP8 weights) or
    'step' (Transformer Engine caches the FP8 weights between the micro-batches of a step). ``recipe``: the config's,
    already parsed (else ``cfg.precision``'s, parsed here once: fp4moe.scale.memory.recipe_of)."""
    cfg = _as_cfg(cfg)
    recipe = recipe_of(cfg, recipe)
    scope = recompute_scope(cfg)
    d = _dims(cfg)
    att = rates.attention or attention_rate_from_profile(rates)
    tokens_mb = int(cfg.parallel.micro_batch) * int(cfg.parallel.seq_length)
    if weight_quant_per not in ("micro_batch", "step"):
        raise ValueError(f"weight_quant_per={weight_quant_per!r}: 'micro_batch' or 'step'")
    tokens_wq = tokens_mb if weight_quant_per == "micro_batch" else (
        int(cfg.parallel.global_batch) // int(cfg.parallel.data) * int(cfg.parallel.seq_length))
    a2a = None
    if d.ep > 1:
        if not link_bandwidth_gb_s:
            raise ValueError("EP > 1: state link_bandwidth_gb_s (GB/s per GPU, one direction, achieved)")
        lay = a2a_per_layer(cfg, recipe)
        a2a = lay.total_remote_bytes / tokens_mb / (link_bandwidth_gb_s * 1e9)
    stages, out, layer = _stages(cfg), [], 0
    gemms = _gemms_of(cfg)
    head = head_gemms(cfg)
    swiglu = _swiglu(cfg, recipe, scope, rates) if rates.swiglu_s_per_elem and rates.glue else 0.0
    for letters in stages:
        tb = TimeBreakdown(recipe.name, scope)
        first = layer
        n_layers = 0
        for c in letters:
            if c in "tm":
                kind = "dense" if (c == "t" and layer < d.first_dense) else "moe"
                gems = gemms(kind)
                if c == "m":
                    gems = gems + [Gemm("mtp.eh_proj", "bf16", 2.0 * 2 * d.h * d.h, 2 * d.h, d.h)] + head
                for g in gems:
                    rec = recomputed(scope, g.name) and not g.name.startswith("mtp.")
                    for key, t in _gemm_time(g, recipe, rates, att, rec).items():
                        tb.terms[key] = tb.terms.get(key, 0.0) + t
                    tb.terms["conversion"] = tb.terms.get("conversion", 0.0) + _conv_time(g, recipe, rates, rec)
                if kind == "moe" and rates.swiglu_s_per_elem and rates.glue:
                    tb.terms["swiglu"] = tb.terms.get("swiglu", 0.0) + swiglu
                if kind == "moe" and a2a is not None:
                    tb.terms["a2a"] = tb.terms.get("a2a", 0.0) + a2a
                layer += c == "t"
                n_layers += 1
            elif c == "L":
                for key, t in _gemm_time(head[0], recipe, rates, att, False).items():
                    tb.terms[key] = tb.terms.get(key, 0.0) + t
        if recipe.fp8_compute:
            tb.terms["weight_quant"] = (_params_fp8(cfg, letters, first, recipe, gemms)
                                        * rates.weight_quant_s_per_param / tokens_wq)
        if n_layers:
            # glue measured per token of the proxy's 4-layer stack: per layer x this stage's layers
            for k, v in _glue(recipe, scope, rates, glue_scale * n_layers / 4).items():
                tb.terms[k] = v
        out.append(tb)
    return out


def time_per_token(cfg: Any, rates: Rates, **kw) -> TimeBreakdown:
    """The slowest stage's ``TimeBreakdown`` (a pipeline runs at its slowest stage's pace)."""
    return max(stage_time(cfg, rates, **kw), key=lambda t: t.total)


__all__ = ["ATTN_BLOCK", "BLOCK_OF", "Gemm", "RECOMPUTED", "Rates", "SCOPES", "TimeBreakdown",
           "attention_rate_from_profile", "head_gemms", "layer_flops", "layer_gemms", "recompute_scope", "recomputed",
           "stage_time", "time_per_token"]
