"""fp4moe.ops.wgrad_accumulation: weight gradients added into megatron DDP's main gradients where they are made.

CPU: apex's two functions as megatron's linears call them (2-D input and output gradient, main_grad ``[out, in]``)
add exactly the product the unfused path writes, into FP32 and (rounded once) BF16 main gradients. GPU: the BF16
operands' product accumulates in cuBLAS's epilogue, unrounded.
"""
from __future__ import annotations

import pytest
import torch

from fp4moe.ops.wgrad_accumulation import add_fp32, wgrad_gemm_accum_fp16, wgrad_gemm_accum_fp32

F64 = torch.float64


def _operands(dtype=torch.bfloat16, tokens=96, n_in=48, n_out=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n_in, generator=g).to(dtype)        # total_input  [tokens, in]
    dy = torch.randn(tokens, n_out, generator=g).to(dtype)      # grad_output  [tokens, out]
    earlier = torch.randn(n_out, n_in, generator=g)
    return x, dy, earlier


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accum_fp32_adds_the_unfused_gradient_into_main_grad(dtype):
    """An FP32 main gradient gets exactly what DDP's hook would add: the linear's own weight gradient
    (``grad_output^T @ input`` in the operands' dtype, megatron's unfused path); in place."""
    x, dy, earlier = _operands(dtype)
    main = earlier.clone()
    ptr = main.data_ptr()
    wgrad_gemm_accum_fp32(x, dy, main)
    want = earlier.clone()
    want.add_(dy.t().matmul(x))
    assert main.data_ptr() == ptr and torch.equal(main, want)


def test_accum_fp16_rounds_the_fp32_sum_once_into_bf16_main_grad():
    x, dy, earlier = _operands()
    main = earlier.bfloat16()
    wgrad_gemm_accum_fp16(x, dy, main)
    assert main.dtype == torch.bfloat16
    assert torch.equal(main, (earlier.bfloat16().float() + dy.t().matmul(x).float()).bfloat16())


def test_add_fp32_into_bf16_and_fp32():
    g = torch.Generator().manual_seed(3)
    part = torch.randn(16, 8, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(16, 8, generator=g).to(dtype)
        want = (t.float() + part).to(dtype)
        add_fp32(t, part)
        assert torch.equal(t, want), dtype


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_bf16_wgrad_adds_its_product_in_the_gemm(dtype):
    """The fused wgrad on CUDA (``add_product``: cuBLAS C = A B + C; fp4moe's BF16 experts) adds the FP32 product into the
    main gradient unrounded: an FP32 main gradient ends within FP32 accumulation error of the float64 sum, far
    inside the error of adding the BF16-rounded product (what the unfused path does); a BF16 one is that sum
    rounded once (to within one BF16 ulp of it)."""
    from fp4moe.ops.wgrad_accumulation import add_product

    g = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(1024, 768, generator=g, device="cuda").to(torch.bfloat16)   # dY_e^T: [n, m]
    b = torch.randn(768, 512, generator=g, device="cuda").to(torch.bfloat16)    # X_e: [m, k]
    earlier = torch.randn(1024, 512, generator=g, device="cuda").to(dtype)
    want = earlier.to(F64) + a.to(F64) @ b.to(F64)
    target = earlier.clone()
    ptr = target.data_ptr()
    add_product(target, a, b)
    assert target.dtype == dtype and target.data_ptr() == ptr   # in place, in the main gradient's dtype
    err = (target.to(F64) - want).abs().max().item()
    if dtype == torch.float32:
        rounded = (earlier.to(F64) + (a @ b).to(F64) - want).abs().max().item()   # BF16 product, then the add
        assert err < rounded / 20, (err, rounded)
    else:
        ulp = want.abs().max().item() * 2.0**-7
        assert err <= ulp, (err, ulp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_megatron_accum_fp32_takes_its_operands_as_megatron_passes_them():
    """apex's interface on CUDA as megatron's linears call it (input ``[tokens, in]``, output gradient
    ``[tokens, out]``, the transpose a view): an FP32 main gradient within FP32 accumulation error of the float64
    sum, in place."""
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(2048, 384, generator=g, device="cuda").to(torch.bfloat16)
    dy = torch.randn(2048, 640, generator=g, device="cuda").to(torch.bfloat16)
    main = torch.randn(640, 384, generator=g, device="cuda")
    want = main.to(F64) + dy.to(F64).t() @ x.to(F64)
    before = main.data_ptr()
    wgrad_gemm_accum_fp32(x, dy, main)
    assert main.data_ptr() == before
    rounded = (want - main.to(F64)).abs().max().item()
    bf16_product = ((dy.t() @ x).to(F64) - dy.to(F64).t() @ x.to(F64)).abs().max().item()
    assert rounded < bf16_product / 20, (rounded, bf16_product)
