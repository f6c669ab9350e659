"""torchao's peers for the kernel benchmark (optional; torchao 0.17.0 was checked with torch 2.11 on an H200).

* ``torchao to_mx (compiled)``: ``torchao.prototype.mx_formats.mx_tensor.to_mx`` to float4_e2m1fn_x2,
  block 32, FLOOR scales (torchao's default), under ``torch.compile(fullgraph=True)``; torchao has no
  dedicated MXFP4 cast kernel on Hopper. Competes with BF16ToFP4Row.
* ``torchao fp8 blockwise (triton)``: ``triton_fp8_blockwise_act_quant_lhs`` (1x128 rows, [M, K] + scales)
  and ``..._transposed_lhs`` (FP8 of X^T [K, M], 1x128 along tokens). Compete with our BF16 -> FP8 row / col.
  In 0.17.0 both need M % 128 == 0 (the row kernel writes scales out of bounds otherwise).

On the GPU machine (no package index) bring the wheel: see docs/training.md, "Benchmarks and GPU tests".
"""
import os


def torchao_peers() -> dict:
    """{impl name: (kernel it competes with, make(x_bf16) -> zero-argument callable)}. Raises ImportError
    (with the reason) when torchao or one of its modules is missing."""
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # none of these needs torchao's .so files
    import torch
    import torchao
    from torchao.prototype.blockwise_fp8_training.kernels import (
        triton_fp8_blockwise_act_quant_lhs,
        triton_fp8_blockwise_act_quant_transposed_lhs,
    )
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    version = getattr(torchao, "__version__", "?")

    def _mx_cast(x):
        scale, data = to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)
        return data, scale

    mx_cast = torch.compile(_mx_cast, fullgraph=True, dynamic=False)

    def _needs_m128(x):
        if x.shape[0] % 128:
            raise ValueError(f"torchao {version} blockwise FP8 quantizers need M % 128 == 0, got M={x.shape[0]}")

    def rows(x):
        _needs_m128(x)
        return lambda: triton_fp8_blockwise_act_quant_lhs(x, 128, torch.float8_e4m3fn)

    def cols(x):
        _needs_m128(x)
        return lambda: triton_fp8_blockwise_act_quant_transposed_lhs(x, 128, torch.float8_e4m3fn)

    return {
        f"torchao {version} to_mx (compiled)": ("bf16_to_fp4_row", lambda x: (lambda: mx_cast(x))),
        f"torchao {version} fp8 blockwise lhs (triton)": ("bf16_to_fp8_row", rows),
        f"torchao {version} fp8 blockwise transposed_lhs (triton)": ("bf16_to_fp8_col", cols),
    }
