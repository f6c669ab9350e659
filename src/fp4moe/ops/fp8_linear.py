"""FP8 linear ``y = x W^T`` as an autograd function: blockwise FP8 GEMMs forward and backward, with the input
saved for backward the way the recipe says (docs/recipe.md).

Forward: x ``[M, K]`` -> FP8 1x128 rows (``bf16_to_fp8_row``; under ``save_fp4`` the fused
``bf16_to_fp4_and_fp8_row``, which also emits the MXFP4 copy to save), W ``[N, K]`` -> 128x128 blocks,
y = fprop GEMM, ``[M, N]`` bf16.

Saved for backward (only when W needs a gradient; the weight itself is saved by reference and re-quantized in
backward, which costs no memory and gives the same bits, or, with ``fp4moe.ops.weight_cache`` enabled, its FP8
copies are made once per optimizer step and reused by every forward and dgrad):

    recipe                        saved from x                                      bytes (one segment)
    bf16 (or out of scope)        x itself (``F.linear``, no FP8)                   2 M K
    fp8 (mxfp4 w/o save_fp4)      FP8 rows + FP8 columns (TE Float8BlockScaling)    M K + 4 M K/128 + K Mp + 4 K Mp/128
    mxfp4 with save_fp4           MXFP4 rows only (wgrad operand rebuilt with       M K/2 + M K/32
                                  ``fp4_row_to_fp8_col`` in backward)

The fp8 recipe's row copy is not read by backward (dgrad uses dY and W); it is kept because the paper's
baseline (Transformer Engine's blockwise recipe, docs/recipe.md) holds both copies, and the memory comparison is
against that. Dropping it would make fp8 save ``K Mp + 4 K Mp/128`` only.

Mp = M rounded up to 128, per segment. Backward: dX = dY (bf16 -> FP8 rows) x W^T (128x128), the 'dgrad' GEMM;
dW = dY^T (``bf16_to_fp8_col``) x X^T (saved or rebuilt FP8 columns), the 'wgrad' GEMM, accumulated in FP32 and
returned in the weight's dtype. Gradients are never FP4.

Shapes: K and N multiples of 128 (the 1x128 groups of x and of dY); M any (including not a multiple of 128:
the column layouts pad tokens to 128 with zeros; on CUDA fprop/dgrad pad M to 16 inside ``fp8_mm``).
``counts`` (tokens per segment, e.g. per expert, summing to M) only shapes the layouts (segment-major row
scales, per-segment column padding, one wgrad GEMM per segment), so saved tensors can be shared with grouped
code; the math is that of one segment.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fp4moe_kernels import convert as kops
from fp4moe_kernels import switches
from fp4moe_kernels.constants import FP8_GROUP
from fp4moe_kernels.formats import FormatError, FP8ColTensor, FP8RowTensor, MXFP4Tensor, Segments
from fp4moe_kernels.sizes import fp8_row_col_bytes, mxfp4_bytes

from ..recipe import Recipe
from .fp8_gemm import fp8_mm, quantize_weight_128x128, transpose_weight_128x128
from .weight_cache import CACHE

_FP8 = torch.float8_e4m3fn
_ACT_DTYPES = (torch.bfloat16, torch.float32)


def _row_operand(f):
    """(data [M, K], scale [M, K/128]) of an FP8RowTensor: the zero-copy M-major view for one segment,
    a dense copy of the scales otherwise (data stays as is: rows are contiguous across segments)."""
    if f.segments.num == 1:
        return f.segment(0)
    return f.data, f.scale_matrix()


def fp8_rows(x: torch.Tensor, seg: Segments, with_cols: bool) -> tuple[FP8RowTensor, FP8ColTensor | None]:
    """x's FP8 1x128 rows ``[M, K]``, and its FP8 columns too when ``with_cols`` and the ``fp8_row_col`` switch says
    1 (``convert.bf16_to_fp8_row_col``: one read of x, the same bits as the two kernels); else the columns are None
    and the caller makes them (``bf16_to_fp8_col``) where it needs them, as before the fused kernel."""
    if with_cols and switches.current().fp8_row_col == "1":
        return kops.bf16_to_fp8_row_col(x, seg)
    return kops.bf16_to_fp8_row(x, seg), None


def fp8_weight(weight: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The 128x128 FP8 copy of ``weight`` ``[N, K]`` for fprop (data ``[N, K]``, scale ``[N/128, K/128]``) or, with
    ``transposed``, of W^T for dgrad (``[K, N]``, ``[K/128, N/128]``); from ``weight_cache.CACHE`` when enabled."""
    def make(both: bool):
        q = quantize_weight_128x128(weight)
        return q, (transpose_weight_128x128(*q) if both else None)
    return CACHE.get((weight,), make, transposed)


