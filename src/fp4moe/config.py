"""Checks and derived quantities of a composed Hydra config (conf/train.yaml and its groups).

No torch import: this runs at composition time, before anything heavy, in the trainer (P3), the launcher's dry
run (P4) and the tests. Three entry points::

    check(cfg)          raise ConfigError (a ValueError) naming the fix when the config cannot run
    derived(cfg)        world size, tokens per step, gradient accumulation, steps for a token budget, ...
    param_counts(model) total and activated parameters of a conf/model/ entry (never hard-coded in YAML)

Rules checked (``check``), each with its own message:

1. world size: ``parallel.world_size == cluster.nodes * cluster.gpus_per_node``.
2. dense grid: ``TP * PP * CP * DP == parallel.world_size`` (megatron-core's decoder rank grid).
3. experts: ``model.moe.num_experts % EP == 0`` (megatron-core: every EP rank holds the same number of experts).
4. expert grid (megatron-core ``initialize_model_parallel``, MoE parallel folding): the expert grid is
   ETP x EP x EDP x PP over the same ranks, ETP defaulting to TP, so ``world_size % (ETP * EP * PP) == 0``,
   i.e. ``ETP * EP`` must divide ``TP * CP * DP``; the expert data-parallel size is world / (ETP * EP * PP).
5. batch: ``global_batch % (micro_batch * DP) == 0`` (gradient accumulation steps = the quotient).
6. pipeline: ``num_layers % PP == 0``, unless ``parallel.pipeline_layout`` spells the stages explicitly in
   megatron-core's ``--pipeline-model-parallel-layout`` syntax (e.g. the paper's ``E|(tt|)*30,tmL``): then it must
   have PP * VPP stages, none empty, exactly ``num_layers`` 't' and ``mtp_num_layers`` 'm', one 'E' first and one
   'L' last.
7. recompute: a module handed to megatron-core (``recompute.megatron_modules``) that needs Transformer Engine
   there (``layernorm``: output-discarding checkpoint crashes without TE; ``moe_act``: needs TE's grouped MLP)
   is refused while ``backend.transformer_impl`` is 'local'; such modules go in ``recompute.fp4moe_modules``. The
   scope's own rules are :class:`fp4moe.settings.Recompute`'s.
8. data: ``data.path`` must be set for a user corpus; the precision group is parsed into its Recipe by
   :meth:`fp4moe.settings.Settings.from_config` (``Settings.precision``).
9. dispatcher: ``parallel.dispatcher`` is one fp4moe builds (``alltoall``, ``allgather``; 'flex' needs DeepEP, not
   in the stack), and the fp8 / mxfp4 recipes, whose quantized all-to-all replaces megatron's, need ``alltoall``.
10. optimizer: the ``optimizer`` group reads as an :class:`OptimizerSetting` (types, values, combinations that
   megatron-core 0.16.1 can build without Transformer Engine) and ``train.adamw`` has lr >= min_lr >= 0.

Before all of these, :meth:`fp4moe.settings.Settings.from_config`: every group's values as its frozen dataclass,
with the right type and range (``train.steps=-3``, ``train.steps=abc``, ``parallel.micro_batch=0`` are one line
each; a config composed from conf/ already had its types checked by Hydra against the same dataclasses).
"""
from __future__ import annotations

import math
import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from fp4moe_kernels.constants import FP8_GROUP

from fp4moe.settings import (FP4MOE_RECOMPUTE_MODULES, GRAD_DTYPES, MEGATRON_RECOMPUTE_MODULES,
                             NESTED_IN_SELF_ATTENTION, TE_ONLY_RECOMPUTE_MODULES, ConfigError, OptimizerSetting,
                             Settings, nested_in_self_attention)

# The recompute modules (megatron-core's, those that need Transformer Engine there, fp4moe's own) and their rules
# are fp4moe.settings.Recompute's; re-exported here for the code that checks a whole config.
TRANSFORMER_IMPLS = ("local", "transformer_engine")
DISPATCHERS = ("alltoall", "allgather")  # megatron-core token dispatchers fp4moe builds ('flex' needs DeepEP)


# ---------------------------------------------------------------------------------------------- helpers

