"""Typed containers for the quantized formats and the ragged segment description.

Layouts (M tokens, K channels, E segments = experts):

``MXFP4Tensor``
    data    ``[M, K/2]`` uint8: element 2j in the low nibble, 2j+1 in the high nibble; nibble bit 3 = sign,
            bits 2..0 = E2M1 magnitude code (values 0, 0.5, 1, 1.5, 2, 3, 4, 6).
    scales  ``[M, K/32]`` uint8 UE8M0: code c scales its 32 elements by 2**(c-127); 255 = NaN block.

``FP8RowTensor`` (activations, BlockWise1x128 for ``F.scaled_mm``)
    data    ``[M, K]`` float8_e4m3fn.
    scales  ``[M*K/128]`` float32, *segment-major*: segment e (rows r0..r1 of length m) owns
            ``scales[(K/128)*r0 : (K/128)*r1]`` laid out ``[K/128, m]``. Its transpose ``[m, K/128]`` with
            strides ``(1, m)`` is exactly the M-major scale tensor ``F.scaled_mm`` wants for that segment.
            With one segment this is the plain ``[K/128, M]`` buffer. Values: x ~= data * scale.

``FP8ColTensor`` (the transposed copy used by wgrad)
    data    flat float8_e4m3fn of length ``K * Mp`` where ``Mp = sum(ceil(m_e/128)*128)``. Segment e owns
            ``data[K*P_e : K*(P_e+Mp_e)]`` viewed ``[K, Mp_e]`` (row-major, tokens contiguous), P_e its
            padded token offset. Token columns past m_e are zero.
    scales  ``[Mp/128, K]`` float32; segment e owns rows ``P_e/128 .. (P_e+Mp_e)/128``; that slice,
            transposed, is the ``[K, Mp_e/128]`` BlockWise1x128 scale of ``F.scaled_mm`` (strides (1, K)).

All scales are powers of two. Ragged inputs are described by ``Segments`` (per-expert token counts,
any count including 0, summing to M; rows of one segment are contiguous and segments are in order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

try:  # numpy is optional: only used to accept numpy integer counts
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

from .constants import COL_SEGMENT_ALIGN, FP8_GROUP, MX_BLOCK


class FormatError(ValueError):
    """Raised for a tensor that does not have the layout, dtype or shape a conversion needs."""


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def _count_as_int(c, index: int) -> int:
    """One element of a counts sequence -> int. Only integers are accepted (Python ``int``, numpy integer
    scalars, 0-d integer tensors); floats (even integral ones such as 2.0), bools and strings are rejected
    rather than silently truncated by ``int()``."""
    if isinstance(c, bool) or (_np is not None and isinstance(c, _np.bool_)):
        ok = False
    elif isinstance(c, int) or (_np is not None and isinstance(c, _np.integer)):
        ok = True
    elif isinstance(c, torch.Tensor):
        ok = c.dim() == 0 and not (c.dtype.is_floating_point or c.dtype.is_complex or c.dtype == torch.bool)
    else:
        ok = False
    if not ok:
        raise FormatError(
            f"counts must be integers (Python int, numpy integer or a 1-D integer tensor), got {c!r:.40} "
            f"({type(c).__name__}) at index {index}; floats are rejected even when integral (2.0): "
            "convert them with int(...) yourself"
        )
    return int(c)


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``. A host tensor goes to a CUDA device through pinned memory with a non-blocking copy, so the
    copy is queued on the stream like a kernel (a copy from pageable memory first waits for the stream to drain,
    leaving the GPU idle while the host prepares what comes next). For the small index tables the kernels and the
    dispatcher build on the host (segment offsets, tile lists, chunk sizes)."""
    if torch.device(device).type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(frozen=True)
