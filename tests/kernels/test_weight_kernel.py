"""The 128x128 FP8 weight quantizer kernel (triton_kernels.weight) equals the torch implementation bit for bit.

CPU: under the Triton interpreter (FP8 casts emulated), small shapes with zero, NaN and Inf blocks, several
experts and the transposed copy (bf16, the only input the kernel takes); experts read where they lie (in one buffer
with gaps and in reverse order, as megatron's DDP buffer holds them, or in allocations of their own, and at 16-, 4-
and 2-byte alignment) give the bits of the contiguous copy.
GPU (``-m gpu``): compiled, at the DeepSeek-V3 expert shape, and the CPU test's special blocks and alignments.
"""
import os

import pytest
import torch

from fp4moe.ops.fp8_gemm import quantize_weight_128x128_torch, transpose_weight_128x128
from fp4moe_kernels.triton_kernels import launchers

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CUDA = torch.cuda.is_available()


def weights(e, n, k, dtype, seed=0, specials=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e * n, k, generator=g)
    # per-block magnitudes over a wide range, so that many scale exponents occur
    scale = torch.exp2(torch.randint(-30, 20, (e * n // 128, k // 128), generator=g).float())
    w = w * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    if specials and e * n >= 256 and k >= 256:
        w[:128, :128] = 0  # all-zero block: scale 1
        w[5, 200] = float("nan")
        w[130, 7] = float("inf")
        w[131, 9] = float("-inf")
        w[-1, -1] = -0.0
    return w.to(dtype)


def bits_equal(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check(w, n, dev):
    e = w.shape[0] // n
    q, s, qt, st = launchers.quantize_weight_128x128(w.to(dev), n, transpose=True)
    rq, rs = quantize_weight_128x128_torch(w)
    assert bits_equal(q.cpu(), rq) and torch.equal(s.cpu(), rs)
    for i in range(e):
        tq, ts = transpose_weight_128x128(rq[i * n:(i + 1) * n], rs[i * n // 128:(i + 1) * n // 128])
        assert bits_equal(qt[i].cpu(), tq) and torch.equal(st[i].cpu(), ts), f"expert {i} transposed"


def check_scattered(w, n, gap, dev):
    """W's experts read where they lie: in one buffer, ``gap`` elements apart and last to first, and each in an
    allocation of its own."""
    e, k = w.shape[0] // n, w.shape[1]
    want = launchers.quantize_weight_128x128(w.to(dev), n, transpose=True)
    buf = torch.full((e * (n * k + gap),), float("nan"), dtype=w.dtype, device=dev)  # gaps hold NaN: never read
    in_buffer = [buf[(e - 1 - i) * (n * k + gap):][:n * k].view(n, k) for i in range(e)]
    own = [torch.empty(n, k, dtype=w.dtype, device=dev) for _ in range(e)]
    for ws in (in_buffer, own):
        for i, x in enumerate(ws):
            x.copy_(w[i * n:(i + 1) * n])
        got = launchers.quantize_weight_128x128(ws, transpose=True)
        assert all(bits_equal(a.cpu(), b.cpu()) for a, b in zip(got, want))


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_weight_kernel_interpreted():
    dtype = torch.bfloat16
    check(weights(3, 256, 384, dtype), 256, "cpu")
    check(weights(1, 128, 128, dtype, seed=1), 128, "cpu")
    check_scattered(weights(3, 128, 256, dtype, seed=4), 128, 128 * 128 + 64, "cpu")


def special_weights(e, n, k, seed):
    """``weights`` with non-finite values, an all-NaN, an all-Inf and an all-zero block in experts past the
    first and at block columns past the first, and a NaN with the sign bit set (bf16 0xFFC1)."""
    w = weights(e, n, k, torch.bfloat16, seed=seed)
    bits = w.view(torch.int16)
    bits[n + 3, 40] = -63  # 0xFFC1: a NaN with the sign bit set
    w[n + 129, 300] = float("inf")
    w[2 * n + 5, 7] = float("-inf")
    w[2 * n:2 * n + 128, 256:384] = float("nan")
    w[n:n + 128, 128:256] = float("inf")
    w[2 * n + 128:2 * n + 256, 128:256] = 0
    w[n - 1, k - 1] = float("nan")
    return w


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it)")
def test_weight_kernel_specials_in_later_experts_and_any_alignment():
    """Both copies, every expert: non-finite and all-zero blocks off the first expert and first block column; the
    experts read at 16-byte, 4-byte and 2-byte alignment (the kernel's vector, int32 and int16 loads)."""
    w = special_weights(3, 256, 384, seed=6)
    assert (w.view(torch.int16) == -63).sum() == 1
    check(w, 256, "cpu")
    for gap in (128 * 128 + 64, 2, 1):  # experts 16-byte aligned, 4-byte aligned, at odd elements
        check_scattered(w, 256, gap, "cpu")
    check_alignments(w, 256, "cpu")


def check_alignments(w, n, dev):
    """W's experts back to back in one buffer starting 0, 2 and 1 elements after a 16-byte boundary (the
    kernel's UNIT 8, 2 and 1) give the bits of the contiguous W."""
    e, k = w.shape[0] // n, w.shape[1]
    want = launchers.quantize_weight_128x128(w.to(dev), n, transpose=True)
    buf = torch.empty(e * n * k + 8, dtype=torch.bfloat16, device=dev)
    assert buf.data_ptr() % 16 == 0
    for lead, unit in ((0, 8), (2, 2), (1, 1)):
        ws = [buf[lead + i * n * k:][:n * k].view(n, k) for i in range(e)]
        assert launchers._weight_unit(ws) == unit
        for i, x in enumerate(ws):
            x.copy_(w[i * n:(i + 1) * n])
        got = launchers.quantize_weight_128x128(ws, transpose=True)
        assert all(bits_equal(a.cpu(), b.cpu()) for a, b in zip(got, want)), unit


def test_experts_need_row_major_storage():
    w = torch.zeros(2, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"experts must be row-major \[N, K\] tensors"):
        launchers.quantize_weight_128x128(list(w.transpose(1, 2)))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_weight_kernel_gpu():
    dtype = torch.bfloat16
    check(weights(4, 4096, 7168, dtype, seed=2), 4096, "cuda")
    check(weights(2, 7168, 2048, dtype, seed=3), 7168, "cuda")
    check_scattered(weights(4, 4096, 7168, dtype, seed=5), 4096, 7168 * 2048, "cuda")  # fc1 with fc2 between
    w = special_weights(3, 256, 384, seed=6)
    check(w, 256, "cuda")
    check_alignments(w, 256, "cuda")
    check_alignments(special_weights(3, 1024, 7168, seed=7), 1024, "cuda")


def test_weight_kernel_rejects_float32():
    with pytest.raises(TypeError, match="bfloat16 only"):
        launchers.quantize_weight_128x128(torch.zeros(128, 128))
