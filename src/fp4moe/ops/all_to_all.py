"""Quantized expert-parallel all-to-all: MXFP4 / FP8 / BF16 on the wire, one autograd function (docs/recipe.md).

``quantized_all_to_all`` replaces the dispatch all-to-all of an MoE layer (megatron-core's
``MoEAlltoAllTokenDispatcher.token_dispatch``). Tokens ``x [T, H]`` arrive
already permuted by destination rank; ``input_splits[r]`` rows go to rank r and ``output_splits[r]`` rows
come from rank r. Every row is encoded into one uint8 *payload row* and the payload goes through a single
``torch.distributed.all_to_all_single``:

=========  =========================================================  =================
codec      payload row (uint8)                                        bytes per row
=========  =========================================================  =================
``mxfp4``  MXFP4 data ``[H/2]`` (two E2M1 codes per byte), then the   ``H/2 + H/32``
           UE8M0 scales ``[H/32]`` (= ``MXFP4Tensor.payload()``)
``fp8``    E4M3 data ``[H]``, then the ``H/128`` FP32 power-of-two    ``H + 4*H/128``
           1x128 scales viewed as bytes (native byte order)
``bf16``   the BF16 values viewed as bytes                            ``2*H``
=========  =========================================================  =================

Forward: ``forward_codec`` (``mxfp4`` | ``fp8`` | ``bf16``). The receiver decodes to ``x.dtype``
(bit-exact ``dequantize(quantize(x))`` of the sender's rows), or, with ``keep_fp4=True`` and ``mxfp4``,
keeps the received rows as a :class:`DispatchedMXFP4` (an ``MXFP4Tensor`` plus a gradient anchor, below).

Backward: ``backward_codec`` (``bf16`` | ``fp8``; gradients are never FP4) on the upstream gradient, the
splits swapped, decoded to ``x.dtype``. Every rank of the group must run the backward (it is a collective).

Wire dtype: always ``torch.uint8``. gloo (checked with torch 2.13, CPU): ``all_to_all_single`` takes
uint8, int8, int32, bool, float16, bfloat16 and float32, and rejects int16 and every float8 dtype
("Invalid scalar type"), so FP8 can not travel as float8 there, and int32 views would need padding
(``H/2 + H/32 = 17*H/32`` bytes is not a multiple of 4 for odd H/32). NCCL: torch's ProcessGroupNCCL maps
uint8 (and bool) to ``ncclUint8`` in every version, bfloat16 to ``ncclBfloat16``, float8 to ``ncclUint8``
or ``ncclFloat8e4m3`` (read in the source; the NCCL test of tests/ops/test_all_to_all.py, ``-m gpu``, passes
on 2 H200s). So uint8 rows work on both, with no padding. Empty inputs (``T = 0``) and zero splits work
on gloo.

Pre-quantized rows: ``x`` may instead be a :class:`DispatchedMXFP4` (``forward_codec='mxfp4'``), MXFP4 rows that
were quantized before the caller permuted them (``quantize_gather_rows``: each token quantized once, its k rows
gathered as MXFP4, 4x fewer bytes to move than BF16 rows and k times fewer rows to quantize). MXFP4 is per row, so
these are bit for bit the rows ``bf16_to_fp4_row`` would make of the permuted BF16 rows; what is sent, received,
returned and back-propagated is the same. ``FP4MOE_DISPATCH_QUANTIZE`` (``dispatch_quantize_mode``) picks
``tokens`` (this, the default) or ``rows`` (quantize the permuted rows) in the megatron dispatcher.

Byte accounting: pass ``stats=A2AStats()``; every call adds the payload bytes it handed to and got from
``all_to_all_single`` (forward and backward), see :class:`A2AStats`. ``a2a_payload_bytes`` is the same
number computed from shapes.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from fp4moe_kernels import convert as kops
from fp4moe_kernels import switches
from fp4moe_kernels.constants import FP8_GROUP, MX_BLOCK
from fp4moe_kernels.formats import MXFP4Tensor
from fp4moe_kernels.sizes import payload_row_bytes as _row_bytes

DISPATCH_QUANTIZE_ENV = switches.ENV["dispatch_quantize"]


def dispatch_quantize_mode() -> str:
    """The ``dispatch_quantize`` switch (``fp4moe_kernels.switches``; ``FP4MOE_DISPATCH_QUANTIZE``): ``tokens`` (the
    default) quantizes each token to MXFP4 once and permutes its MXFP4 rows; ``rows`` permutes the BF16 tokens and
    quantizes the ``T*k`` rows (the same bits, more work: kept for side-by-side measurements). ``SwitchError`` (a
    ValueError) naming the values for anything else."""
    return switches.current().dispatch_quantize


FORWARD_CODECS = ("mxfp4", "fp8", "bf16")
BACKWARD_CODECS = ("bf16", "fp8")  # gradients are never FP4 (docs/recipe.md)
_INPUT_DTYPES = (torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------------ accounting


def _check_hidden(hidden: int, codec: str, what: str = "codec") -> None:
    if codec not in FORWARD_CODECS:
        raise ValueError(f"{what} {codec!r} is not one of {FORWARD_CODECS}")
    need = {"mxfp4": MX_BLOCK, "fp8": FP8_GROUP, "bf16": 1}[codec]
    if hidden <= 0 or hidden % need != 0:
        raise ValueError(
            f"{what} {codec!r} needs the hidden size to be a positive multiple of {need}, got {hidden}: "
            f"pad the hidden dim or use another codec"
        )


def payload_row_bytes(hidden: int, codec: str) -> int:
    """Bytes of one payload row of ``hidden`` channels: mxfp4 ``H/2 + H/32``, fp8 ``H + 4*H/128``, bf16 ``2*H``."""
    _check_hidden(hidden, codec)
    return _row_bytes(hidden, codec)


def a2a_payload_bytes(rows: int, hidden: int, codec: str) -> int:
    """Bytes on the wire for ``rows`` tokens of ``hidden`` channels in ``codec`` (no padding, no headers).

    mxfp4: ``rows*(H/2 + H/32)``; fp8: ``rows*(H + 4*H/128)``; bf16: ``rows*2*H``. At H = 7168 one token is
    3808 / 7392 / 14336 bytes."""
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    return rows * payload_row_bytes(hidden, codec)


@dataclass
class A2AStats:
    """Payload bytes that ``quantized_all_to_all`` exchanged on this rank, summed over calls.

    ``*_sent_bytes``: the whole payload handed to ``all_to_all_single`` (all destinations, the rows this
    rank keeps for itself included, = ``a2a_payload_bytes(T, H, codec)``); ``*_sent_remote_bytes``: the part
    that leaves this rank (rows for other ranks); ``*_received_bytes``: the payload it got back (all
    sources). ``forward_*`` is the forward codec, ``backward_*`` the backward codec (splits swapped)."""

    forward_calls: int = 0
    forward_sent_bytes: int = 0
    forward_sent_remote_bytes: int = 0
    forward_received_bytes: int = 0
    backward_calls: int = 0
    backward_sent_bytes: int = 0
    backward_sent_remote_bytes: int = 0
    backward_received_bytes: int = 0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _record(self, direction: str, sent: torch.Tensor, kept_rows: int, received: torch.Tensor) -> None:
        row = sent.shape[1]
        setattr(self, f"{direction}_calls", getattr(self, f"{direction}_calls") + 1)
        setattr(self, f"{direction}_sent_bytes", getattr(self, f"{direction}_sent_bytes") + sent.numel())
        setattr(
            self,
            f"{direction}_sent_remote_bytes",
            getattr(self, f"{direction}_sent_remote_bytes") + (sent.shape[0] - kept_rows) * row,
        )
        setattr(self, f"{direction}_received_bytes", getattr(self, f"{direction}_received_bytes") + received.numel())


# ------------------------------------------------------------------------------------------ the codecs


def _encode(x: torch.Tensor, codec: str, rule: str) -> torch.Tensor:
    """``x [T, H]`` (bf16/fp32, contiguous) -> uint8 payload ``[T, payload_row_bytes(H, codec)]``."""
    if codec == "mxfp4":
        return kops.bf16_to_fp4_row(x, rule).payload()
    if codec == "fp8":
        t, h = x.shape
        f = kops.bf16_to_fp8_row(x)  # one segment: scales are the plain [H/128, T] buffer
        scales_tg = f.scales.view(h // FP8_GROUP, t).t().contiguous()  # [T, H/128] float32
        return torch.cat([f.data.view(torch.uint8), scales_tg.view(torch.uint8)], dim=1)
    return x.to(torch.bfloat16).contiguous().view(torch.uint8)


def _fp8_payload_to(payload: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """FP8 payload ``[T, H + 4*H/128]`` -> ``[T, H]`` in ``dtype``. Exact: an E4M3 value times a power of two
    in [2^-126, 2^127] is exact in float32; the cast to bf16 rounds once (like the float64 reference)."""
    t = payload.shape[0]
    g = hidden // FP8_GROUP
    data = payload[:, :hidden].contiguous().view(torch.float8_e4m3fn)
    scales = payload[:, hidden:].contiguous().view(torch.float32)  # [T, H/128]
    out = data.to(torch.float32).view(t, g, FP8_GROUP) * scales.unsqueeze(-1)
    return out.view(t, hidden).to(dtype)


def _decode(payload: torch.Tensor, hidden: int, codec: str, dtype: torch.dtype) -> torch.Tensor:
    """uint8 payload ``[T, payload_row_bytes(H, codec)]`` -> ``[T, H]`` in ``dtype``."""
    if codec == "mxfp4":
        return kops.fp4_to_bf16(MXFP4Tensor.from_payload(payload, hidden)).to(dtype)
    if codec == "fp8":
        return _fp8_payload_to(payload, hidden, dtype)
    return payload.view(torch.bfloat16).to(dtype)


# ------------------------------------------------------------------------------------ splits and comms


def _world(group) -> tuple[int, int]:
    """(size, rank) of ``group``; (1, 0) when torch.distributed is not initialised and no group is given."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group), dist.get_rank(group)
    if group is not None:
        raise RuntimeError("a process group was given but torch.distributed is not initialised: call init_process_group first")
    return 1, 0


