"""Blockwise FP8 GEMMs (DeepSeek-V3 scaling) over torch's ``F.scaled_mm``, and the 128x128 weight quantizer.

Operands (E4M3 data, FP32 power-of-two scales; x ~= data * scale):

* activations: 1x128 groups along the contraction dim (``FP8RowTensor`` rows, ``FP8ColTensor`` columns);
* weights: 128x128 blocks, ``quantize_weight_128x128``.

The three GEMMs of a linear ``y = x W^T`` (docs/formats.md; M tokens, K input channels, N output channels):

    kind     a (1x128 along its last dim)             b                                              out
    'fprop'  x rows [M, K], scale [M, K/128]          W [N, K], 128x128 scale [N/128, K/128]         [M, N]
    'dgrad'  dY rows [M, N], scale [M, N/128]         W^T [K, N], 128x128 scale [K/128, N/128]       [M, K]
    'wgrad'  dY^T cols [N, Mp], scale [N, Mp/128]     X^T cols [K, Mp], 1x128 scale [K, Mp/128]      [N, K]

Every b is given row-major ``[out, contraction]``; the result is ``a @ b.T``. ``Mp`` is the token count padded to
128 (``FP8ColTensor`` pads with zeros, so the padding adds nothing). 1x128 scales may have any strides (the
``[M, K/128]`` view of ``FP8RowTensor.segment`` is already M-major; others are made so, a copy of the scales only).

CUDA: ``F.scaled_mm(a, b.t(), scale_a, BlockWise1x128, scale_b, BlockWise128x128 | BlockWise1x128)`` with the
scale layouts of docs/formats.md (``scaled_mm_args`` builds them; ``torch._scaled_mm``, which infers the scaling from
the scale shapes, where ``F.scaled_mm`` is missing). torch itself checks C % 16 and S % 16 (here: multiples of
128) and, for the 128x128 operand, wants its scale rows padded to a multiple of 4 floats (done here; a no-op
for C % 512 == 0, e.g. 7168 and 2048). It does not check R (tokens); R that is not a multiple of 16 is padded
here and the result sliced back, for fprop/dgrad: cuBLAS's M-major 1x128 scale tensor then has a
64-byte-aligned leading dimension. Measured on an H200 (torch 2.11, CUDA 13): without it, ragged experts fail
with CUBLAS_STATUS_NOT_SUPPORTED (tests/ops/test_fp8_linear.py, ``-m gpu``). The extra rows of a are the rows
that follow it in its buffer when there are such (the next expert's: no copy; their outputs are discarded),
else zero rows (a copy of a); the scales are always copied (R' x C/128 floats). wgrad contracts over tokens
padded to 128 already.

CPU: an emulation of the math, not of the GPU's accumulation order: both operands are dequantized exactly
(E4M3 value times a power of two is exact in float32), multiplied in ``compute_dtype`` (float32 by default,
float64 for references) and rounded once to ``out_dtype``. Hopper's FP8 tensor cores accumulate each 128-wide
K chunk with reduced precision before promoting to FP32, so GPU and CPU results differ by more than the final
rounding (see tests/ops/test_fp8_linear.py for the tolerance).
"""
from __future__ import annotations

import torch

from fp4moe_kernels.constants import F8_E4M3_MAX, FP8_GROUP, FP8_SCALE_EXP_MAX, FP8_SCALE_EXP_MIN
from fp4moe_kernels.formats import FormatError
from fp4moe_kernels.reference import ceil_log2_ratio

KINDS = ("fprop", "dgrad", "wgrad")
# cuBLAS blockwise FP8 GEMM: rows of a padded to this multiple for fprop/dgrad on CUDA.
GPU_ROW_MULTIPLE = 16
_FP8 = torch.float8_e4m3fn
_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------- weights


