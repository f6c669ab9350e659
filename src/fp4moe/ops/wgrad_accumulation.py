"""Weight gradients added into megatron DDP's ``main_grad`` where they are made (gradient-accumulation fusion).

Without the fusion a linear writes its weight gradient (BF16, the weight's size) and megatron DDP's backward hook
adds it into the FP32 (or BF16) ``main_grad`` buffer: 2 B written, 2 + 4 B read, 4 B written per element and
micro-batch. With it the GEMM's epilogue reads and writes ``main_grad`` itself: 4 + 4 B, one rounding.

:func:`add_product` is that epilogue for BF16 operands (cuBLAS ``C = A B + C`` through ``torch.addmm``; used by
fp4moe's BF16 experts, ``fp4moe.ops.grouped_experts``). :func:`wgrad_gemm_accum_fp32` and
:func:`wgrad_gemm_accum_fp16` are the two functions megatron-core's linears call from apex's
``fused_weight_gradient_mlp_cuda`` extension under ``gradient_accumulation_fusion``
(megatron/core/tensor_parallel/layers.py); ``fp4moe.model.cpu_shims`` stands this module in for that extension
where apex is absent, so megatron's own linears take the fusion too.
"""
from __future__ import annotations

import torch

_BF16 = torch.bfloat16


def add_fp32(target: torch.Tensor, part: torch.Tensor) -> None:
    """target += part, the sum formed in FP32 and rounded once to target's dtype (FP32 or BF16)."""
    if target.dtype == torch.float32:
        target.add_(part)
    else:
        target.copy_(target.float() + part.float())


def add_product(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """target ``[n, k]`` += a ``[n, m]`` @ b ``[m, k]``, the sum formed in FP32 and rounded once to target's dtype
    (FP32 or BF16). CUDA with BF16 operands: cuBLAS's beta=1 epilogue reads and writes target in place (an FP32
    target through ``torch.addmm``'s ``out_dtype``), the product never rounded to BF16. Elsewhere (CPU: no
    mixed-dtype addmm; FP32 operands) the product in the operands' dtype, then :func:`add_fp32`."""
    if target.device.type == "cuda" and a.dtype == b.dtype == _BF16:
        if target.dtype == torch.float32:
            torch.addmm(target, a, b, out_dtype=torch.float32, out=target)
            return
        if target.dtype == _BF16:
            target.addmm_(a, b)
            return
    add_fp32(target, a @ b)


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex's ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``: an FP32 ``main_grad`` ``[out, in]`` +=
    grad_output ``[tokens, out]``^T @ total_input ``[tokens, in]`` (megatron flattens both to 2-D first)."""
    add_product(main_grad, grad_output.t(), total_input)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex's ``wgrad_gemm_accum_fp16``: the same into a BF16 (or FP16) ``main_grad``, rounded once."""
    add_product(main_grad, grad_output.t(), total_input)


__all__ = ["add_fp32", "add_product", "wgrad_gemm_accum_fp16", "wgrad_gemm_accum_fp32"]