def _as_splits(splits, name: str, world: int) -> list[int]:
    """A sequence of ints (or a 1-D integer tensor / array) with one entry per rank -> list[int]."""
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1 or splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got shape {tuple(splits.shape)} dtype {splits.dtype}")
        splits = splits.tolist()  # a device tensor costs one host synchronisation
    elif hasattr(splits, "tolist") and not isinstance(splits, (list, tuple)):  # numpy arrays
        splits = splits.tolist()
    if not isinstance(splits, Sequence) or isinstance(splits, (str, bytes)):
        raise ValueError(f"{name} must be a list of ints (rows per rank), got {type(splits).__name__}")
    out = []
    for i, s in enumerate(splits):
        try:
            if isinstance(s, bool) or isinstance(s, float):
                raise TypeError
            v = operator.index(s)  # int, numpy integer, 0-d integer tensor; not float, not bool
        except TypeError:
            raise ValueError(f"{name}[{i}] = {s!r} is not an int: pass row counts as Python ints") from None
        if v < 0:
            raise ValueError(f"{name}[{i}] = {v} is negative: row counts must be >= 0")
        out.append(v)
    if len(out) != world:
        raise ValueError(
            f"{name} has {len(out)} entries but the process group has {world} ranks: pass one row count per "
            f"rank of the expert-parallel group"
        )
    return out