def _pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """Exactly 2**e as float32 for integer e in [-149, 127] (built in float64, whose cast is then exact)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64).to(torch.float32)


def quantize_weight_128x128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W ``[N, K]`` (bf16/fp16/fp32, N and K multiples of 128) -> (data ``[N, K]`` float8_e4m3fn,
    scale ``[N/128, K/128]`` float32), W ~= data * scale blockwise.

    Scale 2**ceil(log2(amax/448)) per 128x128 block over its finite values, the exponent computed exactly
    (``ceil_log2_ratio``, as the activation quantizers) and clamped to [-126, 127]; an all-zero block gets
    scale 1. Elements are w / scale (exact: a power of two) rounded to E4M3 nearest-even; NaN/Inf become NaN.
    CUDA bf16: the Triton kernel ``fp4moe_kernels.triton_kernels.weight`` (bit-equal, tested against
    ``quantize_weight_128x128_torch``); otherwise torch ops. Not differentiable (detaches)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise FormatError(f"weight must be a 2-D [N, K] tensor, got {getattr(w, 'shape', type(w).__name__)}")
    if w.dtype not in _WEIGHT_DTYPES:
        raise FormatError(f"weight has dtype {w.dtype}; expected bfloat16, float16 or float32: cast it with .to(...)")
    n, k = w.shape
    if n % FP8_GROUP or k % FP8_GROUP:
        raise FormatError(
            f"weight [N={n}, K={k}]: 128x128 blocks need N and K multiples of {FP8_GROUP}: pad the weight"
        )
    if w.is_cuda and w.dtype == torch.bfloat16:  # one Triton pass, the same bits
        from fp4moe_kernels.triton_kernels import launchers

        return launchers.quantize_weight_128x128(w.detach().contiguous())
    return quantize_weight_128x128_torch(w)


def quantize_weight_128x128_torch(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch implementation of ``quantize_weight_128x128`` (CPU path and the kernel's reference)."""
    n, k = w.shape
    wb = w.detach().to(torch.float32).reshape(n // FP8_GROUP, FP8_GROUP, k // FP8_GROUP, FP8_GROUP)
    amax = torch.where(torch.isfinite(wb), wb.abs(), torch.zeros_like(wb)).amax(dim=(1, 3))  # [N/128, K/128]
    e = ceil_log2_ratio(torch.where(amax > 0, amax, torch.ones_like(amax)), F8_E4M3_MAX)
    e = torch.where(amax > 0, e.clamp(FP8_SCALE_EXP_MIN, FP8_SCALE_EXP_MAX), torch.zeros_like(e))
    q = wb * _pow2_f32(-e)[:, None, :, None]
    # torch's float -> float8_e4m3fn cast turns +-Inf into +-448: make non-finite values NaN first
    q = torch.where(torch.isfinite(q), q, torch.full_like(q, float("nan"))).to(_FP8).reshape(n, k)
    return q, _pow2_f32(e)


def transpose_weight_128x128(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 128x128 quantization of W^T from that of W: (data^T ``[K, N]`` contiguous, scale^T ``[K/128, N/128]``).

    Exact: a 128x128 block of W^T holds the same values as the transposed block of W, so its amax, scale and
    E4M3 codes are the same (equal, bit for bit, to ``quantize_weight_128x128(W.t())``)."""
    return data.t().contiguous(), scale.t().contiguous()


def dequantize_weight_128x128(data: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """data * scale (exact in float32 / float64) as ``dtype`` ``[N, K]``."""
    s = scale.to(dtype).repeat_interleave(FP8_GROUP, 0).repeat_interleave(FP8_GROUP, 1)
    return data.to(dtype) * s


# ------------------------------------------------------------------------------------------------- GEMM


def _m_major(s: torch.Tensor) -> torch.Tensor:
    """A ``[R, G]`` scale tensor with strides (1, R): what BlockWise1x128 wants (a copy of the scales if not)."""
    r = s.shape[0]
    if s.stride(0) == 1 and (s.shape[1] <= 1 or s.stride(1) == r):
        return s
    return s.t().contiguous().t()


def _check(a, a_scale, b, b_scale, kind):
    if kind not in KINDS:
        raise FormatError(f"kind={kind!r} is not one of {KINDS}")
    for name, t in (("a", a), ("b", b)):
        if t.dtype != _FP8 or t.dim() != 2:
            raise FormatError(f"{name} must be 2-D float8_e4m3fn, got {t.dtype} {tuple(t.shape)}: quantize it first")
        if not t.is_contiguous():
            raise FormatError(f"{name} must be row-major contiguous [rows, contraction]: call .contiguous()")
    r, c = a.shape
    s, c2 = b.shape
    if c != c2:
        raise FormatError(f"{kind}: a is [{r}, {c}] and b is [{s}, {c2}]: the contraction dims (last) differ")
    if c % FP8_GROUP:
        raise FormatError(f"{kind}: contraction dim {c} must be a multiple of {FP8_GROUP}")
    g = c // FP8_GROUP
    want_a = (r, g)
    want_b = (s, g) if kind == "wgrad" else (-(-s // FP8_GROUP), g)
    for name, t, want in (("a_scale", a_scale, want_a), ("b_scale", b_scale, want_b)):
        if t.dtype != torch.float32 or tuple(t.shape) != want:
            raise FormatError(f"{kind}: {name} must be float32 {list(want)}, got {t.dtype} {list(t.shape)}")


def scaled_mm_args(a, a_scale, b, b_scale, kind):
    """The operands ``F.scaled_mm`` gets for ``fp8_mm(a, a_scale, b, b_scale, kind)``, built on any device:
    ``(mat_a [R', C], mat_b = b.t() [C, S] column-major, scale_a, scale_b, R)`` with R' = R rounded up to
    ``GPU_ROW_MULTIPLE`` for fprop/dgrad (the rows after a in its buffer, else zero rows; scale 1; the caller
    slices the result back to R rows).

    Layouts (torch's ``_scaled_block1x128_block128x128`` / ``_scaled_block1x128_block1x128`` checks, docs/formats.md):
    scale_a ``[R', C/128]`` strides ``(1, R')``; 128x128 scale_b ``[round_up(C/128, 4), S/128]`` strides
    ``(1, round_up(C/128, 4))`` (the transposed view of a row-major ``[S/128, C/128]`` buffer whose rows are
    padded to 4 floats = 16 bytes; with C a multiple of 512 that is ``b_scale.t()`` itself); 1x128 scale_b
    ``[S, C/128]`` strides ``(1, S)``."""
    r, c = a.shape
    g = c // FP8_GROUP
    sa = _m_major(a_scale)
    pad = (-r) % GPU_ROW_MULTIPLE if kind != "wgrad" else 0
    if pad:
        if a.untyped_storage().nbytes() >= (a.storage_offset() + (r + pad) * c) * a.element_size():
            # rows follow in the same buffer (the next expert's): read them, their outputs are sliced off
            a = torch.as_strided(a, (r + pad, c), (c, 1))
        else:
            a_p = torch.zeros(r + pad, c, dtype=torch.uint8, device=a.device)
            a_p[:r] = a.view(torch.uint8)
            a = a_p.view(_FP8)
        sa = torch.nn.functional.pad(sa.t(), (0, pad), value=1.0).t()  # [R', G] M-major, one kernel
    if kind == "wgrad":
        sb = _m_major(b_scale)
    else:
        g4 = -(-g // 4) * 4
        if g4 == g and b_scale.is_contiguous():
            sb = b_scale.t()  # rows already 16-byte multiples: no copy
        else:
            buf = torch.ones(b_scale.shape[0], g4, dtype=torch.float32, device=b_scale.device)
            buf[:, :g] = b_scale
            sb = buf.t()
    return a, b.t(), sa, sb, r


_warned_fp32_out = False


def _scaled_mm_cuda(a, a_scale, b, b_scale, kind, out_dtype):
    global _warned_fp32_out
    mat_a, mat_b, sa, sb, r = scaled_mm_args(a, a_scale, b, b_scale, kind)
    f = getattr(torch.nn.functional, "scaled_mm", None)
    if f is None:  # older torch: _scaled_mm infers the scaling from the scale shapes (unpadded 128x128 scales)
        if kind != "wgrad":
            sb = b_scale.contiguous().t()
        out = torch._scaled_mm(mat_a, mat_b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        return out[:r]
    st = torch.nn.functional.ScalingType
    rb = st.BlockWise1x128 if kind == "wgrad" else st.BlockWise128x128
    try:
        out = f(mat_a, mat_b, sa, st.BlockWise1x128, sb, rb, output_dtype=out_dtype)
    except (RuntimeError, ValueError):
        if out_dtype != torch.float32:
            raise
        # FP32 output not accepted by this torch/cuBLAS for blockwise scaling: bf16 output, upcast.
        if not _warned_fp32_out:
            import warnings

            warnings.warn("F.scaled_mm rejected a float32 output for blockwise FP8; using bfloat16 output instead")
            _warned_fp32_out = True
        out = f(mat_a, mat_b, sa, st.BlockWise1x128, sb, rb, output_dtype=torch.bfloat16).float()
    return out[:r]


def _emulate(a, a_scale, b, b_scale, kind, out_dtype, compute_dtype):
    sa = a_scale.to(compute_dtype).repeat_interleave(FP8_GROUP, dim=1)
    if kind == "wgrad":
        sb = b_scale.to(compute_dtype).repeat_interleave(FP8_GROUP, dim=1)
    else:
        sb = b_scale.to(compute_dtype).repeat_interleave(FP8_GROUP, 0)[: b.shape[0]].repeat_interleave(FP8_GROUP, 1)
    a_hp = a.to(compute_dtype) * sa
    b_hp = b.to(compute_dtype) * sb
    return (a_hp @ b_hp.t()).to(out_dtype)


def fp8_mm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    kind: str,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    compute_dtype: torch.dtype = torch.float32,
    check: bool = True,
) -> torch.Tensor:
    """``a @ b.T`` of blockwise-scaled FP8 operands, for ``kind`` 'fprop' | 'dgrad' | 'wgrad' (module docstring).

    a ``[R, C]`` float8_e4m3fn row-major, ``a_scale`` ``[R, C/128]`` float32 (1x128 along C, any strides);
    b ``[S, C]`` float8_e4m3fn row-major, ``b_scale`` ``[S/128, C/128]`` (128x128, 'fprop'/'dgrad') or
    ``[S, C/128]`` (1x128 along C, 'wgrad'). Returns ``[R, S]`` ``out_dtype``.
    CUDA: ``F.scaled_mm`` (FP32 accumulation, one rounding to out_dtype); CPU: exact dequantization and a
    ``compute_dtype`` matmul (an emulation of the math, not of the GPU's accumulation order).
    ``check=False`` skips the operand validation (internal callers whose operands come from our quantizers; it
    costs host time on every call of a per-expert loop)."""
    if check:
        _check(a, a_scale, b, b_scale, kind)
    if a.shape[0] == 0 or b.shape[0] == 0 or a.shape[1] == 0:  # empty expert / no tokens: nothing to launch
        return torch.zeros(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    if a.is_cuda:
        return _scaled_mm_cuda(a, a_scale, b, b_scale, kind, out_dtype)
    return _emulate(a, a_scale, b, b_scale, kind, out_dtype, compute_dtype)


__all__ = [
    "GPU_ROW_MULTIPLE",
    "scaled_mm_args",
    "KINDS",
    "dequantize_weight_128x128",
    "fp8_mm",
    "quantize_weight_128x128",
    "quantize_weight_128x128_torch",
    "transpose_weight_128x128",
]
