"""Routed experts of one rank over ragged per-expert token counts, as one autograd function (docs/recipe.md).

``grouped_expert_mlp(x, counts, w1, w2, probs, recipe)``: for every expert e with rows ``r0:r1`` of x
(``counts[e]`` tokens, any count including 0, experts in order)::

    h = x_e W1_e^T                    [m, 2F]  fc1 (gate rows 0..F-1 of W1_e, up rows F..2F-1)
    z = silu(h_gate) * h_up * p       [m, F]   weighted SwiGLU in float32 (p = probs[r0:r1], megatron's order)
    y = z W2_e^T                      [m, H]   fc2

Backend for recipes fp8 / mxfp4 (``gemm_backend``): on CUDA one Triton launch per GEMM for all experts
(``fp4moe_kernels.triton_kernels.gemm``: ragged rows, 1x128 x 128x128 scales, FP32 promotion every 128 of K),
else a loop over the non-empty experts of ``fp8_mm`` (``F.scaled_mm`` on CUDA, the exact emulation on CPU);
plain BF16 ``@`` per expert for bf16. The SwiGLU runs once over all rows.

What is saved for backward (the weights are saved by reference and re-quantized in backward, as FP8Linear, or
taken from ``fp4moe.ops.weight_cache`` when it is enabled: one quantizer pass per optimizer step for both copies):

    tensor             bf16            fp8                              mxfp4 (paper preset)
    fc1 input x        x (2TH)         FP8 rows + FP8 cols              MXFP4 (when expert_input_fp4 or save_fp4)
    SwiGLU input h     h (4TF)         h bf16 (4TF)                     MXFP4 when activation_fp4_store
    fc2 input z        z (2TF)         FP8 rows + FP8 cols              MXFP4 when save_fp4
    probs              fp32 (4T)       fp32                             fp32

``expert_saved_bytes`` gives these bytes from the formats (everything but the weights). Under the kernel switch
``fused_swiglu_fp8`` (``fp4moe.ops.swiglu.fused_fp8_enabled``) the SwiGLU writes the FP8 rows and columns of z
(forward, fp8) and of dH (backward, every FP8 recipe) itself, z and dH never in memory in BF16: the same bits. The FP8 row copies are
kept although backward does not read them (Transformer Engine's Float8BlockScaling holds both; see
``fp8_linear``). Under ``activation_fp4_store`` the forward SwiGLU uses the exact h; backward uses the decoded
MXFP4 h (``fp4_to_bf16``), so dprobs and dh carry the E2M1 error of h.

Weights: ``[E, 2F, H]`` / ``[E, H, F]`` tensors, or sequences of E ``[2F, H]`` / ``[H, F]`` tensors that may
lie anywhere in memory (a model's expert parameters, e.g. in megatron's DDP buffer): on CUDA the FP8 weight
quantizer reads each expert where it is (no stacked copy); their gradients come back per expert. Two ``[E, N, K]``
tensors enter the autograd Function whole and get the wgrad's ``[E, N, K]`` gradients as they are (per-expert views
would have autograd stack their gradients back: a copy of both weight gradients per backward).

Input x: a ``[T, H]`` bf16 tensor, or an ``MXFP4Tensor`` / ``DispatchedMXFP4`` (the dispatch's ``keep_fp4``
output). With ``recipe.expert_input_fp4`` fc1's FP8 rows come from ``fp4_row_to_fp8_row`` of the MXFP4 (a bf16 x
is first quantized with ``bf16_to_fp4_row``) and the saved input is that MXFP4; the gradient of x is returned
to the bf16 x or to the ``grad_anchor`` of a ``DispatchedMXFP4`` (straight-through: dL/dx_hat). Without
``expert_input_fp4`` an MXFP4 input is decoded first (``DispatchedMXFP4.dequantize_ste``).

Gradients: x (bf16), w1, w2 (FP32 accumulation, returned in the weights' dtype; empty experts get zeros),
probs (float32). dgrad GEMMs quantize the upstream gradient to FP8 1x128 rows, wgrad GEMMs use FP8 1x128
columns per expert (tokens padded to 128). Shapes: H, F multiples of 128 on the FP8 paths.

Gradient-accumulation fusion (megatron's ``gradient_accumulation_fusion``, Transformer Engine's
``fuse_wgrad_accumulation``): for expert weights registered by :func:`fuse_wgrad_accumulation` that carry megatron
DDP's ``main_grad`` (its FP32 or BF16 gradient buffer) the wgrad is added into ``main_grad`` where it is made
(the grouped kernel's epilogue, or for bf16 cuBLAS's ``C = A B + C``, reads and writes it: 8 B per FP32 element
where the unfused path writes the BF16 gradient and DDP's hook then adds it, 12 B), the sum formed in FP32 and
rounded once; the weight's ``grad_added_to_main_grad`` is set and autograd gets an uninitialized stand-in gradient
(zeros under ``zero_out_wgrad``), which DDP's hook drops, as megatron's own linears do.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from fp4moe_kernels import convert as kops
from fp4moe_kernels import switches
from fp4moe_kernels.constants import FP8_GROUP
from fp4moe_kernels.formats import FormatError, FP8ColTensor, FP8RowTensor, MXFP4Tensor, Segments, host_to_device
from fp4moe_kernels.sizes import fp8_row_col_bytes, mxfp4_bytes

from ..recipe import Recipe
from .fp8_gemm import fp8_mm, quantize_weight_128x128
from .fp8_linear import fp8_rows
from .swiglu import (fused_fp8_enabled, swiglu_backward_fp8, swiglu_fp8, swiglu_math, swiglu_math_backward,
                     swiglu_math_backward_fp4, swiglu_math_fp4)
from .weight_cache import CACHE
from .wgrad_accumulation import add_fp32, add_product

_BF16 = torch.bfloat16


def _uses_fp4_input(recipe: Recipe, x_is_fp4: bool) -> bool:
    return recipe.fp8_compute and (recipe.expert_input_fp4 or (recipe.save_fp4 and not x_is_fp4))


def expert_saved_bytes(counts, hidden: int, ffn: int, recipe: Recipe) -> int:
    """Bytes ``grouped_expert_mlp`` saves for backward (weights excluded; probs included), from the formats.

    T = sum(counts), Mp = sum over experts of counts padded to 128. fc1 input ``[T, H]``: bf16 2TH, FP8
    row+col ``TH + 4TH/128 + H Mp + 4H Mp/128``, MXFP4 ``TH/2 + TH/32``; SwiGLU input ``[T, 2F]``: bf16 4TF or
    MXFP4 ``TF + TF/16``; fc2 input ``[T, F]``: bf16 2TF, FP8 row+col, or MXFP4; probs 4T."""
    seg = Segments.of(list(counts), sum(int(c) for c in counts))
    t, mp, h, f = seg.total, seg.padded_total, hidden, ffn
    if not recipe.fp8_compute:
        return 2 * t * h + 2 * t * 2 * f + 2 * t * f + 4 * t
    x_b = mxfp4_bytes(t, h) if (recipe.expert_input_fp4 or recipe.save_fp4) else fp8_row_col_bytes(t, h, mp)
    h_b = mxfp4_bytes(t, 2 * f) if recipe.activation_fp4_store else 2 * t * 2 * f
    z_b = mxfp4_bytes(t, f) if recipe.save_fp4 else fp8_row_col_bytes(t, f, mp)
    return x_b + h_b + z_b + 4 * t


# ------------------------------------------------------------------------------------------ GEMM helpers


class Experts:
    """E expert weights ``[N, K]`` read as one ``[E, N, K]`` operand, each where it lies (``shape``, ``dtype``,
    ``device``, ``experts[e]`` as a tensor's). ``stacked``: the ``[E, N, K]`` tensor when the weights were given as
    one (``ws`` are then its views), else None; the FP8 weight cache keys such weights by it."""

    def __init__(self, ws) -> None:
        self.stacked = ws if torch.is_tensor(ws) else None
        self.ws = tuple(ws.unbind(0)) if torch.is_tensor(ws) else tuple(ws)
        w0 = self.ws[0]
        if w0.dim() != 2 or not all(w.shape == w0.shape and w.dtype == w0.dtype and w.device == w0.device
                                    for w in self.ws):
            raise FormatError(f"expert weights must be [N, K] tensors of one shape, dtype and device, got "
                              f"{[tuple(w.shape) for w in self.ws]}")
        self.shape = (len(self.ws), *w0.shape)
        self.dtype, self.device = w0.dtype, w0.device

    def __len__(self) -> int:
        return len(self.ws)

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.ws[e]


def quantize_experts_128x128(w, transpose: bool = False, both: bool = False):
    """All experts' weights ``w`` (``[E, N, K]``, a sequence of E ``[N, K]``, or :class:`Experts`) quantized 128x128
    in one call: (data ``[E, N, K]`` E4M3, scale ``[E, N/128, K/128]`` float32), bit-equal to
    ``quantize_weight_128x128(w[e])`` per expert (N is a multiple of 128, so no block straddles two experts).
    ``transpose``: the blocks of every ``W_e^T`` instead (``[E, K, N]``, ``[E, K/128, N/128]``; exact, see
    ``transpose_weight_128x128``); ``both``: ((data, scale), (the transposed pair)) from the same pass. On CUDA each
    expert is read where it lies, and one launch writes both layouts."""
    ex = w if isinstance(w, Experts) else Experts(w)
    e, n, k = ex.shape
    if ex.device.type == "cuda" and ex.dtype == torch.bfloat16 and e * n and k:  # one Triton launch
        from fp4moe_kernels.triton_kernels import launchers

        out = launchers.quantize_weight_128x128([x.detach().contiguous() for x in ex.ws], n, transpose or both)
        fwd = (out[0].view(e, n, k), out[1].view(e, n // FP8_GROUP, k // FP8_GROUP))
        tr = (out[2], out[3]) if transpose or both else None
    else:
        stacked = ex.stacked.detach() if ex.stacked is not None else torch.stack([x.detach() for x in ex.ws])
        data, scale = quantize_weight_128x128(stacked.reshape(e * n, k))
        fwd = (data.view(e, n, k), scale.view(e, n // FP8_GROUP, k // FP8_GROUP))
        tr = (fwd[0].transpose(1, 2).contiguous(), fwd[1].transpose(1, 2).contiguous()) if transpose or both else None
    if both:
        return fwd, tr
    return tr if transpose else fwd


def fp8_experts(w: "Experts", transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_experts_128x128(w, transposed)``, from ``weight_cache.CACHE`` when enabled (then the forward and
    the dgrad copies come from one quantizer pass: on CUDA one launch writes both). The cache's key: the ``[E, N, K]``
    tensor itself when the weights came as one (found again through its detach in a recompute, and its own
    ``requires_grad`` says whether a backward will ask for the dgrad copy: its views, unbound under the Function's
    no_grad, would say no), else the E per-expert tensors."""
    ex = w if isinstance(w, Experts) else Experts(w)

    def make(both: bool):
        return quantize_experts_128x128(ex, both=True) if both else (quantize_experts_128x128(ex), None)
    return CACHE.get((ex.stacked,) if ex.stacked is not None else ex.ws, make, transposed)


def gemm_backend(device: torch.device) -> str:
    """'triton' (one grouped launch per GEMM, ``fp4moe_kernels.triton_kernels.gemm``) on CUDA, 'deepgemm' (fprop and
    dgrad through DeepGEMM's grouped GEMM on rows padded to 128 per expert, wgrad Triton; ``fp4moe_kernels.deepgemm``)
    or 'loop' (one ``fp8_mm`` per expert: ``F.scaled_mm`` on CUDA, the exact emulation on CPU) as the
    ``grouped_gemm`` switch says (``fp4moe_kernels.switches``, ``FP4MOE_GROUPED_GEMM``; the benchmark compares them);
    always 'loop' off CUDA."""
    if device.type != "cuda":
        return "loop"
    return switches.current().grouped_gemm


def gemm_row_align(device: torch.device, recipe: Recipe, given: int | None = None) -> int:
    """Rows each expert's block must be a multiple of for the GEMM backend: ``given`` when not None (a caller's
    explicit ``row_align``, e.g. forced on CPU in tests), else ``fp4moe_kernels.deepgemm.ALIGN`` (128) for
    'deepgemm' under an FP8-compute recipe, else 1 (no padding)."""
    if given is not None:
        return int(given)
    if recipe.fp8_compute and gemm_backend(device) == "deepgemm":
        from fp4moe_kernels.deepgemm import ALIGN

        return ALIGN
    return 1


def _per_expert_gemm(row: FP8RowTensor, w: Experts, seg: Segments, n: int, kind: str) -> torch.Tensor:
    """[T, n] bf16, per expert e: rows_e (FP8) times W_e in FP8 (128x128 blocks). ``kind`` 'fprop':
    W = w [E, n, K], out = rows_e W_e^T; 'dgrad': W = w [E, N, n], out = dY_e W_e (transposed blocks).
    The weights of all experts are quantized in one call (``quantize_experts_128x128``), then one
    ``fp8_mm`` per non-empty expert."""
    if seg.total == 0:
        return torch.empty(0, n, dtype=_BF16, device=row.data.device)
    wd, ws = fp8_experts(w, transposed=kind == "dgrad")
    backend = gemm_backend(row.data.device)
    if backend == "deepgemm":
        from fp4moe_kernels import deepgemm

        if deepgemm.row_aligned(seg):  # grouped_expert_mlp pads the rows; unpadded callers take the Triton kernel
            return deepgemm.m_grouped_rows(row, wd, ws)
    if backend in ("triton", "deepgemm"):
        from fp4moe_kernels.triton_kernels import launchers

        return launchers.grouped_fp8_rows(row, wd, ws)
    # the loop path fills its own output; the Triton kernel allocates one (an [T, n] buffer here would be a second
    # one, live at the backward's memory peak)
    out = torch.empty(seg.total, n, dtype=_BF16, device=row.data.device)
    for e, (r0, r1) in enumerate(zip(seg.offsets[:-1], seg.offsets[1:])):
        if r1 == r0:
            continue
        a, sa = row.segment(e)
        out[r0:r1] = fp8_mm(a, sa, wd[e], ws[e], kind, check=False)
    return out


def _wgrad(dy_col: FP8ColTensor, x_col: FP8ColTensor, seg: Segments, like: torch.Tensor,
           into: list[torch.Tensor] | None = None) -> torch.Tensor | None:
    """dW [E, n, k] in ``like.dtype``: per expert dY_e^T X_e (FP8 columns, FP32 accumulation, one rounding to
    the weight dtype); zeros for empty experts. The grouped Triton kernel under 'triton' and 'deepgemm' (DeepGEMM's
    k-grouped kernel reached 0.58x of dense; cuBLAS per expert 0.69x alone, but its loop is host-bound inside a
    layer whose other GEMMs are fast: 0.89x of the Triton wgrad's layer throughput with the FP8 weight cache on,
    results/moe_layer/README.md), unless the ``wgrad_gemm`` switch says 'loop'; else one ``fp8_mm`` per expert.
    ``into`` (E ``[n, k]`` main gradients): each gets ``+= dY_e^T X_e`` instead (FP32 sum, one rounding to its
    dtype) and None is returned."""
    if gemm_backend(like.device) in ("triton", "deepgemm") and switches.current().wgrad_gemm == "triton":
        from fp4moe_kernels.triton_kernels import launchers

        return launchers.grouped_fp8_wgrad(dy_col, x_col, out_dtype=like.dtype, accumulate_into=into)
    out = None if into is not None else torch.empty(like.shape, dtype=like.dtype, device=like.device)
    for e, c in enumerate(seg.counts):
        if c == 0:
            if out is not None:
                out[e].zero_()
            continue
        a, sa = dy_col.segment(e)
        b, sb = x_col.segment(e)
        if into is None:
            out[e] = fp8_mm(a, sa, b, sb, "wgrad", out_dtype=like.dtype, check=False)
        else:
            add_fp32(into[e], fp8_mm(a, sa, b, sb, "wgrad", out_dtype=torch.float32, check=False))
    return out


def _bf16_mm_per_expert(x: torch.Tensor, w: Experts, seg: Segments, transpose_w: bool) -> torch.Tensor:
    """BF16 path: out_e = x_e @ W_e^T (transpose_w) or x_e @ W_e, ``[T, n]``. Each product is written into its rows
    of the output (``torch.mm(..., out=)``: no temporary and no copy per expert; every row belongs to an expert,
    so the output needs no zero fill)."""
    n = w.shape[1] if transpose_w else w.shape[2]
    out = torch.empty(seg.total, n, dtype=_BF16, device=x.device)
    for e, (r0, r1) in enumerate(zip(seg.offsets[:-1], seg.offsets[1:])):
        if r1 == r0:
            continue
        we = w[e].to(_BF16)
        torch.mm(x[r0:r1], we.t() if transpose_w else we, out=out[r0:r1])
    return out


def _bf16_wgrad(dy: torch.Tensor, x: torch.Tensor, seg: Segments, like: torch.Tensor,
                into: list[torch.Tensor] | None = None) -> torch.Tensor | None:
    """dW ``[E, n, k]`` in ``like.dtype``: per expert dY_e^T X_e written into its slice (zeros for empty experts);
    with ``into`` (E main gradients) each product is added into its own instead and None is returned: on CUDA in
    the GEMM's epilogue (cuBLAS ``C = A B + C``, FP32 accumulation, one rounding to the main gradient's dtype: an
    FP32 main gradient through ``torch.addmm``'s ``out_dtype``), so no BF16 product is written and read again;
    elsewhere (CPU: no mixed-dtype addmm) the BF16 product, then the add (``fp4moe.ops.wgrad_accumulation``)."""
    if into is not None:
        for e, (r0, r1) in enumerate(zip(seg.offsets[:-1], seg.offsets[1:])):
            if r1 > r0:
                add_product(into[e], dy[r0:r1].t(), x[r0:r1])
        return None
    out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    for e, (r0, r1) in enumerate(zip(seg.offsets[:-1], seg.offsets[1:])):
        if r1 > r0 and out.dtype == dy.dtype == x.dtype:
            torch.mm(dy[r0:r1].t(), x[r0:r1], out=out[e])
        elif r1 > r0:  # weights in another dtype (e.g. float32): the product rounded into it
            out[e] = dy[r0:r1].t() @ x[r0:r1]
        else:
            out[e].zero_()
    return out


# ------------------------------------------------------------------------- gradient-accumulation fusion

_FUSED: "weakref.WeakValueDictionary[tuple, torch.Tensor]" = weakref.WeakValueDictionary()


def _place(t: torch.Tensor) -> tuple:
    """Where a tensor's elements lie (storage, offset, shape, strides, dtype): the same for a parameter and every
    ``detach()`` or alias of it (a recompute's detached weights, what a saved-tensors hook hands back)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def fuse_wgrad_accumulation(params, enabled: bool = True) -> int:
    """Register (or, ``enabled=False``, unregister) expert weights whose wgrad is added into their ``main_grad``
    (module docstring); returns how many. Call once the parameters lie where they stay (after megatron's DDP wrap,
    which may move them into its buffer). Takes effect for weights that carry DDP's ``main_grad`` and
    ``grad_added_to_main_grad``; others keep the unfused path. A weight is found again through any view of the same
    elements (:func:`_place`); the registry holds the parameters weakly."""
    params = list(params)
    for p in params:
        if enabled:
            _FUSED[_place(p)] = p
        else:
            _FUSED.pop(_place(p), None)
    return len(params)


def _fused_params(w: "Experts") -> list[torch.Tensor] | None:
    """The registered parameters behind this GEMM's weights (one per expert, or the ``[E, N, K]`` tensor) when every
    one is registered and carries DDP's ``main_grad``, else None (the unfused path)."""
    tensors = [w.stacked] if w.stacked is not None else list(w.ws)
    params = [_FUSED.get(_place(t)) for t in tensors]
    if any(p is None or getattr(p, "main_grad", None) is None or not hasattr(p, "grad_added_to_main_grad")
           for p in params):
        return None
    return params


def _targets(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The E ``[N, K]`` main gradients of ``_fused_params``'s parameters (an ``[E, N, K]`` one's unbound)."""
    return [g for p in params for g in (p.main_grad.unbind(0) if p.dim() == 3 else (p.main_grad,))]


def _stand_in_grad(w: "Experts", params: list[torch.Tensor]) -> torch.Tensor:
    """What autograd gets for fused weights (``[E, N, K]``, unbound per expert by the caller): DDP's hook drops it
    (``grad_added_to_main_grad`` is set here on the parameters); uninitialized, or zeros under ``zero_out_wgrad``
    (megatron's linears' convention)."""
    for p in params:
        p.grad_added_to_main_grad = True
    zero = any(getattr(p, "zero_out_wgrad", False) for p in params)
    return (torch.zeros if zero else torch.empty)(w.shape, dtype=w.dtype, device=w.device)


# ------------------------------------------------------------------------------------- autograd function


def _weight_grad(s: dict, name: str, d_out: torch.Tensor, seg, w: "Experts", k: int, fp8: bool,
                 d_col: FP8ColTensor | None = None) -> torch.Tensor:
    """dW ``[E, N, K]`` of one grouped GEMM from its saved input ``name``: the MXFP4 copy (wgrad operand rebuilt
    with FP4RowToFP8Col), the FP8 column copy, or (bf16 recipe) the BF16 input itself; ``k`` its channels; ``d_col``:
    d_out's FP8 columns where already made (``fp8_rows``), else made here. For fused weights (``_fused_params``) the
    gradient goes into their ``main_grad`` and the stand-in comes back."""
    params = _fused_params(w)
    into = _targets(params) if params is not None else None
    if not fp8:
        dw = _bf16_wgrad(d_out, s[name], seg, w, into)
    else:
        if f"{name}_fp4_data" in s:
            mx = MXFP4Tensor(s[f"{name}_fp4_data"], s[f"{name}_fp4_scales"], (seg.total, k))
            col = kops.fp4_row_to_fp8_col(mx, seg)
        else:
            col = FP8ColTensor(s[f"{name}_col_data"], s[f"{name}_col_scales"], seg, k)
        dw = _wgrad(d_col if d_col is not None else kops.bf16_to_fp8_col(d_out, seg), col, seg, w, into)
    return _stand_in_grad(w, params) if params is not None else dw


def stacked_weights(weights) -> bool:
    """Whether the weight inputs of ``GroupedExpertMLP`` / ``_ExpertRecompute`` are the two ``[E, N, K]`` tensors
    (w1, w2) rather than the E fc1 then the E fc2 ``[N, K]`` tensors."""
    return len(weights) == 2 and weights[0].dim() == 3


def weight_halves(weights, e_num: int):
    """(w1, w2) of the Functions' weight inputs: the two ``[E, N, K]`` tensors, or the two runs of E ``[N, K]``."""
    return tuple(weights) if stacked_weights(weights) else (tuple(weights[:e_num]), tuple(weights[e_num:]))


class GroupedExpertMLP(torch.autograd.Function):
    """Use through ``grouped_expert_mlp``. forward(x_hp, probs, x_fp4, recipe, seg, *weights) -> y [T, H] bf16,
    ``weights`` = w1 ``[E, 2F, H]`` and w2 ``[E, H, F]`` (two inputs: their gradients are the wgrad's ``[E, N, K]``
    tensors as they are, no per-expert views that autograd would stack back, a copy of both gradients per backward),
    or the E fc1 weights ``[2F, H]`` then the E fc2 weights ``[H, F]`` (E = seg.num; a gradient per expert).

    ``x_hp``: the bf16 input, or the ``grad_anchor`` of a dispatched MXFP4 (values unused then), or None;
    ``x_fp4``: the MXFP4 input (expert_input_fp4) or None; ``backward``: whether a backward can follow (grad mode
    was on at the call: ``ctx.needs_input_grad`` follows requires_grad even under ``torch.no_grad``). Without it
    only what the output needs is made (no FP8 column copies, no MXFP4 copies to save), e.g. in the first forward of
    a recomputed block or of ``_ExpertRecompute``, both under no_grad: the same output bits.
    ``ctx.saved_activation_bytes`` = what was saved."""

    @staticmethod
    def forward(ctx, x_hp, probs, x_fp4, recipe: Recipe, seg: Segments, backward: bool, *weights):
        w1, w2 = (Experts(w) for w in weight_halves(weights, seg.num))
        e_num, f2, h = w1.shape
        f = f2 // 2
        fp8 = recipe.fp8_compute
        n1 = 1 if w1.stacked is not None else e_num  # fc1's weight inputs
        need_w1 = backward and any(ctx.needs_input_grad[6:6 + n1])
        need_w2 = backward and any(ctx.needs_input_grad[6 + n1:])
        saved: dict[str, torch.Tensor] = {}
        # ---- fc1
        if not fp8:
            hmat = _bf16_mm_per_expert(x_hp, w1, seg, True)
            saved["x"] = x_hp
        else:
            if x_fp4 is not None:
                x_row = kops.fp4_row_to_fp8_row(x_fp4, seg)
            elif recipe.save_fp4 and need_w1:
                x_fp4, x_row = kops.bf16_to_fp4_and_fp8_row(x_hp, seg, rule=recipe.scale_rule)
            else:
                x_row, x_col = fp8_rows(x_hp, seg, need_w1)
            hmat = _per_expert_gemm(x_row, w1, seg, f2, "fprop")
            if x_fp4 is not None:
                saved["x_fp4_data"], saved["x_fp4_scales"] = x_fp4.data, x_fp4.scales
            elif need_w1:
                x_col = x_col if x_col is not None else kops.bf16_to_fp8_col(x_hp, seg)
                saved.update(x_row_data=x_row.data, x_row_scales=x_row.scales, x_col_data=x_col.data,
                             x_col_scales=x_col.scales)
        # ---- SwiGLU (float32), weighted by the routing probabilities
        z_row = z_col = None  # fc2's FP8 operands where the SwiGLU writes them itself (z then never in memory)
        if recipe.activation_fp4_store and backward:  # h's MXFP4 copy, in the SwiGLU's own pass over h where fused
            z, (saved["h_fp4_data"], saved["h_fp4_scales"]) = swiglu_math_fp4(hmat, probs, recipe.scale_rule)
        else:
            saved["h"] = hmat
            if fp8 and not (recipe.save_fp4 and need_w2) and fused_fp8_enabled(hmat.is_cuda, f):
                z = None
                z_row, z_col = swiglu_fp8(hmat, probs, seg, need_w2)
            else:
                z = swiglu_math(hmat, probs)
        # ---- fc2
        if not fp8:
            y = _bf16_mm_per_expert(z, w2, seg, True)
            saved["z"] = z
        else:
            if recipe.save_fp4 and need_w2:
                z4, z_row = kops.bf16_to_fp4_and_fp8_row(z, seg, rule=recipe.scale_rule)
                saved["z_fp4_data"], saved["z_fp4_scales"] = z4.data, z4.scales
            else:
                if z_row is None:
                    z_row, z_col = fp8_rows(z, seg, need_w2)
                if need_w2:
                    z_col = z_col if z_col is not None else kops.bf16_to_fp8_col(z, seg)
                    saved.update(z_row_data=z_row.data, z_row_scales=z_row.scales, z_col_data=z_col.data,
                                 z_col_scales=z_col.scales)
            y = _per_expert_gemm(z_row, w2, seg, h, "fprop")
        saved["probs"] = probs
        ctx.names = list(saved)
        ctx.meta = (recipe, seg, h, f, need_w1, need_w2, len(weights))
        ctx.saved_activation_bytes = sum(
            {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved.values()}.values()
        )
        ctx.save_for_backward(*weights, *saved.values())  # the weights by reference
        return y

    @staticmethod
    def backward(ctx, dy):
        recipe, seg, h, f, need_w1, need_w2, n_w = ctx.meta
        tensors = ctx.saved_tensors
        w1, w2 = (Experts(w) for w in weight_halves(tensors[:n_w], seg.num))
        s = dict(zip(ctx.names, tensors[n_w:]))
        fp8 = recipe.fp8_compute
        dy = dy.to(_BF16).contiguous()
        probs = s["probs"]
        # ---- fc2 backward
        dy_col = dh_col = None  # FP8 columns of dY / dH made with their rows (fp8_rows), else by _weight_grad
        if fp8:
            dy_row, dy_col = fp8_rows(dy, seg, need_w2)
            dz = _per_expert_gemm(dy_row, w2, seg, f, "dgrad")
            del dy_row
        else:
            dz = _bf16_mm_per_expert(dy, w2, seg, False)
        dw2 = _weight_grad(s, "z", dy, seg, w2, f, fp8, dy_col) if need_w2 else None
        del dy_col
        # ---- SwiGLU backward (from the saved, possibly MXFP4-decoded, h)
        dh = dh_row = None  # dh in BF16, or fc1's FP8 operands where the SwiGLU writes them itself (dh never in memory)
        if fp8 and fused_fp8_enabled(dz.is_cuda, f):
            h_saved = s["h"] if "h" in s else (s["h_fp4_data"], s["h_fp4_scales"])
            dh_row, dh_col, dprobs = swiglu_backward_fp8(h_saved, dz, probs, seg, need_w1)
        elif "h" in s:
            dh, dprobs = swiglu_math_backward(s["h"], dz, probs)
        else:  # decoded in the fused kernel, or through a BF16 h that dies here
            dh, dprobs = swiglu_math_backward_fp4(s["h_fp4_data"], s["h_fp4_scales"], dz, probs)
        # dz [T, F] (and any decoded h [T, 2F]) are dead: free them before fc1's backward, the layer's memory peak
        # (fp4moe.scale.memory.expert_backward_bytes lists what is live there)
        del dz
        # ---- fc1 backward
        dx = dw1 = None
        if ctx.needs_input_grad[0] and fp8:
            if dh_row is None:
                dh_row, dh_col = fp8_rows(dh, seg, need_w1)
            dx = _per_expert_gemm(dh_row, w1, seg, h, "dgrad")
            del dh_row
        elif ctx.needs_input_grad[0]:
            dx = _bf16_mm_per_expert(dh, w1, seg, False)
        if need_w1:
            dw1 = _weight_grad(s, "x", dh, seg, w1, h, fp8, dh_col)
        dp = dprobs.to(probs.dtype) if ctx.needs_input_grad[1] else None
        if w1.stacked is not None:  # the [E, N, K] gradients as the wgrad made them
            return (dx, dp, None, None, None, None, dw1, dw2)
        per_expert = [None] * seg.num
        dws = (per_expert if dw1 is None else list(dw1.unbind(0))) + (per_expert if dw2 is None else list(dw2.unbind(0)))
        return (dx, dp, None, None, None, None, *dws)


# ------------------------------------------------------------------------- rows padded to the backend's blocks


@dataclass(frozen=True)
class RowPadding:
    """Where T rows go among Tp = ``padded.total`` (every expert's rows padded to a multiple of the alignment):
    ``dst`` int64 ``[T]`` the padded position of each row (expert e's rows keep their order and start at its padded
    offset); ``src`` int64 ``[Tp]`` the row each padded position takes (0 on the padding, which ``pad`` lists,
    int64 ``[Tp - T]``, and which :meth:`rows` zeroes). Gathers, not scatters: torch's row gather runs near copy
    bandwidth, its ``index_copy_`` at about a third of it (0.7 ms for 32768 x 7168 BF16 rows on an H200)."""

    padded: Segments
    dst: torch.Tensor
    src: torch.Tensor
    pad: torch.Tensor

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, ...]`` -> ``[Tp, ...]``, zero rows on the padding."""
        return x.index_select(0, self.src).index_fill_(0, self.pad, 0)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """y ``[Tp, ...]`` -> the T real rows ``[T, ...]``."""
        return y.index_select(0, self.dst)


def padded_rows(seg: Segments, align: int, device) -> RowPadding:
    """The :class:`RowPadding` of ``seg`` with every count rounded up to a multiple of ``align``."""
    padded = Segments(tuple(-(-c // align) * align for c in seg.counts))
    # host tables go through host_to_device: a pageable copy would wait for the stream to drain (GPU idle after)
    shift = host_to_device(torch.tensor([p - o for p, o in zip(padded.offsets[:-1], seg.offsets[:-1])],
                                        dtype=torch.int64), device)
    counts = host_to_device(torch.tensor(seg.counts, dtype=torch.int64), device)
    dst = torch.arange(seg.total, device=device) + torch.repeat_interleave(shift, counts, output_size=seg.total)
    src = torch.zeros(padded.total, dtype=torch.int64, device=device).index_copy_(
        0, dst, torch.arange(seg.total, device=device))
    # the padding rows from the host's counts (fewer than align per expert): no device-to-host sync, as a mask's
    # nonzero() would be
    pad = [i for p0, c, p1 in zip(padded.offsets[:-1], seg.counts, padded.offsets[1:]) for i in range(p0 + c, p1)]
    return RowPadding(padded, dst, src, host_to_device(torch.tensor(pad, dtype=torch.int64), device))


class _RowMap(torch.autograd.Function):
    """``there(x)`` forward, ``back(g)`` backward, for a pair of :class:`RowPadding` maps that are each other's
    adjoint: ``(rp.rows, rp.unpad)`` pads (the gradient: its real rows), ``(rp.unpad, rp.rows)`` takes the real rows
    back (the gradient padded with zeros)."""

    @staticmethod
    def forward(ctx, x, there, back):
        ctx.back = back
        return there(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.back(g), None, None


def map_rows(x: torch.Tensor, there, back) -> torch.Tensor:
    """``there(x)``, differentiable with gradient ``back(g)``: a pair of row maps that are each other's adjoint
    (gathers, with zero rows where one side has padding), e.g. ``(rp.rows, rp.unpad)`` to pad the rows of ``x``
    (the gradient: its real rows) as :class:`RowPadding` ``rp`` says. ``fp4moe.moe.dispatch`` pads the routed
    rows' probabilities so and composes the padding with its permutations through it."""
    return _RowMap.apply(x, there, back)