def _get(cfg: Any, dotted: str, default: Any = None) -> Any:
    v = OmegaConf.select(cfg, dotted, default=default) if isinstance(cfg, (DictConfig, ListConfig)) else None
    if v is None and not isinstance(cfg, (DictConfig, ListConfig)):
        cur = cfg
        for part in dotted.split("."):
            if not isinstance(cur, dict) or part not in cur:
                return default
            cur = cur[part]
        v = cur
    return default if v is None else v


def _as_cfg(cfg: Any) -> DictConfig:
    return cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)


def parse_pipeline_layout(layout: str) -> list[str]:
    """megatron-core's ``PipelineParallelLayerLayout.parse_str_to_list`` grammar, without torch: commas are
    cosmetic, ``(group)*n`` and ``x*n`` repeat, '|' separates stages; letters E (embedding), t (transformer
    layer), m (MTP layer), L (loss). Returns one string per stage."""
    s = layout.replace(",", "").replace(" ", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        s = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), s)
    stages = s.split("|")
    bad = sorted(set(s) - set("EtmL|"))
    if bad:
        raise ConfigError(f"parallel.pipeline_layout={layout!r} has unknown letters {bad}: use E, t, m, L, '|', "
                          "'(..)*n' and ',' (megatron-core --pipeline-model-parallel-layout)")
    return stages


# ---------------------------------------------------------------------------------------------- parameters

def _attention_params(m: Any) -> int:
    h, heads = int(m.hidden_size), int(m.num_attention_heads)
    mla = m.mla
    nope, rope, v = int(mla.qk_head_dim), int(mla.qk_pos_emb_head_dim), int(mla.v_head_dim)
    qk = nope + rope
    q_lora = mla.get("q_lora_rank")
    if q_lora:  # q down-projection, its RMSNorm, q up-projection
        q = h * q_lora + q_lora + q_lora * heads * qk
    else:
        q = h * heads * qk
    kv_lora = int(mla.kv_lora_rank)
    kv = h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v)  # down (+ shared rope key), norm, up
    out = heads * v * h
    return q + kv + out


def _moe_layer_params(m: Any) -> tuple[int, int]:
    """(total, activated) of one MoE MLP (router, routed experts, shared experts), without the layer norms."""
    h, moe = int(m.hidden_size), m.moe
    f, e, k = int(moe.ffn_hidden_size), int(moe.num_experts), int(moe.router_topk)
    expert = 3 * h * f  # SwiGLU: fc1 (gate + up) 2*h*f, fc2 f*h
    shared = 3 * h * f * int(moe.get("shared_experts", 0) or 0)
    router = h * e
    return router + e * expert + shared, router + k * expert + shared


def param_counts(model_cfg: Any) -> dict[str, int]:
    """Total and activated (per token) parameter counts of a ``conf/model`` entry.

    Counts what megatron-core builds: embedding, untied output head, MLA projections with their q/kv latent
    RMSNorms, two RMSNorms per layer, dense SwiGLU MLPs for the first ``moe.first_k_dense`` layers, router +
    routed + shared SwiGLU experts for the others, the final norm. Left out: router expert bias (a buffer) and
    rotary tables. ``total`` / ``active`` are the main model, as DeepSeek quotes them (671B / 37B); the MTP
    modules (a MoE layer + 2 norms + eh_proj each, embedding and head shared) are in ``mtp`` (and in
    ``total_with_mtp``). ``active`` includes the embedding and output head.
    """
    m = _as_cfg(model_cfg)
    h, layers, vocab = int(m.hidden_size), int(m.num_layers), int(m.vocab_size)
    dense_k = int(m.moe.first_k_dense)
    attn = _attention_params(m)
    norms = 2 * h
    dense_layer = attn + norms + 3 * h * int(m.ffn_hidden_size)
    moe_total, moe_active = _moe_layer_params(m)
    moe_layer_total, moe_layer_active = attn + norms + moe_total, attn + norms + moe_active
    embed = vocab * h
    head = 0 if m.get("tie_embeddings", False) else vocab * h
    n_moe = layers - dense_k
    total = embed + head + h + dense_k * dense_layer + n_moe * moe_layer_total
    active = embed + head + h + dense_k * dense_layer + n_moe * moe_layer_active
    n_mtp = int(m.get("mtp_num_layers", 0) or 0)
    mtp_module = 2 * h + 2 * h * h + h  # enorm, hnorm, eh_proj, its final norm
    mtp = n_mtp * (mtp_module + moe_layer_total)
    return {
        "total": total,
        "active": active,
        "embedding": embed + head,
        "mtp": mtp,
        "total_with_mtp": total + mtp,
        "active_with_mtp": active + n_mtp * (mtp_module + moe_layer_active),
    }


