"""Benchmarks of what fp4moe builds on the kernels (one CUDA GPU unless said; results as JSON and Markdown):

    python -m fp4moe.bench.moe_layer      the MoE layer, every recipe side by side (the paper's F4; make bench-layer;
                                          EP > 1 under torch.distributed.run) -> results/moe_layer/
    python -m fp4moe.bench.swiglu_fusion  the fused SwiGLU kernels against the unfused torch ops of fp4moe.ops.swiglu

The kernel benchmarks (the conversions, the paper's F3) are in ``fp4moe_kernels.bench``; their shared timing,
``fp4moe_kernels.bench.timing``, is used here too.
"""