class _PadAnchor(torch.autograd.Function):
    """A dispatched MXFP4's gradient anchor (values unused) ``[T, H]`` -> a stride-0 zero ``[Tp, H]`` whose gradient
    (dL/dx_hat of the padded rows) goes back to the T rows."""

    @staticmethod
    def forward(ctx, anchor, rp: RowPadding):
        ctx.rp = rp
        return torch.zeros((), dtype=anchor.dtype, device=anchor.device).expand(rp.padded.total, anchor.shape[1])

    @staticmethod
    def backward(ctx, g):
        return ctx.rp.unpad(g), None


def _pad_mxfp4(x: MXFP4Tensor, rp: RowPadding) -> MXFP4Tensor:
    """MXFP4 rows padded as ``rp`` says; the padding rows are zero codes (value 0) with zero scale bytes, the bits
    the dispatch's padded MXFP4 gathers write too (``fp4moe.ops.all_to_all._zero_rows``)."""
    return MXFP4Tensor(rp.rows(x.data), rp.rows(x.scales), (rp.padded.total, x.shape[1]))


def function_weights(w1, w2) -> tuple:
    """The weight inputs of ``GroupedExpertMLP`` / ``_ExpertRecompute`` for ``grouped_expert_mlp``'s w1, w2: (w1, w2)
    when both are ``[E, N, K]`` tensors (their gradients come back whole), else the E fc1 then the E fc2 ``[N, K]``
    tensors (a 3-D tensor given with a per-expert sequence is unbound: its gradient is stacked back by autograd)."""
    if all(torch.is_tensor(w) and w.dim() == 3 for w in (w1, w2)):
        return (w1, w2)
    ws = [tuple(w.unbind(0)) if torch.is_tensor(w) and w.dim() == 3 else tuple(w) for w in (w1, w2)]
    if len(ws[0]) != len(ws[1]):
        raise FormatError(f"w1 has {len(ws[0])} experts and w2 {len(ws[1])}: need [E, 2F, H] and [E, H, F]")
    return (*ws[0], *ws[1])


