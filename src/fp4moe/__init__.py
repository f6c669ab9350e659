"""fp4moe: FP4-stored, FP8-computed MoE training on Hopper GPUs (arXiv 2603.02731, reproduced).

Packages, lowest first (each imports only those below it; docs/layout.md, "Layers"):

- ``fp4moe_kernels`` (separate root ``kernels/``): MXFP4/FP8 formats, the pure-PyTorch reference
  that specifies them, Triton GPU kernels and their benchmark.
- ``fp4moe.ops``: autograd functions (FP8 linear, grouped experts, quantized all-to-all,
  FP4 saved-tensor storage).
- ``fp4moe.moe``: the recipe-aware MoE layer (bf16 / fp8 / mxfp4).
- ``fp4moe.model``: megatron-core model build for the DeepSeek-V3-like models.
- ``fp4moe.train``: the Hydra training app (``python -m fp4moe.train``).
- ``fp4moe.launch``: jobs on Slurm: the dry run (``python -m fp4moe.launch dry-run``), sbatch-safe values, the
  running job's signals (checkpoint, requeue, resume), the benchmark experiments as jobs.
- ``fp4moe.scale``: the paper-scale model (memory, all-to-all, time per token, given rates); ``fp4moe.analysis``:
  that model against our runs and the paper (the result files of results/manifest.yaml); ``fp4moe.report``:
  MLflow -> results/.
- ``fp4moe.runs``: a run's folder, its final summary, runs archives; ``fp4moe.tracking``: the MLflow store and the
  benchmark loggers; ``fp4moe.reproduce``: ``make reproduce-table``.
- Leaves: ``fp4moe.paths`` (the one place that finds the repository's folders), ``fp4moe.paper``, ``fp4moe.recipe``,
  ``fp4moe.config``, ``fp4moe.settings`` (the config groups' schemas and typed
  settings), ``fp4moe.resolvers``, ``fp4moe.known_warnings``, ``fp4moe.atomic_write``.
"""

__version__ = "0.1.0"


def _register_resolvers() -> None:
    """OmegaConf resolvers the configs use (fp4moe.resolvers), there before any composition."""
    from fp4moe import resolvers

    try:
        resolvers.register()
    except ImportError:  # omegaconf absent (the GPU image's bare python): no configs to compose there
        pass


def _register_schemas() -> None:
    """The config groups' schemas in Hydra's ConfigStore (fp4moe.settings), there before any composition."""
    try:
        from fp4moe import settings

        settings.register()
    except ImportError:  # omegaconf / hydra absent (the GPU image's bare python): no configs to compose there
        pass

_register_resolvers()
_register_schemas()
