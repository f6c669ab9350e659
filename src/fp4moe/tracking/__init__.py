"""What runs and benchmarks record, and where: the MLflow store and the loggers of the benchmark JSON. No torch.

- :mod:`fp4moe.tracking.mlflow_store`: where runs go (``$MLFLOW_TRACKING_URI``, else ``<repo>/mlruns/mlflow.db``),
  reachability checks, one call logs a run or a table, the commit and environment tags, portable paths
- :mod:`fp4moe.tracking.bench_log`: ``python -m fp4moe.tracking.bench_log``, kernel benchmark JSON -> MLflow
  (``make log-bench``)
- :mod:`fp4moe.tracking.layer_bench_log`: ``python -m fp4moe.tracking.layer_bench_log``, MoE layer benchmark JSON
  -> MLflow
- :mod:`fp4moe.tracking.memtrace`: what is live on the GPU at a run's memory peak, replayed from the CUDA
  allocator's history (plain Python; the trainer's ``train.profile.memory`` and ``fp4moe.bench.moe_layer --memtrace``)
"""