# ---------------------------------------------------------------------------------------------- derived

def world_size(cfg: Any) -> int:
    return int(cfg.cluster.nodes) * int(cfg.cluster.gpus_per_node)


def derived(cfg: Any) -> dict[str, Any]:
    """Quantities computed from the config, never written in YAML: world size, tokens per step, gradient
    accumulation steps, training steps (``train.steps``, or ceil(``train.tokens`` / tokens per step)),
    warm-up steps (``train.schedule.warmup_steps`` or ceil(``warmup_tokens`` / tokens per step)), expert
    data-parallel size, experts per EP rank, and the model's parameter counts."""
    cfg = _as_cfg(cfg)
    p = cfg.parallel
    world = world_size(cfg)
    tp, pp, dp, ep = (int(p.tensor), int(p.pipeline), int(p.data), int(p.expert))
    etp = int(p.expert_tensor) if p.get("expert_tensor") is not None else tp
    micro, gbs, seq = int(p.micro_batch), int(p.global_batch), int(p.seq_length)
    tokens_per_step = gbs * seq
    t = cfg.train
    if t.get("steps") is not None:
        steps = int(t.steps)
    elif t.get("tokens") is not None:
        steps = math.ceil(float(t.tokens) / tokens_per_step)
    else:
        raise ConfigError("train.steps and train.tokens are both null: set one (a step count or a token budget)")
    sched = t.get("schedule") or {}
    if sched.get("warmup_steps") is not None:
        warmup = int(sched.warmup_steps)
    elif sched.get("warmup_tokens") is not None:
        warmup = math.ceil(float(sched.warmup_tokens) / tokens_per_step)
    else:
        warmup = 0
    counts = param_counts(cfg.model)
    return {
        "world_size": world,
        "tokens_per_step": tokens_per_step,
        "grad_accum_steps": gbs // (micro * dp) if micro * dp else 0,
        "steps": steps,
        "tokens": steps * tokens_per_step,
        "warmup_steps": warmup,
        "expert_tensor": etp,
        "expert_data_parallel": world // (etp * ep * pp) if etp * ep * pp else 0,
        "experts_per_rank": int(cfg.model.moe.num_experts) // ep if ep else 0,
        "params_total": counts["total"],
        "params_active": counts["active"],
    }


# ---------------------------------------------------------------------------------------------- check

