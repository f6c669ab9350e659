"""Grouped blockwise-FP8 GEMM kernels (triton_kernels.gemm) against the per-expert ``fp8_mm`` loop.

Both compute, per expert, sum over 128-deep blocks of (exact E4M3 products, FP32 sums) x scales; they differ only
in FP32 summation order. CPU: the kernels under the Triton interpreter (operands decoded to float32) against the
exact CPU emulation, float32 output, relative error < 1e-5. GPU (``-m gpu``): compiled (wgmma) against the
``F.scaled_mm`` loop at DeepSeek-V3 expert shapes, relative Frobenius error < 1e-3 (the FP8 quantization
error itself is ~3e-2), bf16 output.
"""
import os

import pytest
import torch

from fp4moe.ops.fp8_gemm import fp8_mm
from fp4moe.ops.grouped_experts import quantize_experts_128x128
from fp4moe_kernels import convert as kops
from fp4moe_kernels.triton_kernels import launchers

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def rows_case(counts, kc, n, kind, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    e = len(counts)
    x = torch.randn(sum(counts), kc, generator=g).to(torch.bfloat16).to(dev)
    w = (torch.randn(e, kc, n, generator=g) if kind == "dgrad" else torch.randn(e, n, kc, generator=g)) * 0.05
    a = kops.bf16_to_fp8_row(x, counts)
    wd, ws = quantize_experts_128x128(w.to(torch.bfloat16).to(dev), transpose=kind == "dgrad")
    return a, wd, ws


def loop_rows(a, wd, ws, counts, kind, out_dtype):
    outs = [fp8_mm(*a.segment(i), wd[i], ws[i], kind, out_dtype=out_dtype) for i in range(len(counts))]
    return torch.cat(outs)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def cols_case(counts, n, k, dev, seed=1):
    g = torch.Generator().manual_seed(seed)
    t = sum(counts)
    dy = torch.randn(t, n, generator=g).to(torch.bfloat16).to(dev)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(dev)
    return kops.bf16_to_fp8_col(dy, counts), kops.bf16_to_fp8_col(x, counts)


def loop_wgrad(a, b, counts, out_dtype):
    n, k = a.channels, b.channels
    return torch.stack([fp8_mm(*a.segment(i), *b.segment(i), "wgrad", out_dtype=out_dtype) if c else
                        torch.zeros(n, k, dtype=out_dtype, device=a.data.device) for i, c in enumerate(counts)])


COUNTS = [37, 0, 150, 13, 63]


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it)")
@pytest.mark.parametrize("kind", ["fprop", "dgrad"])
def test_grouped_rows_interpreted(kind):
    a, wd, ws = rows_case(COUNTS, 256, 384, kind, "cpu")
    got = launchers.grouped_fp8_rows(a, wd, ws, out_dtype=torch.float32)
    assert rel(got, loop_rows(a, wd, ws, COUNTS, kind, torch.float32)) < 1e-5


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_grouped_wgrad_interpreted():
    a, b = cols_case(COUNTS, 256, 384, "cpu")
    got = launchers.grouped_fp8_wgrad(a, b, out_dtype=torch.float32)
    assert not got[1].any()  # the expert without tokens
    assert rel(got, loop_wgrad(a, b, COUNTS, torch.float32)) < 1e-5


def scaled_cols_case(counts, n, k, dev, seed=2):
    """``cols_case`` with each token's values times a power of two in 2^-4 .. 2^4, so that the 1x128 scales differ
    from block to block and a kernel that pairs a tile with the wrong block's scale gives another result."""
    g = torch.Generator().manual_seed(seed)
    t = sum(counts)
    mult = torch.pow(2.0, torch.randint(-4, 5, (t, 1), generator=g).float())
    dy = (torch.randn(t, n, generator=g) * mult).to(torch.bfloat16).to(dev)
    x = (torch.randn(t, k, generator=g) * mult).to(torch.bfloat16).to(dev)
    return kops.bf16_to_fp8_col(dy, counts), kops.bf16_to_fp8_col(x, counts)


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_grouped_wgrad_tma_interpreted_bit_equal_to_pointer_loads():
    counts = [0, 5, 300, 129]
    a, b = scaled_cols_case(counts, 256, 384, "cpu")
    tma = launchers.grouped_fp8_wgrad(a, b, out_dtype=torch.float32, tma=True)
    ptr = launchers.grouped_fp8_wgrad(a, b, out_dtype=torch.float32, tma=False)
    assert torch.equal(tma, ptr)
    assert not tma[0].any()
    assert rel(tma, loop_wgrad(a, b, counts, torch.float32)) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an sm_90 CUDA GPU")
@pytest.mark.parametrize("kind, kc, n", [("fprop", 7168, 4096), ("fprop", 2048, 7168), ("dgrad", 4096, 7168)])
def test_grouped_rows_gpu(kind, kc, n):
    g = torch.Generator().manual_seed(3)
    counts = torch.multinomial(torch.ones(32), 8192, replacement=True, generator=g).bincount(minlength=32).tolist()
    counts[5] = 0
    a, wd, ws = rows_case(counts, kc, n, kind, "cuda")
    got = launchers.grouped_fp8_rows(a, wd, ws)
    assert rel(got, loop_rows(a, wd, ws, counts, kind, torch.bfloat16)) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an sm_90 CUDA GPU")
