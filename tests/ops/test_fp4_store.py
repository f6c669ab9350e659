"""fp4_saved_tensors (fp4moe.ops.fp4_store): saved activations kept as MXFP4, gradients from the decoded values."""
from __future__ import annotations

import torch

from fp4moe.ops import fp4_saved_tensors
from fp4moe_kernels import reference as R


def test_linear_weight_grad_reads_the_mxfp4_input():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g).to(torch.bfloat16)
    w = torch.nn.Parameter(torch.randn(128, 256, generator=g).to(torch.bfloat16))
    dy = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    with fp4_saved_tensors(min_numel=1) as store:
        y = torch.nn.functional.linear(x, w)
    y.backward(dy)
    assert store.packed == 1  # x; the weight (a parameter) is saved as it is
    assert store.original_bytes == 64 * 256 * 2 and store.packed_bytes == 64 * (128 + 8)
    x_hat = R.dequantize_mxfp4(R.quantize_mxfp4(x.float())).to(torch.bfloat16)
    want = (dy.t().float() @ x_hat.float()).to(torch.bfloat16)  # dW = dY^T X_hat
    assert torch.allclose(w.grad.float(), want.float(), rtol=2**-7, atol=1e-3)
    err = ((w.grad.float() - (dy.t().float() @ x.float())).norm() / (dy.t().float() @ x.float()).norm()).item()
    assert 0.05 < err < 0.3  # the E2M1 error of x is visible: the store really quantized


def test_ineligible_tensors_are_saved_unchanged():
    x = torch.randn(8, 48, dtype=torch.bfloat16, requires_grad=True)  # last dim not a multiple of 32
    z = torch.randn(4, 64, requires_grad=True)  # float32
    with fp4_saved_tensors(min_numel=1) as store:
        y = (x * x).sum() + (z * z).sum()
    y.backward()
    assert store.packed == 0
    assert torch.equal(x.grad, 2 * x.detach()) and torch.equal(z.grad, 2 * z.detach())


def test_disabled_is_a_no_op():
    x = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    with fp4_saved_tensors(enabled=False) as store:
        y = (x.exp()).sum()
    y.backward()
    assert store.packed == 0 and torch.equal(x.grad, x.detach().exp())