def _check_fp8_shapes(s: Settings) -> None:
    """The FP8 recipes' GEMMs take 128-wide groups (``FP8_GROUP``) along both dims of every weight they quantize: the
    routed experts' [2F/ETP, H] and [H, F/ETP] on each GPU (the shared expert's F x shared_experts follows, at TP 1,
    which these recipes need; the dense linears of ``scope: all_linears`` whose dims are not multiples of 128 stay
    BF16 instead: fp4moe.model.recipe_dense). Refused here, before a run folder or an MLflow run exists, rather than
    at the first forward."""
    recipe, m, etp = s.precision, s.model, s.parallel.etp
    if not recipe.fp8_compute:
        return
    for key, value, split in (("model.hidden_size", m.hidden_size, 1),
                              ("model.moe.ffn_hidden_size", m.moe.ffn_hidden_size, etp)):
        if value % split or (value // split) % FP8_GROUP:
            per = f" / {split} (its tensor-parallel split) = {value / split:g}" if split > 1 else ""
            raise ConfigError(
                f"{key}={value}{per}: precision={recipe.name} runs the experts' GEMMs in FP8, whose 1x128 / 128x128 "
                f"scale blocks need a multiple of {FP8_GROUP} on every GPU: pick such a size, or precision=bf16")


def check(cfg: Any, settings: Settings | None = None) -> dict[str, Any]:
    """Raise ``ConfigError`` naming the fix when ``cfg`` cannot run; return ``derived(cfg)`` otherwise. ``settings``:
    ``Settings.from_config(cfg)`` where the caller built it already."""
    cfg = _as_cfg(cfg)
    s = settings or Settings.from_config(cfg)  # types and ranges first: the rules below compute with the values
    p, m, c = s.parallel, s.model, s.cluster
    tp, pp, cp, dp, ep = p.tensor, p.pipeline, p.context, p.data, p.expert
    vpp = p.virtual_pipeline or 1
    etp = p.etp

    # 1. world size vs cluster
    world, nodes, gpn = p.world_size, c.nodes, c.gpus_per_node
    if world != nodes * gpn:
        fix = f"cluster.nodes={world // gpn}" if world % gpn == 0 else f"a parallel layout for {nodes * gpn} GPUs"
        raise ConfigError(
            f"parallel.world_size={world} but cluster {c.name!r} gives cluster.nodes x cluster.gpus_per_node = "
            f"{nodes} x {gpn} = {nodes * gpn}: set {fix}, or change parallel.world_size and parallel.data together")
    # 2. dense grid
    if tp * pp * cp * dp != world:
        want = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else None
        fix = (f"parallel.data={want}" if want else
               f"tensor x pipeline x context (now {tp * pp * cp}) to a divisor of {world}, then data = the quotient")
        raise ConfigError(
            f"parallel.tensor x pipeline x context x data = {tp} x {pp} x {cp} x {dp} = {tp * pp * cp * dp} != "
            f"parallel.world_size={world}: set {fix}")
    # 3. experts split evenly over EP
    n_exp = m.moe.num_experts
    if n_exp % ep:
        raise ConfigError(
            f"model.moe.num_experts={n_exp} is not divisible by parallel.expert={ep}: every EP rank must hold the "
            f"same number of experts; pick parallel.expert from the divisors of {n_exp}")
    # 4. expert grid (megatron-core MoE parallel folding)
    if (tp * cp * dp) % (etp * ep):
        raise ConfigError(
            f"parallel.expert_tensor x expert = {etp} x {ep} = {etp * ep} must divide tensor x context x data = "
            f"{tp} x {cp} x {dp} = {tp * cp * dp} (megatron-core: world_size % (ETP x EP x PP) == 0, the expert "
            f"grid folds onto the same ranks as the dense one): lower parallel.expert or raise parallel.data")
    # 5. batch
    micro, gbs = p.micro_batch, p.global_batch
    if gbs % (micro * dp):
        raise ConfigError(
            f"parallel.global_batch={gbs} is not a multiple of micro_batch x data = {micro} x {dp} = {micro * dp}: "
            f"set parallel.global_batch to a multiple of {micro * dp} (gradient accumulation = the quotient)")
    # 6. pipeline stages
    layers, n_mtp = m.num_layers, m.mtp_num_layers
    layout = p.pipeline_layout
    if layout:
        stages = parse_pipeline_layout(str(layout))
        joined = "".join(stages)
        problems = []
        if len(stages) != pp * vpp:
            problems.append(f"{len(stages)} stages, pipeline x virtual_pipeline = {pp * vpp}")
        if joined.count("t") != layers:
            problems.append(f"{joined.count('t')} 't' layers, model.num_layers = {layers}")
        if joined.count("m") != n_mtp:
            problems.append(f"{joined.count('m')} 'm' layers, model.mtp_num_layers = {n_mtp}")
        if joined.count("E") != 1 or not stages[0].startswith("E") or joined.count("L") != 1 \
                or not stages[-1].endswith("L"):
            problems.append("needs one 'E' at the start of the first stage and one 'L' at the end of the last")
        empty = [i for i, st in enumerate(stages) if not st]
        if empty:
            problems.append(f"stage(s) {empty} hold nothing (every pipeline rank needs at least one letter)")
        if problems:
            raise ConfigError(f"parallel.pipeline_layout={str(layout)!r} does not fit: {'; '.join(problems)}: "
                              "fix the layout string or parallel.pipeline")
    elif layers % (pp * vpp):
        raise ConfigError(
            f"model.num_layers={layers} is not divisible by parallel.pipeline x virtual_pipeline = {pp * vpp}: "
            "choose a pipeline size dividing the layer count, or spell an uneven split in parallel.pipeline_layout "
            "(megatron-core syntax, e.g. 'E|(tt|)*30,tmL')")
    # 7. recompute vs backend
    impl = str(_get(cfg, "backend.transformer_impl", "local"))
    if impl not in TRANSFORMER_IMPLS:
        raise ConfigError(f"backend.transformer_impl={impl!r}: pick one of {', '.join(TRANSFORMER_IMPLS)}")
    # the recompute scope's own rules (granularity, module names, nesting, method) are fp4moe.settings.Recompute's
    te = s.recompute.te_only_modules
    if impl == "local" and te:
        why = "; ".join(f"{x}: {TE_ONLY_RECOMPUTE_MODULES[x]}" for x in te)
        alt = [x for x in te if x in FP4MOE_RECOMPUTE_MODULES]
        fix = (f"move {alt} to recompute.fp4moe_modules (our implementation)" if alt else
               "drop them (for the expert activation use fp4moe_modules: [moe_expert])")
        raise ConfigError(
            f"recompute.megatron_modules {list(te)} need Transformer Engine in megatron-core, but "
            f"backend.transformer_impl='local' ({why}): {fix}, or pick another recompute scope")
    # 8. precision and data: the recipe was parsed (and its combinations checked) once, into s.precision
    recipe = s.precision
    _check_fp8_shapes(s)
    # 9. token dispatcher
    dispatcher = p.dispatcher
    if dispatcher not in DISPATCHERS:
        why = (" needs DeepEP (megatron-core's 'flex'), which is not in fp4moe's stack" if dispatcher == "flex"
               else " is not a megatron-core dispatcher fp4moe builds")
        raise ConfigError(f"parallel.dispatcher={dispatcher!r}{why}: set parallel.dispatcher=alltoall (or allgather "
                          "under precision=bf16)")
    if recipe.name != "bf16" and dispatcher != "alltoall":
        raise ConfigError(f"precision={recipe.name} brings its own quantized all-to-all, on megatron-core's alltoall "
                          f"dispatcher, but parallel.dispatcher={dispatcher!r}: set parallel.dispatcher=alltoall")
    # 10. optimizer
    setting = s.optimizer  # its own combinations (OptimizerSetting); lr >= min_lr >= 0: train.adamw's (AdamW)
    if setting.main_grads_dtype == "bf16" and s.train.params_dtype != "bf16":
        raise ConfigError(f"optimizer={setting.name} keeps BF16 main grads, which megatron-core supports for BF16 "
                          "parameters only: set train.params_dtype=bf16 or pick optimizer=gpu_fp32 / distributed")
    if s.data.name == "user_corpus" and not s.data.path:
        raise ConfigError("data=user_corpus needs a corpus: export FP4MOE_CORPUS=/path/to/text-or-jsonl-or-prefix "
                          "or pass data.path=...")
    d = derived(cfg)
    # 11. a profiler window the run never closes writes nothing (fp4moe.train.profile stops it silently at the end)
    window = s.train.profile.steps
    if window and int(window[-1]) > d["steps"]:
        raise ConfigError(f"train.profile.steps={list(window)} ends after the run's last step, {d['steps']}: the "
                          "window would never close and no profile would be written; profile steps <= "
                          f"{d['steps']} or train more steps")
    return d


__all__ = ["ConfigError", "check", "Settings",
           "OptimizerSetting", "GRAD_DTYPES", "DISPATCHERS", "derived", "param_counts", "parse_pipeline_layout", "world_size",
           "MEGATRON_RECOMPUTE_MODULES", "TE_ONLY_RECOMPUTE_MODULES", "FP4MOE_RECOMPUTE_MODULES",
           "NESTED_IN_SELF_ATTENTION", "nested_in_self_attention"]
