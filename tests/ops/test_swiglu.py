"""swiglu (fp4moe.ops.swiglu): values and gradient against float64 autograd, the MXFP4-stored input, bytes."""
from __future__ import annotations

import pytest
import torch

from fp4moe.ops import swiglu
from fp4moe.recipe import Recipe
from fp4moe_kernels import reference as R
from fp4moe_kernels.formats import FormatError

F64 = torch.float64


def case(t=40, f=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, 2 * f, generator=g).to(torch.bfloat16), torch.randn(t, f, generator=g).to(torch.bfloat16)


def ref(h, dz):
    hd = h.to(F64).requires_grad_()
    f = h.shape[1] // 2
    z = torch.nn.functional.silu(hd[:, :f]) * hd[:, f:]
    z.backward(dz.to(F64))
    return z.detach(), hd.grad


@pytest.mark.parametrize("name", ["bf16", "fp8", "mxfp4"])
def test_against_float64(name):
    recipe = Recipe.preset(name)
    h, dz = case()
    hh = h.clone().requires_grad_()
    z = swiglu(hh, recipe)
    z.backward(dz)
    z_ref, dh_ref = ref(h, dz)
    # forward: float32 math, one bf16 rounding (2**-8 relative) for every recipe
    assert torch.allclose(z.to(F64), z_ref, rtol=2**-8, atol=1e-6)
    if name == "mxfp4":  # backward reads the MXFP4 h: exactly the float64 gradient at the decoded h
        h4 = R.dequantize_mxfp4(R.quantize_mxfp4(h.float())).to(torch.bfloat16)
        _, dh_fp4 = ref(h4, dz)
        assert torch.allclose(hh.grad.to(F64), dh_fp4, rtol=2**-7, atol=1e-5)
        err = ((hh.grad.to(F64) - dh_ref).norm() / dh_ref.norm()).item()
        assert 0.02 < err < 0.3  # E2M1 error of h is visible in dh
        assert z.grad_fn.saved_activation_bytes == 40 * (64 + 4)  # [40, 128] MXFP4: 64 data + 4 scale bytes
    else:
        assert torch.allclose(hh.grad.to(F64), dh_ref, rtol=2**-7, atol=1e-5)
        assert z.grad_fn.saved_activation_bytes == 40 * 128 * 2


def test_shared_scope_decides_fp4():
    h, _ = case()
    only_experts = Recipe.from_config({"name": "mxfp4", "scope": "experts"})
    assert swiglu(h.clone().requires_grad_(), only_experts, "shared_expert").grad_fn.saved_activation_bytes == 40 * 256
    assert swiglu(h.clone().requires_grad_(), only_experts, "expert").grad_fn.saved_activation_bytes == 40 * 68


def test_bad_input():
    with pytest.raises(FormatError, match="even last dim"):
        swiglu(torch.zeros(4, 3, dtype=torch.bfloat16), Recipe.bf16())
    with pytest.raises(FormatError, match="bfloat16"):
        swiglu(torch.zeros(4, 4), Recipe.bf16())
