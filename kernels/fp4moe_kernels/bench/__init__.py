"""The kernel package's GPU benchmarks (one Hopper GPU; each writes JSON, CSV and Markdown results):

    python -m fp4moe_kernels.bench.conversions  every conversion against the copy bandwidth of the same run and the
                                                unfused torch ops it replaces (the paper's F3; make bench-kernels)
    python -m fp4moe_kernels.bench.cuda_col     the CUDA C++ FP4RowToFP8Col against the Triton kernel

``timing``: how they measure (CUDA-graph replays, the copy bandwidth, the run's environment record); ``peers``:
torchao's kernels, the optional competitors of ``conversions``. The benchmarks of what is built on the kernels (the
MoE layer, the fused SwiGLU against fp4moe's unfused ops) are in ``fp4moe.bench``.
"""