def grouped_expert_mlp(x, counts, w1, w2, probs: torch.Tensor, recipe: Recipe, *,
                       row_align: int | None = None) -> torch.Tensor:
    """Routed experts (module docstring). x ``[T, H]`` bf16 or an ``MXFP4Tensor`` / ``DispatchedMXFP4``;
    counts: tokens per expert (E ints >= 0 summing to T); w1 ``[E, 2F, H]`` or E ``[2F, H]``; w2 ``[E, H, F]`` or E
    ``[H, F]``; probs ``[T]`` float32. Returns ``[T, H]`` bf16. ``y.grad_fn.saved_activation_bytes``: bytes saved
    for backward (of the function that ran the experts; under padding the ``grad_fn`` is the un-padding's).

    ``row_align`` (None: the GEMM backend's, :func:`gemm_row_align`; 128 for DeepGEMM): when > 1 every expert's rows are
    padded with zero rows (probability 0) to a multiple of it before the experts and taken back after, so the
    computation is the same bit for bit on the real rows (each output row depends on its own input row only; the
    wgrad's zero rows add zeros); the padding costs a copy of the input and output rows each way. Counts that are
    all multiples of it are taken as they are: the MoE layer's dispatch (``fp4moe.moe.dispatch``) gathers the rows
    straight into that padded layout (BF16 zero rows, or for a dispatched MXFP4 zero codes with zero scale bytes, as
    :func:`_pad_mxfp4` writes them; probability 0) and reads the padded output back through its inverse gather, so
    those copies are only made here where no permutation precedes the experts (EP > 1 with one local expert), for
    MXFP4 rows quantized after permutation 1 (``FP4MOE_DISPATCH_QUANTIZE=rows`` at EP = 1), and for callers that do
    not pad (``pad_in_dispatch = False``, direct calls)."""
    from .all_to_all import DispatchedMXFP4  # local import: all_to_all does not need this module

    weights = function_weights(w1, w2)
    if stacked_weights(weights):  # the expert shapes without unbinding
        (e_num, *m1), (e2, *m2) = weights[0].shape, weights[1].shape
        ok = e_num > 0
    else:
        ws1, ws2 = weight_halves(weights, len(weights) // 2)
        e_num, e2 = len(ws1), len(ws2)
        ok = e_num > 0 and all(w.dim() == 2 for w in (ws1[0], ws2[0]))
        m1, m2 = (list(ws[0].shape) if ws else [] for ws in (ws1, ws2))
    if not ok or e2 != e_num or len(m1) != 2 or len(m2) != 2:
        raise FormatError(f"w1 must be [E, 2F, H] and w2 [E, H, F] (or E matrices each), got {e_num} x {m1} and "
                          f"{e2} x {m2}")
    f2, h = m1
    if f2 % 2 or tuple(m2) != (h, f2 // 2):
        raise FormatError(f"w1 [{e_num}, {f2}, {h}] and w2 [{e_num}, {tuple(m2)}] do not match: need "
                          "[E, 2F, H] and [E, H, F]")
    is_fp4 = isinstance(x, MXFP4Tensor)
    x_hp, x_fp4 = None, None
    x_is_anchor = is_fp4 and recipe.fp8_compute and recipe.expert_input_fp4  # x_hp: the gradient anchor (or None)
    if is_fp4:
        if tuple(x.shape)[1] != h:
            raise FormatError(f"x has {x.shape[1]} channels, w1 expects H={h}")
        anchor = x.grad_anchor if isinstance(x, DispatchedMXFP4) else None
        if recipe.fp8_compute and recipe.expert_input_fp4:
            x_hp, x_fp4 = anchor, (x.mxfp4() if isinstance(x, DispatchedMXFP4) else x)
        else:  # decode (straight-through to the anchor when there is one)
            x_hp = x.dequantize_ste() if anchor is not None else kops.fp4_to_bf16(x)
    else:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != h:
            raise FormatError(f"x must be [T, {h}], got {getattr(x, 'shape', type(x).__name__)}")
        x_hp = x.to(_BF16).contiguous()
        if recipe.fp8_compute and recipe.expert_input_fp4:
            x_fp4 = kops.bf16_to_fp4_row(x_hp.detach(), recipe.scale_rule)
    t = x.shape[0]
    seg = Segments.of(counts, t)
    if seg.num != e_num:
        raise FormatError(f"counts has {seg.num} experts but w1 has {e_num}")
    if probs.shape != (t,):
        raise FormatError(f"probs must be [T] = [{t}], got {tuple(probs.shape)}")
    if recipe.fp8_compute and (h % FP8_GROUP or (f2 // 2) % FP8_GROUP):
        raise FormatError(f"FP8 experts need H ({h}) and F ({f2 // 2}) multiples of {FP8_GROUP}")
    device = (x.data if is_fp4 else x).device
    align = gemm_row_align(device, recipe, row_align)
    probs = probs.float()
    backward = torch.is_grad_enabled()  # a backward can follow (GroupedExpertMLP makes its operands only then)
    if align <= 1 or all(c % align == 0 for c in seg.counts):
        return GroupedExpertMLP.apply(x_hp, probs, x_fp4, recipe, seg, backward, *weights)
    rp = padded_rows(seg, align, device)
    if x_fp4 is not None:
        x_fp4 = _pad_mxfp4(x_fp4, rp)
    if x_hp is not None:
        x_hp = _PadAnchor.apply(x_hp, rp) if x_is_anchor else _RowMap.apply(x_hp, rp.rows, rp.unpad)
    y = GroupedExpertMLP.apply(x_hp, _RowMap.apply(probs, rp.rows, rp.unpad), x_fp4, recipe, rp.padded, backward,
                               *weights)
    return _RowMap.apply(y, rp.unpad, rp.rows)


__all__ = ["Experts", "GroupedExpertMLP", "expert_saved_bytes", "fp8_experts", "function_weights",
           "fuse_wgrad_accumulation", "gemm_backend",
           "grouped_expert_mlp", "RowPadding", "gemm_row_align", "map_rows", "padded_rows", "quantize_experts_128x128",
           "stacked_weights", "weight_halves"]