def _check_output_splits(input_splits: list[int], output_splits: list[int], group, device) -> None:
    """Debug check (one small all-to-all + all-reduce): what each peer sends us equals ``output_splits``.
    All ranks raise together, so none is left waiting in the data all-to-all."""
    world, rank = _world(group)
    sent = torch.tensor(input_splits, dtype=torch.int64, device=device)
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent, group=group)
    bad = torch.tensor([0 if got.tolist() == output_splits else 1], dtype=torch.int64, device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bad.item():
        raise ValueError(
            f"output_splits do not match what the peers send: rank {rank} has output_splits={output_splits} "
            f"but receives {got.tolist()} (input_splits of each sender, entry {rank}; some rank's splits are "
            f"inconsistent): output_splits[r] must equal input_splits[{rank}] on rank r, e.g. obtained by an "
            "all-to-all of the input splits"
        )


def _exchange(payload: torch.Tensor, send_splits: list[int], recv_splits: list[int], group, world: int) -> torch.Tensor:
    """One ``all_to_all_single`` of uint8 rows (``send_splits[r]`` rows to rank r). World size 1: identity."""
    if world == 1:
        return payload
    out = payload.new_empty((sum(recv_splits), payload.shape[1]))
    dist.all_to_all_single(out, payload.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    return out


# ------------------------------------------------------------------------------------ autograd function


def _record_kept_mxfp4(stats: Optional[A2AStats], rows: int, h: int, kept_rows: int) -> None:
    """World size 1, MXFP4 forward: nothing is exchanged (the quantizer's rows are kept as they are), but the
    payload bytes are counted as sent and received, as an exchange would count them."""
    if stats is not None:
        sent = torch.empty((rows, payload_row_bytes(h, "mxfp4")), dtype=torch.uint8, device="meta")
        stats._record("forward", sent, kept_rows, sent)


def _exchange_gradient(g: torch.Tensor, meta: tuple) -> torch.Tensor:
    """The backward of a dispatch: the received rows' gradient ``g`` encoded with the backward codec, sent back with
    the splits swapped, decoded to the sender's dtype. ``meta`` = (input_splits, output_splits, group, world, rank,
    backward codec, stats, dtype, H) of the forward."""
    input_splits, output_splits, group, world, rank, bwd_codec, stats, dtype, h = meta
    payload = _encode(g.contiguous(), bwd_codec, "ceil")
    recv = _exchange(payload, output_splits, input_splits, group, world)
    if stats is not None:
        stats._record("backward", payload, output_splits[rank], recv)
    return _decode(recv, h, bwd_codec, dtype)


def gather_sum_fused(g: torch.Tensor) -> bool:
    """Whether :func:`sum_rows_by_token` runs as one Triton kernel for ``g`` (``fp4moe_kernels.triton_kernels.permute``):
    the ``gather_sum`` switch says triton and g is a CUDA bfloat16 tensor."""
    return g.is_cuda and g.dtype == torch.bfloat16 and switches.current().gather_sum == "triton"


def sum_rows_by_token(g: torch.Tensor, order: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """``[T, H]``: the k rows of each token of ``g [T*k, H]`` summed in float32 and rounded once to ``g.dtype``;
    ``order`` (a permutation of ``range(T*k)``, or of the rows of a padded layout) lists the rows grouped by token.
    A gather and a reduction, no atomics: the gradient of a top-k token permutation. Under ``gather_sum_fused`` one
    kernel reads each row once (summed in row order: torch's CPU order; its CUDA reduction may add them in another,
    so within one BF16 unit)."""
    if gather_sum_fused(g):
        from fp4moe_kernels.triton_kernels.permute import gather_sum_rows

        return gather_sum_rows(g.contiguous(), order, t, k)
    return g.index_select(0, order).view(t, k, g.shape[1]).sum(1, dtype=torch.float32).to(g.dtype)


class _QuantizedAllToAll(torch.autograd.Function):
    """Forward: encode(forward_codec) -> all_to_all_single -> decode (or keep MXFP4).
    Backward: encode(backward_codec) of the gradient -> all_to_all_single with swapped splits -> decode.

    Outputs: the decoded ``[T_out, H]`` tensor, or with keep_fp4 ``(data, scales, grad_anchor)`` where
    data/scales are non-differentiable uint8 and grad_anchor is a differentiable zero ``[T_out, H]`` that
    takes the gradient w.r.t. the dequantized received values (straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, input_splits, output_splits, group, world, rank, fwd_codec, bwd_codec, keep_fp4, stats, rule):
        t, h = x.shape
        ctx.meta = (input_splits, output_splits, group, world, rank, bwd_codec, stats, x.dtype, h)
        if world == 1 and fwd_codec == "mxfp4":
            # nothing to exchange: keep the quantizer's data and scales as they are (packing them into one
            # payload and splitting it again would be two copies of the rows); the bytes are counted as sent
            fp4 = kops.bf16_to_fp4_row(x.contiguous(), rule)
            _record_kept_mxfp4(stats, t, h, input_splits[rank])
            if not keep_fp4:
                return kops.fp4_to_bf16(fp4).to(x.dtype)
        else:
            payload = _encode(x.contiguous(), fwd_codec, rule)
            # world size 1 with the bf16 codec: recv is a view of x and so is the output, no copy of the rows (the
            # docstring of quantized_all_to_all says what that asks of callers)
            recv = _exchange(payload, input_splits, output_splits, group, world)
            if stats is not None:
                stats._record("forward", payload, input_splits[rank], recv)
            if not keep_fp4:
                return _decode(recv, h, fwd_codec, x.dtype)
            fp4 = MXFP4Tensor.from_payload(recv, h)
        # 2 bytes whatever T_out: a stride-0 view; only its gradient matters.
        anchor = torch.zeros((), dtype=x.dtype, device=x.device).expand(fp4.shape[0], h)
        ctx.mark_non_differentiable(fp4.data, fp4.scales)
        return fp4.data, fp4.scales, anchor

    @staticmethod
    def backward(ctx, *grads):
        # of the decoded output, or of the anchor (keep_fp4); never None (materialize_grads)
        return _exchange_gradient(grads[-1], ctx.meta), None, None, None, None, None, None, None, None, None, None


@dataclass(frozen=True)
class DispatchedMXFP4(MXFP4Tensor):
    """Received MXFP4 rows (``data [T_out, H/2]``, ``scales [T_out, H/32]`` uint8, an ``MXFP4Tensor``, so every
    ``fp4moe_kernels.convert`` conversion takes it) plus ``grad_anchor``: a differentiable ``[T_out, H]`` zero
    tensor (stride 0, 2 bytes) that connects these values to the sender's ``x`` in autograd.

    Straight-through estimator. Let ``x_hat = dequantize(data, scales)`` be the values the receiver computes
    with. The consumer must route ``dL/dx_hat`` into ``grad_anchor``: either use :meth:`dequantize_ste`
    (returns ``x_hat`` as a tensor whose gradient goes to the anchor), or take ``grad_anchor`` as an input of
    its own autograd function and return ``dL/dx_hat`` ``[T_out, H]`` as its gradient. The all-to-all's
    backward then computes, exactly as with ``keep_fp4=False``::

        dL/dx = decode_bwd(all_to_all(encode_bwd(dL/dx_hat), splits swapped))

    i.e. quantization is treated as the identity (d x_hat / d x := I) and the gradient is only rounded by the
    backward codec (bf16: none for a bf16 gradient; fp8: E4M3 with 1x128 power-of-two scales). If nothing
    uses the anchor, ``x`` gets no gradient from this dispatch (and the backward all-to-all does not run on
    this rank, which stalls the peers that do run it)."""

    grad_anchor: Optional[torch.Tensor] = None

    def mxfp4(self) -> MXFP4Tensor:
        """The plain ``MXFP4Tensor`` (no autograd link)."""
        return MXFP4Tensor(self.data, self.scales, self.shape)

    def dequantize_ste(self) -> torch.Tensor:
        """``x_hat`` ``[T_out, H]`` in the anchor's dtype (bit-exact ``fp4_to_bf16``), differentiable: its
        gradient flows to ``grad_anchor`` unchanged (straight-through)."""
        return _DequantizeSTE.apply(self.grad_anchor, self.mxfp4())


class _DequantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, fp4):
        return kops.fp4_to_bf16(fp4).to(anchor.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


# ------------------------------------------------------------------------------------------- public API


class _PermuteAnchor(torch.autograd.Function):
    """A fresh stride-0 zero anchor ``[rows, H]`` for MXFP4 rows reordered by a row map; its gradient goes back to the
    old row order (the anchor carries dL/d(dequantized rows), see DispatchedMXFP4) as a gather ``g[back]``: one read
    and one write per element, no zero fill, no scatter (an H200 profile measured the scatter at 2 % of an mxfp4
    step). For a permutation ``perm``: ``rows = len(perm)``, ``index = perm`` and ``invert`` (``back``: its inverse,
    made in the backward); for a permutation into a padded layout (``fp4moe.moe.dispatch.reorder_rows(..., pad=)``):
    ``rows`` the padded rows, ``index = back``, the padded position of each old row (the padding rows' gradients are
    not read)."""

    @staticmethod
    def forward(ctx, anchor, rows: int, index, invert: bool):
        ctx.save_for_backward(index)
        ctx.invert = invert
        return torch.zeros((), dtype=anchor.dtype, device=anchor.device).expand(rows, anchor.shape[1])

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        return g.index_select(0, inverse_permutation(index) if ctx.invert else index), None, None, None


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm] = arange``, on ``perm``'s device."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), dtype=perm.dtype, device=perm.device)
    return inv


def _zero_rows(t: torch.Tensor, pad: Optional[torch.Tensor]) -> torch.Tensor:
    """``t`` with the rows ``pad`` (None or empty: none) set to 0, in place: MXFP4 padding rows, zero codes and zero
    scale bytes, as ``fp4moe.ops.grouped_experts.RowPadding.rows`` writes them."""
    return t if pad is None or pad.numel() == 0 else t.index_fill_(0, pad, 0)


class _QuantizeGather(torch.autograd.Function):
    """MXFP4 rows of ``x[index]`` made from ``x`` quantized once per row (module docstring, "Pre-quantized rows"),
    the rows ``pad`` (if any) zero codes with zero scale bytes. Backward (the anchor carries dL/d(dequantized rows)
    ``[N, H]``): with ``order``/``k`` (every row of ``x`` gathered exactly k times, ``index[order]`` grouped by row,
    the padding rows not listed), each row's k gradients gathered through ``order`` and summed in float32, rounded
    once; without, autograd's gradient of ``x[index]`` (``index_put_`` with accumulate)."""

    @staticmethod
    def forward(ctx, x, index, order, k, rule, pad=None):
        fp4 = kops.bf16_to_fp4_row(x.contiguous(), rule)
        data, scales = (_zero_rows(t.index_select(0, index), pad) for t in (fp4.data, fp4.scales))
        ctx.save_for_backward(index if order is None else order)
        ctx.k, ctx.shape, ctx.by_order = k, tuple(x.shape), order is not None
        ctx.mark_non_differentiable(data, scales)
        anchor = torch.zeros((), dtype=x.dtype, device=x.device).expand(index.numel(), x.shape[1])
        return data, scales, anchor

    @staticmethod
    def backward(ctx, _gd, _gs, g):
        (ix,) = ctx.saved_tensors
        t, h = ctx.shape
        if ctx.by_order:
            gx = sum_rows_by_token(g, ix, t, ctx.k)
        else:
            gx = torch.zeros((t, h), dtype=g.dtype, device=g.device).index_put_((ix,), g, accumulate=True)
        return gx, None, None, None, None, None


def quantize_gather_rows(x: torch.Tensor, index: torch.Tensor, rule: str = "ceil", *,
                         order: Optional[torch.Tensor] = None, k: Optional[int] = None,
                         pad: Optional[torch.Tensor] = None) -> "DispatchedMXFP4":
    """``DispatchedMXFP4`` rows ``[N, H]`` = MXFP4 of ``x[index]`` (``x [T, H]`` bf16 or float32, ``index [N]``
    int64), quantized as ``T`` rows and gathered as MXFP4: bit for bit ``bf16_to_fp4_row(x[index], rule)``. Its
    anchor takes dL/d(dequantized rows) back to ``x`` (summed per row of x); pass ``order`` (a permutation of
    ``range(N)`` grouping ``index`` by row) and ``k`` when every row of x appears exactly ``k`` times (``N = k*T``)
    for an atomics-free sum in float32. Feed the result to ``quantized_all_to_all(..., forward_codec='mxfp4')``.

    ``pad`` (int64 ``[P]``, with ``order``/``k``): rows of the result that are padding for the expert GEMMs
    (``fp4moe.moe.dispatch.TokenPermutation.padded``): zero codes and zero scale bytes, as the experts' own padding
    (``grouped_experts.RowPadding.rows``) writes them; ``index`` has any row of x there, ``N = k*T + P`` and
    ``order`` lists the ``k*T`` real rows grouped by row of x (the padding rows' gradients are not read)."""
    if x.dim() != 2 or x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"x must be [T, H] bfloat16 or float32, got {x.dtype} {tuple(x.shape)}")
    _check_hidden(x.shape[1], "mxfp4", "quantize_gather_rows")
    npad = 0 if pad is None else pad.numel()
    if pad is not None and order is None:
        raise ValueError("pad needs order and k (the real rows grouped by row of x)")
    if order is not None and (k is None or k * x.shape[0] != order.numel() or order.numel() + npad != index.numel()):
        raise ValueError(f"order needs k with k * T = len(order) = len(index) - len(pad): k={k}, T={x.shape[0]}, "
                         f"len(order)={order.numel()}, len(index)={index.numel()}, len(pad)={npad}")
    data, scales, anchor = _QuantizeGather.apply(x, index, order, k, rule, pad)
    return DispatchedMXFP4(data, scales, (index.numel(), x.shape[1]), anchor if x.requires_grad else None)


class _GradientAllToAll(torch.autograd.Function):
    """The gradient path of a pre-quantized dispatch: forward maps the sender's anchor ``[T, H]`` to a fresh
    stride-0 anchor ``[rows_out, H]`` (the rows themselves travel outside autograd); backward is the all-to-all of
    the received rows' gradient with ``backward_codec``, the splits swapped, as ``_QuantizedAllToAll.backward``."""

    @staticmethod
    def forward(ctx, anchor, rows_out, input_splits, output_splits, group, world, rank, bwd_codec, stats):
        ctx.meta = (input_splits, output_splits, group, world, rank, bwd_codec, stats, anchor.dtype, anchor.shape[1])
        return torch.zeros((), dtype=anchor.dtype, device=anchor.device).expand(rows_out, anchor.shape[1])

    @staticmethod
    def backward(ctx, g):
        return _exchange_gradient(g, ctx.meta), None, None, None, None, None, None, None, None


def _prequantized_all_to_all(x: "DispatchedMXFP4", ins, outs, group, world, rank, bwd_codec, keep_fp4, stats):
    """``quantized_all_to_all`` of MXFP4 rows quantized before the caller permuted them (same bytes, same result)."""
    t, h = x.shape
    if world == 1:
        recv = x.mxfp4()  # nothing to exchange: the rows as they are
        _record_kept_mxfp4(stats, t, h, ins[rank])
    else:
        payload = x.mxfp4().payload()
        got = _exchange(payload, ins, outs, group, world)
        if stats is not None:
            stats._record("forward", payload, ins[rank], got)
        recv = MXFP4Tensor.from_payload(got, h)
    anchor = None
    if x.grad_anchor is not None:
        anchor = _GradientAllToAll.apply(x.grad_anchor, recv.shape[0], ins, outs, group, world, rank, bwd_codec, stats)
    out = DispatchedMXFP4(recv.data, recv.scales, recv.shape, anchor)
    if keep_fp4:
        return out
    return out.dequantize_ste() if anchor is not None else kops.fp4_to_bf16(recv)


def permute_rows(x, perm: torch.Tensor, *, pad: Optional[torch.Tensor] = None, back: Optional[torch.Tensor] = None):
    """Rows ``x[perm]`` of a tensor ``[T, H]`` or of a ``DispatchedMXFP4`` (data/scales gathered, gradient anchor
    re-made so that the gradient still reaches the sender's rows). perm: a permutation of ``range(T)``, int64 on
    x's device.

    Into a padded layout (``DispatchedMXFP4`` only; ``fp4moe.moe.dispatch.reorder_rows(..., pad=)``): ``perm`` the
    gather index ``[Tp]`` (any row on the padding), ``pad`` the padding rows (zero codes and zero scale bytes, as
    ``grouped_experts.RowPadding.rows`` writes them) and ``back`` ``[T]`` the padded position of each row of x:
    the anchor's gradient is ``g[back]``, the padding rows' gradients are not read."""
    if isinstance(x, DispatchedMXFP4):
        if (back is not None and pad is None) or (pad is not None and back is None and x.grad_anchor is not None):
            raise ValueError("permute_rows into a padded layout needs pad and back (each row's padded position)")
        anchor = None
        if x.grad_anchor is not None:
            anchor = _PermuteAnchor.apply(x.grad_anchor, perm.numel(), perm if back is None else back, back is None)
        return DispatchedMXFP4(_zero_rows(x.data.index_select(0, perm), pad),
                               _zero_rows(x.scales.index_select(0, perm), pad), (perm.numel(), x.shape[1]), anchor)
    if pad is not None or back is not None:
        raise ValueError("permute_rows pads the rows of a DispatchedMXFP4 only (fp4moe.moe.dispatch.reorder_rows "
                         "pads tensors)")
    return x.index_select(0, perm)


def quantized_all_to_all(
    x: torch.Tensor,
    input_splits,
    output_splits,
    group: Optional[dist.ProcessGroup] = None,
    forward_codec: str = "mxfp4",
    backward_codec: str = "bf16",
    *,
    keep_fp4: bool = False,
    stats: Optional[A2AStats] = None,
    rule: str = "ceil",
    check_splits: bool = False,
):
    """Expert-parallel all-to-all of tokens with a quantized payload; differentiable.

    x              ``[T, H]`` bfloat16 (float32 accepted), rows permuted by destination rank (rank 0's rows
                   first); ``T = 0`` is allowed. Or a ``DispatchedMXFP4`` of such rows already quantized
                   (``quantize_gather_rows``; forward_codec ``'mxfp4'``; the ``rule`` it was made with applies).
    input_splits   rows of ``x`` for each rank of ``group`` (ints >= 0, one per rank, summing to T).
    output_splits  rows this rank receives from each rank (= ``input_splits[this rank]`` on that rank).
    group          the expert-parallel process group (None: the default group; without an initialised
                   torch.distributed, world size 1 and the exchange is the identity, quantization included).
    forward_codec  ``'mxfp4'`` (H % 32 == 0), ``'fp8'`` (H % 128 == 0) or ``'bf16'`` (see the module table).
    backward_codec ``'bf16'`` or ``'fp8'`` (H % 128 == 0) for the gradient all-to-all.
    keep_fp4       mxfp4 only: return the received rows as :class:`DispatchedMXFP4` instead of decoding them
                   (its docstring says exactly what the backward computes).
    stats          an :class:`A2AStats` the forward and the backward add their payload bytes to.
    rule           MXFP4 scale rule (``'ceil'`` default, ``'floor'``), see ``fp4moe_kernels.convert``.
    check_splits   debug: verify with one extra small all-to-all that ``output_splits`` match the peers'
                   ``input_splits`` (all ranks raise together on a mismatch).

    Returns ``[sum(output_splits), H]`` in ``x.dtype``: bit-exact ``dequantize(quantize(rows))`` of the
    senders' rows (``fp4_to_bf16(bf16_to_fp4_row(.))`` for mxfp4; the BF16 cast for bf16), or a
    ``DispatchedMXFP4`` with ``keep_fp4``. Backward: the upstream gradient encoded with ``backward_codec``,
    sent back with the splits swapped, decoded to ``x.dtype``. At world size 1 with the bf16 codec and BF16 x the
    result is a view of x (nothing is exchanged and nothing copied: a copy took 2.83-2.84 ms per [1.05M, 2048] call
    on an H100, two per MoE layer forward); the two share a version counter, so autograd catches a tensor it saved
    being changed in place through either.
    """
    pre = isinstance(x, DispatchedMXFP4)
    if pre:
        if forward_codec != "mxfp4":
            raise ValueError(f"x holds MXFP4 rows: forward_codec must be 'mxfp4', got {forward_codec!r}")
    elif not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(
            f"x must be a 2-D tensor [tokens, hidden], got {type(x).__name__} "
            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else ''}: reshape it to [T, H]"
        )
    elif x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; expected bfloat16 or float32: cast it with .to(torch.bfloat16)")
    h = x.shape[1]
    _check_hidden(h, forward_codec, "forward_codec")
    if backward_codec not in BACKWARD_CODECS:
        raise ValueError(
            f"backward_codec {backward_codec!r} is not one of {BACKWARD_CODECS} (gradients are never sent in FP4)"
        )
    _check_hidden(h, backward_codec, "backward_codec")
    if keep_fp4 and forward_codec != "mxfp4":
        raise ValueError(f"keep_fp4=True needs forward_codec='mxfp4', got {forward_codec!r}: drop keep_fp4 or use mxfp4")
    world, rank = _world(group)
    ins = _as_splits(input_splits, "input_splits", world)
    outs = _as_splits(output_splits, "output_splits", world)
    if sum(ins) != x.shape[0]:
        raise ValueError(
            f"input_splits {ins} sum to {sum(ins)} but x has {x.shape[0]} rows: input_splits[r] must be the "
            f"number of rows of x sent to rank r, summing to x.shape[0] (recompute them from the router's "
            f"per-expert counts summed over each rank's experts, after dropping/padding)"
        )
    if world == 1 and outs != ins:
        raise ValueError(f"world size 1: output_splits {outs} must equal input_splits {ins}")
    if check_splits and world > 1:
        _check_output_splits(ins, outs, group, x.data.device)
    if pre:
        return _prequantized_all_to_all(x, ins, outs, group, world, rank, backward_codec, keep_fp4, stats)
    out = _QuantizedAllToAll.apply(x, ins, outs, group, world, rank, forward_codec, backward_codec, keep_fp4, stats, rule)
    if not keep_fp4:
        return out
    data, scales, anchor = out
    return DispatchedMXFP4(data, scales, (data.shape[0], h), anchor)


__all__ = [
    "A2AStats",
    "inverse_permutation",
    "BACKWARD_CODECS",
    "DispatchedMXFP4",
    "FORWARD_CODECS",
    "DISPATCH_QUANTIZE_ENV",
    "a2a_payload_bytes",
    "dispatch_quantize_mode",
    "payload_row_bytes",
    "permute_rows",
    "quantize_gather_rows",
    "quantized_all_to_all",
    "sum_rows_by_token",
]