def test_grouped_wgrad_gpu():
    g = torch.Generator().manual_seed(4)
    counts = torch.multinomial(torch.ones(32), 8192, replacement=True, generator=g).bincount(minlength=32).tolist()
    counts[7] = 0
    a, b = cols_case(counts, 4096, 7168, "cuda")
    got = launchers.grouped_fp8_wgrad(a, b)
    assert not got[7].any()
    assert rel(got, loop_wgrad(a, b, counts, torch.bfloat16)) < 1e-3


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_grouped_rows_other_tiles_interpreted(monkeypatch):
    """BN = 256 (two weight scale blocks per tile, a partial last N tile at N = 384) and BM = 64."""
    monkeypatch.setitem(launchers.GEMM_TILES, "rows", (64, 256, 2, 4, 2))
    launchers._row_tiles.cache_clear()
    a, wd, ws = rows_case(COUNTS, 256, 384, "fprop", "cpu", seed=7)
    got = launchers.grouped_fp8_rows(a, wd, ws, out_dtype=torch.float32)
    assert rel(got, loop_rows(a, wd, ws, COUNTS, "fprop", torch.float32)) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an sm_90 CUDA GPU")
def test_grouped_wgrad_tma_gpu_bit_equal_and_allocator_left_alone():
    from triton.runtime import _allocation

    g = torch.Generator().manual_seed(5)
    counts = torch.multinomial(torch.ones(32), 8192, replacement=True, generator=g).bincount(minlength=32).tolist()
    counts[3], counts[9] = 0, 5
    a, b = scaled_cols_case(counts, 4096, 2048, "cuda")
    before = _allocation._allocator.get()
    assert launchers._tma_available(a.data.device)
    tma = launchers.grouped_fp8_wgrad(a, b, tma=True)
    assert _allocation._allocator.get() is before
    assert torch.equal(tma, launchers.grouped_fp8_wgrad(a, b, tma=False))
    assert not tma[3].any()
    assert rel(tma, loop_wgrad(a, b, counts, torch.bfloat16)) < 1e-3


def scattered_main_grads(counts, n, k, dtype, dev, seed=6):
    """E ``[n, k]`` views of one buffer, as megatron DDP's main_grad views lie in its gradient buffer: in reverse
    expert order, with a gap between some, random values (a gradient accumulated over earlier micro-batches)."""
    g = torch.Generator().manual_seed(seed)
    e, size = len(counts), n * k
    starts = [(e - 1 - i) * (size + 256) + (128 if i % 2 else 0) for i in range(e)]   # apart, 128-256 between
    buf = torch.randn(max(starts) + size + 256, generator=g).to(dtype).to(dev)
    return buf, [buf[s:s + size].view(n, k) for s in starts]


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tma", [False, True])
def test_grouped_wgrad_accumulates_into_scattered_main_grads_interpreted(dtype, tma):
    """accumulate_into: every expert's view gets old + the kernel's FP32 product, rounded once to its dtype, bit for
    bit (the product from the same kernel without accumulation); an expert without tokens and the buffer's bytes
    outside the views are left as they were."""
    counts = [0, 5, 300, 129]
    a, b = scaled_cols_case(counts, 256, 384, "cpu")
    buf, views = scattered_main_grads(counts, 256, 384, dtype, "cpu")
    before, olds = buf.clone(), [v.clone() for v in views]
    prod = launchers.grouped_fp8_wgrad(a, b, out_dtype=torch.float32, tma=tma)
    assert launchers.grouped_fp8_wgrad(a, b, tma=tma, accumulate_into=views) is None
    for e, (v, old) in enumerate(zip(views, olds)):
        assert torch.equal(v, (old.float() + prod[e]).to(dtype)), e
    assert torch.equal(views[0], olds[0])   # no tokens: untouched
    outside = torch.ones_like(buf, dtype=torch.bool)
    for v in views:
        outside[(v.data_ptr() - buf.data_ptr()) // buf.element_size():][:v.numel()] = False
    assert torch.equal(buf[outside], before[outside])


def test_grouped_wgrad_accumulation_targets_are_checked():
    a, b = cols_case([3, 4], 128, 256, "cpu")
    buf, views = scattered_main_grads([3, 4], 128, 256, torch.float32, "cpu")
    with pytest.raises(ValueError, match="1 tensors for 2 experts"):
        launchers.grouped_fp8_wgrad(a, b, accumulate_into=views[:1])
    with pytest.raises(ValueError, match=r"each must be a contiguous \[128, 256\]"):
        launchers.grouped_fp8_wgrad(a, b, accumulate_into=[views[0], views[1].t()])
    with pytest.raises(ValueError, match="another storage"):
        launchers.grouped_fp8_wgrad(a, b, accumulate_into=[views[0], views[1].clone()])
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        launchers.grouped_fp8_wgrad(a, b, accumulate_into=[v.half() for v in views])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs an sm_90 CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_wgrad_accumulates_into_main_grads_gpu(dtype):
    g = torch.Generator().manual_seed(8)
    counts = torch.multinomial(torch.ones(32), 8192, replacement=True, generator=g).bincount(minlength=32).tolist()
    counts[3], counts[9] = 0, 5
    a, b = scaled_cols_case(counts, 4096, 2048, "cuda")
    buf, views = scattered_main_grads(counts, 4096, 2048, dtype, "cuda")
    olds = [v.clone() for v in views]
    prod = launchers.grouped_fp8_wgrad(a, b, out_dtype=torch.float32)
    launchers.grouped_fp8_wgrad(a, b, accumulate_into=views)
    for e, (v, old) in enumerate(zip(views, olds)):
        assert torch.equal(v, (old.float() + prod[e]).to(dtype)), e
