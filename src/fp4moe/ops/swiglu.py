"""SwiGLU with a recipe-chosen saved copy of its input (docs/recipe.md, ``activation_fp4_store``).

``swiglu(h, recipe, layer_kind)``: h ``[T, 2F]`` bf16 (gate columns 0..F-1, up columns F..2F-1) ->
``z = silu(g) * u`` ``[T, F]`` bf16, computed in float32. Autograd would save float32 copies of g, silu(g)
and u (12 bytes per output element); this saves h only: as BF16 (``4F`` bytes per token) or, when the recipe
stores FP4 activations for ``layer_kind``, as MXFP4 (``F + F/16`` bytes per token; backward decodes it, so
dh carries the E2M1 error of h while the forward used the exact h). ``swiglu_math`` / ``swiglu_math_backward``
are the formulas, shared with the routed experts' SwiGLU weighted by routing probabilities (``grouped_experts``).
"""
from __future__ import annotations

from typing import Optional

import torch

from fp4moe_kernels import convert as kops
from fp4moe_kernels import switches
from fp4moe_kernels.formats import FormatError, MXFP4Tensor

from ..recipe import Recipe

_BF16 = torch.bfloat16


FUSED_ENV = switches.ENV["fused_swiglu"]


def fused_enabled(h: torch.Tensor) -> bool:
    """Whether ``swiglu_math`` / ``swiglu_math_backward`` run the fused Triton kernels
    (``fp4moe_kernels.triton_kernels.fused_swiglu``) for ``h``: a CUDA bfloat16 tensor, unless
    ``FP4MOE_FUSED_SWIGLU=0``.
    The CUDA default since the kernels passed their GPU tests on an H200 (results/train_proxy/README.md: 92-98 % of
    the copy bandwidth, 8-20x the unfused ops); the unfused torch ops below are the definition they are tested
    against, and what CPU tensors (and ``FP4MOE_FUSED_SWIGLU=0``) run."""
    return h.is_cuda and h.dtype == _BF16 and switches.current().fused_swiglu == "1"


FUSED_FP4_ENV = switches.ENV["fused_swiglu_fp4"]


def _fp4_switch_on(is_cuda: bool, f: int) -> bool:
    """The fused FP4-storing SwiGLU's switch for a CUDA tensor of FFN width ``f``: fused kernels on
    (``FP4MOE_FUSED_SWIGLU`` not 0), ``FP4MOE_FUSED_SWIGLU_FP4`` not 0, and whole MXFP4 blocks per half (f % 32 == 0)."""
    s = switches.current()
    return is_cuda and f % 32 == 0 and s.fused_swiglu == "1" and s.fused_swiglu_fp4 == "1"