class Segments:
    """Per-expert token counts (host ints) and their derived offsets.

    counts          tokens per segment, each >= 0
    offsets         row start of each segment, length E+1 (offsets[-1] = M)
    padded_counts   counts rounded up to 128 (column layout)
    padded_offsets  prefix sums of padded_counts, length E+1
    """

    counts: tuple[int, ...]

    def __post_init__(self):
        if len(self.counts) == 0:
            raise FormatError("counts is empty: pass at least one segment (or counts=None for one segment)")
        if any((not isinstance(c, int)) or isinstance(c, bool) or c < 0 for c in self.counts):
            raise FormatError(f"counts must be non-negative ints, got {list(self.counts)[:8]}...")

    @staticmethod
    def of(counts, total_rows: int) -> "Segments":
        """Build from ``None`` (one segment of ``total_rows``), a sequence of ints (Python ``int`` or numpy
        integer scalars), a 1-D integer numpy array or a 1-D integer tensor.

        Anything else is a ``FormatError``: floats (even integral ones such as ``2.0``), bools, strings.
        A device tensor is copied to the host once (one synchronisation)."""
        if counts is None:
            return Segments((int(total_rows),))
        if isinstance(counts, Segments):
            seg = counts
        elif isinstance(counts, torch.Tensor):
            if (
                counts.dim() != 1
                or counts.dtype.is_floating_point
                or counts.dtype.is_complex
                or counts.dtype == torch.bool
            ):
                raise FormatError(
                    f"counts must be a 1-D integer tensor, got shape {tuple(counts.shape)} dtype {counts.dtype}"
                )
            seg = Segments(tuple(int(c) for c in counts.tolist()))
        elif _np is not None and isinstance(counts, _np.ndarray):
            if counts.ndim != 1 or counts.dtype.kind not in "iu":
                raise FormatError(
                    f"counts must be a 1-D integer array, got shape {counts.shape} dtype {counts.dtype}: "
                    "counts must be integers"
                )
            seg = Segments(tuple(int(c) for c in counts.tolist()))
        elif isinstance(counts, Sequence) and not isinstance(counts, (str, bytes, bytearray)):
            seg = Segments(tuple(_count_as_int(c, i) for i, c in enumerate(counts)))
        else:
            raise FormatError(
                f"counts must be None, a sequence of ints or a 1-D int tensor, got {type(counts).__name__} {counts!r:.60}"
            )
        if seg.total != total_rows:
            raise FormatError(
                f"counts sum to {seg.total} but the tensor has {total_rows} rows: counts must cover every row"
            )
        return seg

    @property
    def num(self) -> int:
        return len(self.counts)

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def offsets(self) -> tuple[int, ...]:
        out = [0]
        for c in self.counts:
            out.append(out[-1] + c)
        return tuple(out)

    @property
    def padded_counts(self) -> tuple[int, ...]:
        return tuple(_ceil_to(c, COL_SEGMENT_ALIGN) for c in self.counts)

    @property
    def padded_offsets(self) -> tuple[int, ...]:
        out = [0]
        for c in self.padded_counts:
            out.append(out[-1] + c)
        return tuple(out)

    @property
    def padded_total(self) -> int:
        return sum(self.padded_counts)

    def row_segments(self, device) -> torch.Tensor:
        """int32 ``[M]``: each row's segment (0 .. E-1; an empty segment owns no row), expanded on ``device`` from
        the E counts (one queued copy of E ints, no M-long host tensor). The FP8 row kernels' ``row_seg`` and
        DeepGEMM's ``m_indices``."""
        counts = host_to_device(torch.tensor(self.counts, dtype=torch.int64), device)
        return torch.repeat_interleave(torch.arange(self.num, dtype=torch.int32, device=device), counts,
                                       output_size=self.total)


def check_2d(x: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...], k_multiple: int) -> None:
    """Validate a [M, K] input: 2-D, one of ``dtypes``, contiguous, K a multiple of ``k_multiple``."""
    if not isinstance(x, torch.Tensor):
        raise FormatError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise FormatError(f"{name} must be 2-D [tokens, channels], got shape {tuple(x.shape)}: reshape it to 2-D")
    if x.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise FormatError(f"{name} has dtype {x.dtype}; expected one of {names}: cast it with .to(...)")
    if x.shape[1] % k_multiple != 0:
        raise FormatError(
            f"{name} has {x.shape[1]} channels; it must be a multiple of {k_multiple}: pad the channel dim"
        )
    if not x.is_contiguous():
        raise FormatError(f"{name} is not contiguous (strides {x.stride()}): call .contiguous() first")


def _check_pair(data: torch.Tensor, scales: torch.Tensor, what: str) -> None:
    """data and scales of one quantized tensor: contiguous and on one device."""
    if data.device != scales.device:
        raise FormatError(f"{what} data is on {data.device} but its scales on {scales.device}: move both to one device")
    if not (data.is_contiguous() and scales.is_contiguous()):
        raise FormatError(f"{what} data and scales must be contiguous: call .contiguous() on them")