def _wgrad(dy_col: FP8ColTensor, x_col: FP8ColTensor) -> torch.Tensor:
    """dW [N, K] float32 = sum over segments of dY_e^T X_e (FP8 'wgrad' GEMM per segment)."""
    n, k = dy_col.channels, x_col.channels
    dw = None
    for e, c in enumerate(dy_col.segments.counts):
        if c == 0:
            continue
        a, sa = dy_col.segment(e)  # [N, Mp_e], [N, Mp_e/128]
        b, sb = x_col.segment(e)  # [K, Mp_e], [K, Mp_e/128]
        part = fp8_mm(a, sa, b, sb, "wgrad", out_dtype=torch.float32)
        dw = part if dw is None else dw + part
    if dw is None:
        dw = torch.zeros(n, k, dtype=torch.float32, device=dy_col.data.device)
    return dw


class FP8Linear(torch.autograd.Function):
    """``y = x W^T`` with FP8 GEMMs (module docstring). Use through ``fp8_linear``.

    forward(x [M, K] bf16/fp32, weight [N, K], recipe (fp8 or mxfp4), segments: Segments, backward: bool) -> y
    [M, N] bf16. ``backward``: whether a backward can follow (grad mode was on at the call; ``ctx.needs_input_grad``
    does not say: it follows requires_grad even under ``torch.no_grad``); without it nothing is made for backward,
    e.g. in the first forward of a recomputed (checkpointed) block, which runs under no_grad.
    ``y.grad_fn.saved_activation_bytes`` holds the bytes saved from x (``saved_bytes(y)``)."""

    @staticmethod
    def forward(ctx, x, weight, recipe: Recipe, seg: Segments, backward: bool):
        m, k = x.shape
        need_w = ctx.needs_input_grad[1] and backward
        x_col = None
        if recipe.save_fp4 and need_w:
            x_fp4, x_row = kops.bf16_to_fp4_and_fp8_row(x, seg, rule=recipe.scale_rule)
        else:
            x_fp4 = None
            x_row, x_col = fp8_rows(x, seg, need_w)
        wq, ws = fp8_weight(weight)
        xa, xs = _row_operand(x_row)
        y = fp8_mm(xa, xs, wq, ws, "fprop")

        ctx.seg, ctx.k, ctx.w_dtype, ctx.x_dtype = seg, k, weight.dtype, x.dtype
        saved: list[torch.Tensor] = []
        if not need_w:
            ctx.layout = "none"
        elif x_fp4 is not None:
            ctx.layout = "mxfp4"
            saved = [x_fp4.data, x_fp4.scales]
        else:
            ctx.layout = "fp8_row_col"
            x_col = x_col if x_col is not None else kops.bf16_to_fp8_col(x, seg)
            saved = [x_row.data, x_row.scales, x_col.data, x_col.scales]
        ctx.saved_activation_bytes = sum(t.numel() * t.element_size() for t in saved)
        ctx.save_for_backward(weight, *saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        weight, *saved = ctx.saved_tensors
        seg, k = ctx.seg, ctx.k
        if dy.dtype not in _ACT_DTYPES:
            dy = dy.to(torch.bfloat16)
        dy = dy.contiguous()
        dx = dw = None
        dy_col = None
        if ctx.needs_input_grad[0]:
            dy_row, dy_col = fp8_rows(dy, seg, ctx.needs_input_grad[1])
            wtq, wts = fp8_weight(weight, transposed=True)
            a, sa = _row_operand(dy_row)
            dx = fp8_mm(a, sa, wtq, wts, "dgrad").to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            if ctx.layout == "mxfp4":
                x_fp4 = MXFP4Tensor(saved[0], saved[1], (seg.total, k))
                x_col = kops.fp4_row_to_fp8_col(x_fp4, seg)
            else:
                x_col = FP8ColTensor(saved[2], saved[3], seg, k)
            dy_col = dy_col if dy_col is not None else kops.bf16_to_fp8_col(dy, seg)
            dw = _wgrad(dy_col, x_col).to(ctx.w_dtype)
        return dx, dw, None, None, None


def _in_scope(recipe: Recipe, layer_kind: str | None) -> bool:
    return recipe.fp8_compute and (layer_kind is None or recipe.applies_to(layer_kind))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Recipe, counts=None, *, layer_kind: str | None = None):
    """``x W^T`` under ``recipe``: ``F.linear`` for bf16 (or when ``layer_kind`` is given and outside the recipe's
    scope), ``FP8Linear`` otherwise. x ``[..., K]``, weight ``[N, K]`` -> ``[..., N]`` (bf16 on the FP8 path).
    ``counts``: tokens per segment (needs 2-D x), see the module docstring."""
    if not _in_scope(recipe, layer_kind):
        return F.linear(x, weight)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise FormatError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: need x [..., K] and weight [N, K]")
    n, k = weight.shape
    if k % FP8_GROUP or n % FP8_GROUP:
        raise FormatError(
            f"FP8 linear needs K (in features, {k}) and N (out features, {n}) multiples of {FP8_GROUP} "
            "(1x128 groups of x and of dY): pad the weight, or keep this layer out of the recipe's scope"
        )
    if counts is not None and x.dim() != 2:
        raise FormatError(f"counts needs a 2-D x [tokens, K], got {tuple(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.dtype not in _ACT_DTYPES:
        x2 = x2.to(torch.bfloat16)
    x2 = x2.contiguous()
    seg = Segments.of(counts, x2.shape[0])
    y = FP8Linear.apply(x2, weight, recipe, seg, torch.is_grad_enabled())
    return y if x.dim() == 2 else y.reshape(*lead, n)


def linear_saved_bytes(m: int, k: int, recipe: Recipe, counts=None, *, layer_kind: str | None = None) -> int:
    """Bytes an FP8/BF16 linear saves from its input x ``[m, k]`` for backward (the weight excluded), from the
    formats: bf16 2mk; MXFP4 mk/2 + mk/32; FP8 rows mk + 4mk/128 plus FP8 columns k Mp + 4k Mp/128, with Mp the
    token count padded to 128 per segment of ``counts``."""
    if not _in_scope(recipe, layer_kind):
        return 2 * m * k
    if recipe.save_fp4:
        return mxfp4_bytes(m, k)
    return fp8_row_col_bytes(m, k, Segments.of(counts, m).padded_total)


def saved_bytes(y_or_ctx) -> int:
    """Bytes of x saved by the ``FP8Linear`` that produced ``y`` (or of its ctx / grad_fn)."""
    node = y_or_ctx.grad_fn if isinstance(y_or_ctx, torch.Tensor) else y_or_ctx
    while node is not None and not hasattr(node, "saved_activation_bytes"):
        # y may be a reshape of the function's output: walk single-input view nodes back to it.
        nxt = [f for f, _ in getattr(node, "next_functions", ()) if f is not None]
        node = nxt[0] if len(nxt) == 1 else None
    if node is None:
        raise ValueError("no FP8Linear in this tensor's history (the bf16 path saves 2*M*K bytes: linear_saved_bytes)")
    return node.saved_activation_bytes


__all__ = ["FP8Linear", "fp8_linear", "linear_saved_bytes", "saved_bytes"]
