"""The known-harmless warnings and log lines of megatron-core 0.16.1 (some of them torch's, about megatron's calls),
MLflow and urllib3, silenced in one place.

Every run printed ~17 of them; each entry below says where it comes from and why it is harmless here. Nothing else
is hidden: a filter matches its message *and* the module that emits it, so the same words from fp4moe or another
library still show (torch's deprecation of two collectives is emitted by torch's own wrapper for every caller:
fp4moe calls neither). ``install()`` must run before ``megatron.core`` is imported (most of them are emitted
at import time); the trainer (``python -m fp4moe.train``, and the benchmark jobs it runs), the data pipeline
(``fp4moe.data.indexed``) call it first. Idempotent; imports nothing heavy.
"""
from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    """One silenced message: a ``warnings.warn`` from a module matching ``source`` (kind "warning"), or a record of
    the logger named ``source`` (kind "log"); ``message`` is a regular expression matched at the message's start."""

    kind: str      # "warning" | "log"
    source: str    # warning: regex of the emitting module; log: the logger's exact name
    message: str
    why: str


_TE = "Transformer Engine and Apex are not installed"
KNOWN: tuple[Known, ...] = (
    Known("warning", r"megatron\.core\.", re.escape(_TE),
          "megatron-core's optimizer, clip_grads and Megatron-FSDP (4 variants, at import): without TE/Apex they use "
          "their torch implementations, which are the ones this project runs (backend.transformer_impl=local, "
          "issue 4); the fused multi-tensor kernels only speed up the optimizer step"),
    Known("warning", r"megatron\.core\.", re.escape("Apex is not installed. Falling back to Torch Norm"),
          "models/backends.py and gpt_layer_specs.py (at import): the local backend's LayerNorm/RMSNorm are torch's, "
          "as intended; fp4moe.model builds its own layer specs"),
    Known("warning", r"megatron\.core\.transformer\.transformer_config",
          re.escape("If you are using transformer_engine as the transformer implementation, the core_attn"),
          "TransformerConfig with recompute_modules containing core_attn (recompute=attn_ln_*): the warning is about "
          "TE's fused attention; this project's core attention is megatron's local (unfused) one, whose recompute "
          "is what the paper's 'attention' scope measures"),
    Known("warning", r"megatron\.core\.transformer\.transformer_config", re.escape("full scope is deprecated"),
          "TransformerConfig's default cuda_graph_scope='full' (every config, megatron-core 0.16.1's own default): "
          "no CUDA graphs are captured (cuda_graph_impl is none)"),
    Known("warning", r"megatron\.core\.optimizer\.",
          re.escape("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
          "DistributedOptimizer.zero_grad with FP32 parameters (train.params_dtype=fp32, a distributed optimizer "
          "setting): its shard_fp32_groups are views of the FP32 parameters, not leaves, and megatron's "
          "_zero_grad_group_helper reads their .grad (megatron's own comment there: 'throws grad-access warning'); "
          "the gradients live in DDP's main_grad buffers, which it zeroes separately"),
    *(Known("warning", r"torch\.distributed\.c10d_logger",
            re.escape(f"`torch.distributed.{old}` is deprecated. Please use `torch.distributed.{new}`"),
            f"megatron-core 0.16.1's DDP and distributed optimizer (every step) call {old}, which torch 2.13 renames "
            f"{new} (the same collective); torch's deprecation wrapper emits it, whoever calls, and fp4moe calls "
            "neither (tests/test_run_summary.py checks its sources)")
      for old, new in (("all_gather_into_tensor", "all_gather_single"),
                       ("reduce_scatter_tensor", "reduce_scatter_single"))),
    Known("warning", r"megatron\.core\.dist_checkpointing\.",
          re.escape("`load_state_dict` is deprecated and will be removed in future versions. Please use `load`"),
          "resuming from a sharded checkpoint: megatron-core 0.16.1's torch_dist strategy reads it with "
          "torch.distributed.checkpoint.load_state_dict, which torch deprecates in favour of load (the same reader)"),
    Known("warning", r"torch\.distributed\.checkpoint\.",
          re.escape("Please use DTensor instead and we are deprecating ShardedTensor"),
          "resuming from a sharded checkpoint: megatron-core 0.16.1's torch_dist format hands its shards to torch as "
          "ShardedTensors (megatron's on-disk format); fp4moe makes none itself (fp4moe.train.checkpoint goes through "
          "megatron's dist_checkpointing)"),
    Known("log", "megatron.core.transformer.transformer_layer", re.escape("Unknown MLP type"),
          "TransformerLayer building fp4moe's MoE layer (fp4moe.model.gpt_model: RecipeMoELayer, a subclass of "
          "megatron's MoELayer, which that check compares by identity): it passes the default kwargs, so the layer takes its "
          "process groups from megatron's parallel state, which the trainer initialises"),
    Known("log", "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision",
          re.escape("Using Megatron-FSDP without Transformer Engine"),
          "INFO at import of megatron.core.distributed: Megatron-FSDP is not used (megatron DDP / the distributed "
          "optimizer are)"),
    Known("log", "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer",
          re.escape("Detected Megatron Core, using Megatron-FSDP with Megatron"), "the same, second module"),
    Known("log", "megatron.core.distributed.fsdp.src.megatron_fsdp.megatron_fsdp",
          re.escape("Detected Megatron Core, using Megatron-FSDP with Megatron"), "the same, third module"),
    Known("log", "mlflow.store.db.utils", r"Creating initial MLflow database tables|Updating database tables",
          "INFO of MLflow's sqlite store when it creates a new store's schema (the first run into mlruns/): expected; "
          "the run's final line names the store"),
    Known("log", "mlflow.store.db.utils", re.escape("SQLAlchemy database error. The following exception is caught."),
          "ERROR of MLflow's SQL store (the SQL statement, its parameters and a traceback: ~20 lines) just before it "
          "raises the same error: the trainer's tracker (fp4moe.train.metrics.Tracker) catches it and reports it in "
          "one line naming the store and where the metrics it could not take are kept"),
    Known("log", "urllib3.connectionpool", re.escape("Retrying (Retry("),
          "WARNING of urllib3 at each retry of an HTTP request whose connection broke (mlflow's client to a tracking "
          "server that went away: one line a retry, fp4moe.tracking.mlflow_store.HTTP_WRITE_LIMITS bounds them); "
          "the tracker reports the failed write in one line once the retries are spent, the last error included"),
)


class _LogFilter(logging.Filter):
    def __init__(self, patterns: list[str]):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


_installed = False


def install() -> None:
    """Silence every entry of ``KNOWN`` in this process (warnings filters + filters on the named loggers)."""
    global _installed
    if _installed:
        return
    by_logger: dict[str, list[str]] = {}
    for k in KNOWN:
        if k.kind == "warning":
            warnings.filterwarnings("ignore", message=k.message, module=k.source)
        else:
            by_logger.setdefault(k.source, []).append(k.message)
    for name, patterns in by_logger.items():
        logging.getLogger(name).addFilter(_LogFilter(patterns))
    _installed = True


__all__ = ["KNOWN", "Known", "install"]