@dataclass(frozen=True)
class MXFP4Tensor:
    """MXFP4 rows: ``data [M, K/2] uint8`` (two E2M1 codes per byte), ``scales [M, K/32] uint8`` (UE8M0)."""

    data: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self):
        m, k = self.shape
        if k % MX_BLOCK != 0:
            raise FormatError(f"MXFP4 needs K a multiple of {MX_BLOCK}, got K={k}")
        for name, t, want in (("data", self.data, (m, k // 2)), ("scales", self.scales, (m, k // MX_BLOCK))):
            if t.dtype != torch.uint8:
                raise FormatError(f"MXFP4Tensor.{name} must be uint8, got {t.dtype}")
            if tuple(t.shape) != want:
                raise FormatError(f"MXFP4Tensor.{name} must have shape {want} for shape {self.shape}, got {tuple(t.shape)}")
            if not t.is_contiguous():
                raise FormatError(f"MXFP4Tensor.{name} must be contiguous")
        if self.data.device != self.scales.device:
            raise FormatError(f"MXFP4Tensor data on {self.data.device} but scales on {self.scales.device}")

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel()

    def payload(self) -> torch.Tensor:
        """One uint8 row per token, ``[M, K/2 + K/32]``: data then scales (the dispatch wire format)."""
        return torch.cat([self.data, self.scales], dim=1)

    @staticmethod
    def from_payload(payload: torch.Tensor, k: int) -> "MXFP4Tensor":
        """Inverse of ``payload()`` for K channels."""
        if payload.dtype != torch.uint8 or payload.dim() != 2 or payload.shape[1] != k // 2 + k // MX_BLOCK:
            raise FormatError(
                f"payload must be uint8 [M, {k // 2 + k // MX_BLOCK}] for K={k}, got {payload.dtype} {tuple(payload.shape)}"
            )
        return MXFP4Tensor(
            payload[:, : k // 2].contiguous(), payload[:, k // 2 :].contiguous(), (payload.shape[0], k)
        )


@dataclass(frozen=True)
class FP8RowTensor:
    """FP8 E4M3 rows with 1x128 power-of-two FP32 scales in the segment-major layout (module docstring)."""

    data: torch.Tensor
    scales: torch.Tensor
    segments: Segments

    def __post_init__(self):
        if self.data.dtype != torch.float8_e4m3fn or self.data.dim() != 2:
            raise FormatError(f"FP8RowTensor.data must be 2-D float8_e4m3fn, got {self.data.dtype} {tuple(self.data.shape)}")
        m, k = self.data.shape
        if k % FP8_GROUP != 0:
            raise FormatError(f"FP8RowTensor needs K a multiple of {FP8_GROUP}, got {k}")
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (m * (k // FP8_GROUP),):
            raise FormatError(
                f"FP8RowTensor.scales must be float32 [{m * (k // FP8_GROUP)}], got {self.scales.dtype} {tuple(self.scales.shape)}"
            )
        if self.segments.total != m:
            raise FormatError(f"segments cover {self.segments.total} rows, data has {m}")
        _check_pair(self.data, self.scales, "FP8RowTensor")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scales.numel()

    def segment(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(data ``[m_e, K]``, scale ``[m_e, K/128]`` with strides ``(1, m_e)``) of segment e."""
        k = self.data.shape[1]
        g = k // FP8_GROUP
        r0, r1 = self.segments.offsets[e], self.segments.offsets[e + 1]
        scale = self.scales[g * r0 : g * r1].view(g, r1 - r0).t()
        return self.data[r0:r1], scale

    def scale_matrix(self) -> torch.Tensor:
        """Scales as a dense ``[M, K/128]`` tensor (a copy; for reference code and tests)."""
        parts = [self.segment(e)[1] for e in range(self.segments.num)]
        return torch.cat(parts, dim=0) if parts else self.scales.new_empty(0, self.data.shape[1] // FP8_GROUP)


@dataclass(frozen=True)
class FP8ColTensor:
    """Transposed FP8 E4M3 copy ``[K, tokens]`` per segment, tokens padded to 128 (module docstring)."""

    data: torch.Tensor
    scales: torch.Tensor
    segments: Segments
    channels: int

    def __post_init__(self):
        k = self.channels
        mp = self.segments.padded_total
        if self.data.dtype != torch.float8_e4m3fn or tuple(self.data.shape) != (k * mp,):
            raise FormatError(
                f"FP8ColTensor.data must be flat float8_e4m3fn [{k * mp}], got {self.data.dtype} {tuple(self.data.shape)}"
            )
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (mp // FP8_GROUP, k):
            raise FormatError(
                f"FP8ColTensor.scales must be float32 [{mp // FP8_GROUP}, {k}], got {self.scales.dtype} {tuple(self.scales.shape)}"
            )
        _check_pair(self.data, self.scales, "FP8ColTensor")

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scales.numel()

    def segment(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(data ``[K, Mp_e]`` row-major, scale ``[K, Mp_e/128]`` with strides ``(1, K)``) of segment e."""
        k = self.channels
        p0, p1 = self.segments.padded_offsets[e], self.segments.padded_offsets[e + 1]
        data = self.data[k * p0 : k * p1].view(k, p1 - p0)
        scale = self.scales[p0 // FP8_GROUP : p1 // FP8_GROUP].t()
        return data, scale