def fused_fp4_enabled(h: torch.Tensor) -> bool:
    """Whether the SwiGLU with an MXFP4-stored input runs ``swiglu_fwd_fp4`` / ``swiglu_bwd_fp4`` (h's MXFP4 copy
    made in the forward's pass over h, decoded inside the backward kernel; bit for bit the separate
    ``bf16_to_fp4_row`` + ``fp4_to_bf16`` path, tests/kernels/test_swiglu_kernel.py) for ``h`` [T, 2F]: where the
    fused kernels run and F is a multiple of 32, unless ``FP4MOE_FUSED_SWIGLU_FP4=0``. The CUDA default since its
    GPU tests passed on an H200 and the forward measured 1.3x the two kernels it replaces (the backward 1.0-1.2x;
    results/kernels/README.md, 2026-12-01 second section)."""
    return h.dtype == _BF16 and h.shape[1] % 2 == 0 and _fp4_switch_on(h.is_cuda, h.shape[1] // 2)


FUSED_FP8_ENV = switches.ENV["fused_swiglu_fp8"]


def fused_fp8_enabled(is_cuda: bool, f: int) -> bool:
    """Whether the routed experts' SwiGLU writes the FP8 copies of its output (forward) and of its input's gradient
    (backward) itself (``swiglu_fp8`` / ``swiglu_backward_fp8`` through the fused Triton kernels) for CUDA tensors
    (``is_cuda``) of FFN width ``f``: the fused kernels on (``FP4MOE_FUSED_SWIGLU`` not 0), ``FP4MOE_FUSED_SWIGLU_FP8``
    1, and whole 1x128 groups per half (f % 128 == 0). Off by default until measured on a GPU (and the paper-scale
    memory model, ``fp4moe.scale.memory``, counts the default's BF16 dH at the experts' backward peak)."""
    s = switches.current()
    return is_cuda and f % 128 == 0 and s.fused_swiglu == "1" and s.fused_swiglu_fp8 == "1"


def swiglu_fp8(h: torch.Tensor, probs: Optional[torch.Tensor], seg, cols: bool):
    """(z's FP8 1x128 rows, z's FP8 columns or None without ``cols``) over the experts' rows ``seg`` for
    z = ``swiglu_math(h, probs)`` (h ``[T, 2F]`` bf16, probs ``[T]`` or None), from h in one pass
    (``fused_swiglu.swiglu_fwd_fp8``; z is never in memory): the bits of quantizing the fused ``swiglu_fwd``'s z
    with ``bf16_to_fp8_row`` / ``bf16_to_fp8_col``. Call where ``fused_fp8_enabled``."""
    from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_fwd_fp8

    return swiglu_fwd_fp8(h.contiguous(), None if probs is None else probs.float().contiguous(), seg, cols)


def swiglu_backward_fp8(h, dz: torch.Tensor, probs: Optional[torch.Tensor], seg, cols: bool):
    """(dh's FP8 1x128 rows, dh's FP8 columns or None without ``cols``, dprobs ``[T]`` float32 or None) over the
    experts' rows ``seg`` for ``swiglu_math_backward`` (h ``[T, 2F]`` bf16) or ``swiglu_math_backward_fp4`` (h as
    its MXFP4 ``(data, scales)``), in one pass over h and dz (``fused_swiglu.swiglu_bwd_fp8``; dh is never in
    memory): dh's copies bit for bit those of the fused kernels' dh, dprobs within float32 rounding of theirs.
    Call where ``fused_fp8_enabled``."""
    from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_bwd_fp8

    return swiglu_bwd_fp8(h if isinstance(h, tuple) else h.contiguous(), dz.to(_BF16).contiguous(),
                          None if probs is None else probs.float().contiguous(), seg, cols)


def swiglu_math_fp4(h: torch.Tensor, probs: Optional[torch.Tensor], rule: str):
    """(z as ``swiglu_math``, h's MXFP4 ``(data, scales)`` as ``bf16_to_fp4_row(h, rule)``): one fused pass over h
    where ``fused_fp4_enabled(h)``, else the two calls."""
    if fused_fp4_enabled(h):
        from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_fwd_fp4

        return swiglu_fwd_fp4(h.contiguous(), None if probs is None else probs.float().contiguous(), rule)
    q = kops.bf16_to_fp4_row(h.detach(), rule)
    return swiglu_math(h, probs), (q.data, q.scales)


def swiglu_math_backward_fp4(data: torch.Tensor, scales: torch.Tensor, dz: torch.Tensor,
                             probs: Optional[torch.Tensor] = None):
    """``swiglu_math_backward`` of the decoded MXFP4 h (data ``[T, F]``, scales ``[T, F/16]`` for h ``[T, 2F]``):
    decoded inside the fused backward kernel where ``fused_fp4_enabled``, else ``fp4_to_bf16`` then the backward."""
    t, f = data.shape
    if _fp4_switch_on(data.is_cuda, f):
        from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_bwd_fp4

        return swiglu_bwd_fp4(data, scales, dz.to(_BF16).contiguous(), None if probs is None else probs.float().contiguous())
    h = kops.fp4_to_bf16(MXFP4Tensor(data, scales, (t, 2 * f)))
    return swiglu_math_backward(h, dz, probs)


def swiglu_math(h: torch.Tensor, probs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """z = silu(g) * u (* probs per row) ``[T, F]`` bf16 from h ``[T, 2F]``, in float32 (no autograd)."""
    if fused_enabled(h):
        from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_fwd

        return swiglu_fwd(h.contiguous(), None if probs is None else probs.float().contiguous())
    f = h.shape[1] // 2
    z = torch.nn.functional.silu(h[:, :f].float()) * h[:, f:].float()
    return (z if probs is None else z * probs.unsqueeze(1)).to(_BF16)


def swiglu_math_backward(h: torch.Tensor, dz: torch.Tensor, probs: Optional[torch.Tensor] = None):
    """(dh ``[T, 2F]`` bf16, dprobs ``[T]`` float32 or None without probs) of ``swiglu_math``, in float32."""
    if fused_enabled(h):
        from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_bwd

        return swiglu_bwd(h.contiguous(), dz.to(_BF16).contiguous(),
                          None if probs is None else probs.float().contiguous())
    f = h.shape[1] // 2
    g, u = h[:, :f].float(), h[:, f:].float()
    s = torch.sigmoid(g)
    silu = g * s
    dzf = dz.float()
    dprobs = None if probs is None else (dzf * silu * u).sum(1)
    da = dzf if probs is None else dzf * probs.unsqueeze(1)
    dg = da * u * (s * (1 + g * (1 - s)))
    du = da * silu
    return torch.cat([dg, du], dim=1).to(_BF16), dprobs


class SwiGLU(torch.autograd.Function):
    """Use through ``swiglu``. forward(h, fp4, rule) -> z; ``ctx.saved_activation_bytes``."""

    @staticmethod
    def forward(ctx, h, fp4: bool, rule: str):
        if fp4:
            z, (data, scales) = swiglu_math_fp4(h, None, rule)
            ctx.save_for_backward(data, scales)
            ctx.saved_activation_bytes = data.numel() + scales.numel()
        else:
            z = swiglu_math(h)
            ctx.save_for_backward(h)
            ctx.saved_activation_bytes = h.numel() * h.element_size()
        ctx.fp4, ctx.shape = fp4, tuple(h.shape)
        return z

    @staticmethod
    def backward(ctx, dz):
        if ctx.fp4:
            data, scales = ctx.saved_tensors
            return swiglu_math_backward_fp4(data, scales, dz)[0], None, None
        (h,) = ctx.saved_tensors
        return swiglu_math_backward(h, dz)[0], None, None


def swiglu(h: torch.Tensor, recipe: Recipe, layer_kind: str = "shared_expert") -> torch.Tensor:
    """z = silu(h[:, :F]) * h[:, F:] (module docstring). h ``[T, 2F]`` bf16, 2F a multiple of 64 when stored
    as MXFP4 (F a multiple of 32). Saves MXFP4 when ``recipe.activation_fp4_store`` and the recipe covers
    ``layer_kind``, else BF16."""
    if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] % 2:
        raise FormatError(f"h must be [T, 2F] with an even last dim, got {getattr(h, 'shape', type(h).__name__)}")
    if h.dtype != _BF16:
        raise FormatError(f"h has dtype {h.dtype}; expected bfloat16: cast it with .to(torch.bfloat16)")
    fp4 = bool(recipe.activation_fp4_store and recipe.applies_to(layer_kind))
    return SwiGLU.apply(h.contiguous(), fp4, recipe.scale_rule)


__all__ = ["SwiGLU", "swiglu", "swiglu_math", "swiglu_math_backward", "swiglu_math_fp4", "swiglu_math_backward_fp4",
           "fused_enabled", "fused_fp4_enabled", "FUSED_ENV", "FUSED_FP4_ENV"]
