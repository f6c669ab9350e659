"""Launchers: allocate outputs in the ``formats`` layouts, build segment tables, pick tile sizes, launch.

Inputs are assumed validated (``fp4moe_kernels.convert`` does that). The small per-segment tables are cached
per (segments, device), so repeated calls with the same expert counts do no host-to-device copy (and can
be captured in a CUDA graph). Tensors must be on a CUDA device, or on
the CPU under ``TRITON_INTERPRET=1`` (then FP8 conversions are emulated exactly, see ``common``).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Sequence

import torch
import triton

from .. import switches
from ..formats import FP8ColTensor, FP8RowTensor, MXFP4Tensor, Segments, host_to_device
from . import col, row
from .common import INTERPRET

# Per kernel: (R = 32-element blocks (MXFP4-only kernels) or 128-element groups per program for row
# kernels / BN = channels per program for column kernels, unused, num_warps). Chosen by
# ``python -m fp4moe_kernels.bench.conversions --sweep`` on an H200: the tiles it adopted on 2026-12-01 at
# 32768 x 7168 over 32 experts (results/kernels/kernels_h200_2026-12-01_7a8040d.json; FP4MOE_TILES overrides them,
# see tiles_from_env).
TILES = {
    "bf16_to_fp4_row": (256, 0, 2),
    "fp4_to_bf16": (64, 0, 2),
    "bf16_to_fp8_row": (64, 0, 8),
    "bf16_to_fp4_and_fp8_row": (16, 0, 2),
    "fp4_row_to_fp8_row": (32, 0, 2),
    "fp8_row_to_fp4": (128, 0, 4),
    "fp4_row_to_fp8_col": (32, 0, 1),
    "bf16_to_fp8_col": (32, 0, 1),
    "bf16_to_fp8_row_col": (32, 0, 4),  # 128 tokens x 128 channels per program in chunks of BN channels (sm_90: 168
    # registers, three programs per SM); the whole tile at once ran 0.69-0.71x the two kernels on an H100
    # (results/kernels/README.md); the chunks are not measured on a GPU yet
    "quantize_weight_128x128": (0, 0, 8),  # one 128x128 block per program; not swept
}


def tiles_from_env(env: str | None = None) -> dict:
    """Tile overrides from ``env`` (default: the ``tiles`` switch, ``fp4moe_kernels.switches``, ``FP4MOE_TILES``): a
    JSON object (or the path of a JSON file, e.g. a benchmark's output, whose ``env.tiles_adopted`` is taken) mapping
    kernel names to [size, 0, num_warps]. Another GPU's best tiles without editing this file:
    ``python -m fp4moe_kernels.bench.conversions --sweep`` writes them."""
    import json

    text = switches.current().tiles if env is None else env
    if not text.strip():
        return {}
    try:
        if text.lstrip().startswith("{"):
            spec = json.loads(text)
        else:
            with open(text) as fh:
                spec = json.load(fh)
            spec = spec.get("env", {}).get("tiles_adopted", spec)
    except (OSError, ValueError) as e:
        raise ValueError(f"FP4MOE_TILES={text!r}: not a JSON object nor a readable JSON file ({e})") from None
    out = {}
    for name, t in spec.items():
        if name not in TILES:
            raise ValueError(f"FP4MOE_TILES names unknown kernel {name!r}; known: {sorted(TILES)}")
        if not (isinstance(t, (list, tuple)) and len(t) == 3 and all(isinstance(v, int) for v in t) and t[2] in (1, 2, 4, 8, 16)):
            raise ValueError(f"FP4MOE_TILES[{name!r}] = {t!r}: give [size, 0, num_warps] with num_warps in 1, 2, 4, 8, 16")
        out[name] = tuple(t)
    return out


# Where another GPU's sweep (the same benchmark and shape) chose otherwise, by a substring of the device name
# (torch.cuda.get_device_name): these go between TILES' defaults and any FP4MOE_TILES / kernels.tiles, on the first
# launch on such a GPU (or by apply_tiles). H100: kernels_h100-80gb-hbm3_2026-12-05_49fc0f7.json in results/kernels,
# FP8RowToFP4 1.07x and the column quantizer 1.05x the H200's tiles there, on every benchmark shape.
GPU_TILES = {
    "H100": {"fp8_row_to_fp4": (32, 0, 2), "bf16_to_fp8_col": (128, 0, 4)},
}


def gpu_tiles(gpu: str) -> dict:
    """GPU_TILES' entry whose key the device name ``gpu`` contains ({} for none, e.g. an H200: TILES are its own)."""
    return next((dict(t) for key, t in GPU_TILES.items() if key in gpu), {})


DEFAULT_TILES = dict(TILES)
TILES.update(tiles_from_env())
_gpu_tiles_set = False  # GPU_TILES applied (or found not to apply) for this process's GPU


def _current_gpu() -> str:
    """The current CUDA device's name once CUDA is in use in this process, else "" (never initializes CUDA)."""
    return "" if INTERPRET or not torch.cuda.is_initialized() else torch.cuda.get_device_name()


def _ensure_gpu_tiles() -> None:
    """Once per process, at the first conversion launch on a GPU: its GPU_TILES for the kernels that the
    environment's FP4MOE_TILES does not name and nobody has set since import (apply_tiles does this itself)."""
    global _gpu_tiles_set
    if _gpu_tiles_set:
        return
    gpu = _current_gpu()
    if not gpu:
        return
    _gpu_tiles_set = True
    named = tiles_from_env()
    for name, t in gpu_tiles(gpu).items():
        if name not in named and TILES[name] == DEFAULT_TILES[name]:
            TILES[name] = t


# row_seg is M int32s (8 MiB for the 2M routed rows of the H200 proxy at micro-batch 64) and every micro-batch
# routes anew, so 64 cached entries could hold 0.5 GiB of old steps' tables (the measured step-start memory of mxfp4
# grows by 0.4 GiB from micro-batch 16 to 64: results/scale/calibration.md; not yet re-measured with 16 entries).
# A step reuses one Segments per MoE layer and micro-batch, forward and backward.
@functools.lru_cache(maxsize=16)
def _seg_args(seg: Segments, device):
    """(single, row_seg int32 [M], seg_off int32 [E+1]) for the segment-major FP8 row scales (row_seg:
    ``Segments.row_segments``)."""
    if seg.num == 1:
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        return True, dummy, dummy
    seg_off = host_to_device(torch.tensor(seg.offsets, dtype=torch.int32), device)
    return False, seg.row_segments(device), seg_off


def _segment_tiles(sizes: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment, t0) int64 [n] of every tile of ``tile`` rows over segments of ``sizes`` rows (int64 [E], host), in
    segment order then ascending t0 (the row of the tile within its segment). Vectorized: the host builds tables of
    10-20 k tiles per MoE layer and micro-batch while the GPU waits (Python loops measured 5-12 ms each)."""
    per = (sizes + tile - 1) // tile
    seg = torch.repeat_interleave(torch.arange(sizes.numel()), per)
    first = torch.cumsum(per, 0) - per
    return seg, (torch.arange(seg.numel()) - first[seg]) * tile


@functools.lru_cache(maxsize=64)
def _col_tiles(seg: Segments, device, with_count: bool = False) -> torch.Tensor:
    """int32 [T, 5] tile table (see ``col`` module docstring): per tile (first row, rows, padded offset, padded
    count, t0), TILE_T tokens per tile over each expert's padded count; ``with_count``: [T, 6], the tile's segment's
    token count as a sixth field (``col.ROW_COL_TILE_FIELDS``: where the fused kernel's row scales go)."""
    counts = torch.tensor(seg.counts, dtype=torch.int64)
    padded = torch.tensor(seg.padded_counts, dtype=torch.int64)
    e, t0 = _segment_tiles(padded, col.TILE_T)
    offsets = torch.tensor(seg.offsets[:-1], dtype=torch.int64)[e]
    padded_offsets = torch.tensor(seg.padded_offsets[:-1], dtype=torch.int64)[e]
    rows = torch.clamp(counts[e] - t0, max=col.TILE_T)
    fields = [offsets + t0, rows, padded_offsets, padded[e], t0] + ([counts[e]] if with_count else [])
    t = torch.stack(fields, 1).to(torch.int32)
    return host_to_device(t.reshape(-1, len(fields)), device)


def _x(x: torch.Tensor):
    """(kernel argument, X_BF16): BF16 goes in as int32 words of two elements (see row._load_words),
    float32 as its int32 bits."""
    return (x.view(torch.int32), x.dtype == torch.bfloat16)


def _x16(x: torch.Tensor):
    """(kernel argument, X_BF16) for the column kernels: BF16 as int16 bits (see common.load_f32)."""
    return (x.view(torch.int16), True) if x.dtype == torch.bfloat16 else (x, False)


def _row_launch(name: str, m: int, k: int, unit: int):
    """(grid, meta-kwargs) for a flat row kernel over M*K/unit blocks (unit 32) or groups (unit 128)."""
    _ensure_gpu_tiles()
    r, _, warps = TILES[name]
    return (triton.cdiv(m * k // unit, r),), dict(R=r, num_warps=warps)


def bf16_to_fp4_row(x: torch.Tensor, rule: str = "ceil") -> MXFP4Tensor:
    m, k = x.shape
    xa, xb = _x(x)
    if xb and xa.data_ptr() % 8:  # the BF16 path reads blocks as int64 pairs of words: 8-byte aligned
        xa = xa.clone()
    q = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, k // 32, dtype=torch.uint8, device=x.device)
    if m:
        grid, meta = _row_launch("bf16_to_fp4_row", m, k, 32)
        row.bf16_to_fp4_row_kernel[grid](xa, q, s, m * k // 32, RULE_CEIL=(rule == "ceil"), X_BF16=xb,
                                         EMULATE=INTERPRET, **meta)
    return MXFP4Tensor(q, s, (m, k))


def bf16_to_fp8_row(x: torch.Tensor, seg: Segments) -> FP8RowTensor:
    m, k = x.shape
    xa, xb = _x(x)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m * (k // 128), dtype=torch.float32, device=x.device)
    single, row_seg, seg_off = _seg_args(seg, x.device)
    if m:
        grid, meta = _row_launch("bf16_to_fp8_row", m, k, 128)
        row.bf16_to_fp8_row_kernel[grid](xa, q.view(torch.int16), s, row_seg, seg_off, m, k,
                                         SINGLE_SEGMENT=single, EMULATE=INTERPRET, X_BF16=xb, **meta)
    return FP8RowTensor(q, s, seg)


def bf16_to_fp4_and_fp8_row(x: torch.Tensor, seg: Segments, rule: str = "ceil"):
    m, k = x.shape
    xa, xb = _x(x)
    if xb and xa.data_ptr() % 8:  # the MXFP4 part reads blocks as int64 pairs of words: 8-byte aligned
        xa = xa.clone()
    q4 = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    s4 = torch.empty(m, k // 32, dtype=torch.uint8, device=x.device)
    q8 = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s8 = torch.empty(m * (k // 128), dtype=torch.float32, device=x.device)
    single, row_seg, seg_off = _seg_args(seg, x.device)
    if m:
        grid, meta = _row_launch("bf16_to_fp4_and_fp8_row", m, k, 128)
        row.bf16_to_fp4_and_fp8_row_kernel[grid](
            xa, q4, s4, q8.view(torch.int16), s8, row_seg, seg_off, m, k, RULE_CEIL=(rule == "ceil"),
            SINGLE_SEGMENT=single, EMULATE=INTERPRET, X_BF16=xb, **meta)
    return MXFP4Tensor(q4, s4, (m, k)), FP8RowTensor(q8, s8, seg)


def fp4_row_to_fp8_row(a: MXFP4Tensor, seg: Segments) -> FP8RowTensor:
    m, k = a.shape
    o = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=a.device)
    s = torch.empty(m * (k // 128), dtype=torch.float32, device=a.device)
    single, row_seg, seg_off = _seg_args(seg, a.device)
    if m:
        # the kernel reads data and scales as int32 words (a group's four UE8M0 codes in one load): 4-byte aligned
        data = a.data if a.data.data_ptr() % 4 == 0 else a.data.clone()
        scales = a.scales if a.scales.data_ptr() % 4 == 0 else a.scales.clone()
        grid, meta = _row_launch("fp4_row_to_fp8_row", m, k, 128)
        row.fp4_row_to_fp8_row_kernel[grid](data, scales, o.view(torch.int16), s, row_seg, seg_off, m, k,
                                            SINGLE_SEGMENT=single, EMULATE=INTERPRET, **meta)
    return FP8RowTensor(o, s, seg)


def fp4_to_bf16(a: MXFP4Tensor) -> torch.Tensor:
    m, k = a.shape
    o = torch.empty(m, k, dtype=torch.bfloat16, device=a.device)
    if m:
        # the kernel reads the packed data as int32 words (four per block): 4-byte aligned
        data = a.data if a.data.data_ptr() % 4 == 0 else a.data.clone()
        grid, meta = _row_launch("fp4_to_bf16", m, k, 32)
        row.fp4_to_bf16_kernel[grid](data, a.scales, o.view(torch.int32), m * k // 32, EMULATE=INTERPRET, **meta)
    return o


def fp8_row_to_fp4(f: FP8RowTensor, rule: str = "ceil") -> MXFP4Tensor:
    m, k = f.shape
    q = torch.empty(m, k // 2, dtype=torch.uint8, device=f.data.device)
    s = torch.empty(m, k // 32, dtype=torch.uint8, device=f.data.device)
    single, row_seg, seg_off = _seg_args(f.segments, f.data.device)
    if m * (k // 128) >= 2**31:  # the kernel numbers groups in int32 (that is 256 GiB of FP8 data)
        raise ValueError(f"fp8_row_to_fp4: {m} x {k} has 2**31 or more 128-groups")
    data = f.data if f.data.data_ptr() % 8 == 0 else f.data.clone()  # the kernel reads int64 pairs of words
    if m:
        grid, meta = _row_launch("fp8_row_to_fp4", m, k, 128)
        row.fp8_row_to_fp4_kernel[grid](data.view(torch.int16), f.scales, row_seg, seg_off, q, s, m, k,
                                        RULE_CEIL=(rule == "ceil"), SINGLE_SEGMENT=single, EMULATE=INTERPRET, **meta)
    return MXFP4Tensor(q, s, (m, k))


def _col_launch(name: str, seg: Segments, k: int, device):
    """(output data, output scales, tile table, grid, meta-kwargs) for a column kernel."""
    _ensure_gpu_tiles()
    bn, _, warps = TILES[name]
    mp = seg.padded_total
    o = torch.empty(k * mp, dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty(mp // 128, k, dtype=torch.float32, device=device)
    tiles = _col_tiles(seg, device)
    return o, s, tiles, (k // bn, tiles.shape[0]), dict(BN=bn, num_warps=warps)


def fp4_row_to_fp8_col(a: MXFP4Tensor, seg: Segments) -> FP8ColTensor:
    m, k = a.shape
    o, s, tiles, grid, meta = _col_launch("fp4_row_to_fp8_col", seg, k, a.device)
    if tiles.shape[0]:
        col.fp4_row_to_fp8_col_kernel[grid](a.data, a.scales, o.view(torch.uint8), s, tiles, k,
                                            EMULATE=INTERPRET, **meta)
    return FP8ColTensor(o, s, seg, k)


def bf16_to_fp8_col(x: torch.Tensor, seg: Segments) -> FP8ColTensor:
    m, k = x.shape
    xa, xb = _x16(x)
    o, s, tiles, grid, meta = _col_launch("bf16_to_fp8_col", seg, k, x.device)
    if tiles.shape[0]:
        if xb:  # BF16 as int32 words of two channels, FP8 out as int32 words of four tokens (k, Mp are even)
            xa = (x if x.storage_offset() % 2 == 0 else x.clone()).view(torch.int32)  # a view at an odd offset: copied
            ov = o.view(torch.int32)
        else:
            ov = o.view(torch.uint8)
        col.bf16_to_fp8_col_kernel[grid](xa, ov, s, tiles, k, EMULATE=INTERPRET, X_BF16=xb, **meta)
    return FP8ColTensor(o, s, seg, k)


def fp8_row_col_outputs(m: int, k: int, seg: Segments, cols: bool, device):
    """Empty outputs of a kernel that writes an ``[m, k]`` operand's FP8 copies (``col.row_col_tile``): row data
    ``[m, k]`` and segment-major scales ``[m * k/128]``, and with ``cols`` column data ``[k * Mp]`` and scales
    ``[Mp/128, k]`` (Mp: the segments padded to 128), else one-element stand-ins the kernel never writes."""
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=device)
    qs = torch.empty(m * (k // 128), dtype=torch.float32, device=device)
    mp = seg.padded_total
    o = torch.empty(k * mp if cols else 1, dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty((mp // 128, k) if cols else (1, 1), dtype=torch.float32, device=device)
    return q, qs, o, s


def bf16_to_fp8_row_col(x: torch.Tensor, seg: Segments) -> tuple[FP8RowTensor, FP8ColTensor]:
    """``(bf16_to_fp8_row(x, seg), bf16_to_fp8_col(x, seg))`` in one launch reading x once
    (``col.bf16_to_fp8_row_col_kernel``)."""
    m, k = x.shape
    xa, xb = _x16(x)
    _ensure_gpu_tiles()
    bn, _, warps = TILES["bf16_to_fp8_row_col"]
    q, qs, o, s = fp8_row_col_outputs(m, k, seg, True, x.device)
    tiles = _col_tiles(seg, x.device, with_count=True)
    if tiles.shape[0]:
        col.bf16_to_fp8_row_col_kernel[(k // 128, tiles.shape[0])](
            xa, q.view(torch.uint8), qs, o.view(torch.uint8), s, tiles, k, BN=bn, EMULATE=INTERPRET, X_BF16=xb,
            num_warps=warps)
    return FP8RowTensor(q, qs, seg), FP8ColTensor(o, s, seg, k)


# expert offsets on the device, by (device, first weight's address, every expert's offset): a layer's weights do not
# move during training, so each layer's table is sent once
_OFFSETS: dict[tuple, torch.Tensor] = {}


def _expert_offsets(ws, device, unit: int = 1) -> torch.Tensor:
    """int64 ``[E]``: where each expert of ``ws`` starts, in ``unit`` elements after ``ws[0]`` (every start a
    multiple of ``unit`` elements)."""
    size = ws[0].element_size()
    offs = tuple((w.data_ptr() - ws[0].data_ptr()) // (size * unit) for w in ws)
    key = (str(device), ws[0].data_ptr(), offs, unit)
    t = _OFFSETS.get(key)
    if t is None:
        if len(_OFFSETS) > 4096:
            _OFFSETS.clear()
        t = _OFFSETS[key] = host_to_device(torch.tensor(offs, dtype=torch.int64), device)
    return t


def _weight_unit(ws) -> int:
    """What every expert's address is a multiple of, in bf16 elements: 8 (16 bytes: vector loads), 2 (4 bytes:
    int32 loads) or 1."""
    for unit in (8, 2):
        if all(w.data_ptr() % (2 * unit) == 0 for w in ws):
            return unit
    return 1


def quantize_weight_128x128(w, rows_per_expert: int | None = None, transpose: bool = False):
    """W bf16 -> (data ``[R, K]`` float8_e4m3fn, scale ``[R/128, K/128]`` float32) and, with ``transpose``, (data
    ``[E, K, N]``, scale ``[E, K/128, N/128]``) of every expert's W_e^T. W is ``[R, K]`` contiguous with
    ``N = rows_per_expert`` rows per expert (default R: one matrix), or a sequence of E experts ``[N, K]``, each
    row-major, wherever each lies (read in place: no copy). R, K multiples of 128. See ``weight``."""
    from . import weight

    if torch.is_tensor(w):
        if w.dim() != 2 or not w.is_contiguous():
            raise ValueError(f"a weight tensor must be [R, K] and contiguous, got {tuple(w.shape)} {w.stride()}")
        r, k = w.shape
        n = r if rows_per_expert is None else rows_per_expert
        ws = [w[i * n:(i + 1) * n] for i in range(r // n)] if r else [w]
    else:
        ws = list(w)
        if not all(x.dim() == 2 and x.is_contiguous() and x.shape == ws[0].shape and x.dtype == ws[0].dtype
                   and x.device == ws[0].device for x in ws):
            raise ValueError("experts must be row-major [N, K] tensors of one shape, dtype and device")
        n, k = ws[0].shape
        r = len(ws) * n
    if ws[0].dtype != torch.bfloat16:
        raise TypeError(f"the weight kernel takes bfloat16 only, got {ws[0].dtype}: use the torch path")
    e, device = len(ws), ws[0].device
    q = torch.empty(r, k, dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty(r // 128, k // 128, dtype=torch.float32, device=device)
    if transpose:
        qt = torch.empty(e, k, n, dtype=torch.float8_e4m3fn, device=device)
        st = torch.empty(e, k // 128, n // 128, dtype=torch.float32, device=device)
    else:
        qt, st = q, s  # unused
    if r and k:
        unit = _weight_unit(ws)
        weight.quantize_weight_128x128_kernel[(r // 128, k // 128)](
            ws[0].view(torch.int16), _expert_offsets(ws, device, unit), q.view(torch.int16), s, qt.view(torch.uint8),
            st, K=k, N=n, TRANSPOSE=transpose, EMULATE=INTERPRET, UNIT=unit,
            num_warps=TILES["quantize_weight_128x128"][2])
    return (q, s, qt, st) if transpose else (q, s)


# ------------------------------------------------------------------------------------- grouped FP8 GEMMs

# rows: (BM, BN, GROUP_M, num_warps, num_stages); wgrad: (BN, BK, num_warps, num_stages). Chosen by
# ``python -m fp4moe.bench.moe_layer --sweep-gemm`` on an H200 (results/moe_layer/); FP4MOE_GEMM_TILES (JSON, e.g.
# '{"rows": [128, 256, 8, 8, 3]}') overrides them for a run.
# The H200 sweep's choice: results/moe_layer/README.md, "Tiles".
GEMM_TILES = {"rows": (64, 128, 8, 4, 4), "wgrad": (64, 128, 4, 3)}


DEFAULT_GEMM_TILES = dict(GEMM_TILES)


def gemm_tiles_from_env(raw: str | None = None) -> dict:
    """GEMM tile overrides from ``raw`` (default: the ``gemm_tiles`` switch, ``FP4MOE_GEMM_TILES``): JSON mapping
    'rows' / 'wgrad' to a tuple as long as the default's. ValueError naming the variable for anything else."""
    import json

    raw = switches.current().gemm_tiles if raw is None else raw
    if not raw:
        return {}
    try:
        out = {}
        for key, val in json.loads(raw).items():
            if key not in DEFAULT_GEMM_TILES or len(val) != len(DEFAULT_GEMM_TILES[key]):
                raise ValueError(f"{key}={val}")
            out[key] = tuple(int(v) for v in val)
        return out
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"FP4MOE_GEMM_TILES={raw!r} is not valid ({exc}): give JSON like "
                         '\'{"rows": [128, 128, 8, 8, 4], "wgrad": [128, 64, 8, 3]}\'') from None


GEMM_TILES.update(gemm_tiles_from_env())


def apply_tiles(s: "switches.Switches", gpu: str | None = None) -> None:
    """Set TILES and GEMM_TILES to the defaults, the GPU's GPU_TILES over them, and ``s.tiles`` / ``s.gemm_tiles``
    over those (what the trainer calls with its config's switches; at import the environment's are applied, the
    GPU's at the first launch). ``gpu``: a device name; None: the current CUDA device's if CUDA is in use, else no
    GPU's. ValueError for a bad spec, nothing set."""
    global _gpu_tiles_set
    gpu = _current_gpu() if gpu is None else gpu
    tiles = {**DEFAULT_TILES, **gpu_tiles(gpu), **tiles_from_env(s.tiles)}
    gemm = {**DEFAULT_GEMM_TILES, **gemm_tiles_from_env(s.gemm_tiles)}
    TILES.clear()
    TILES.update(tiles)
    GEMM_TILES.clear()
    GEMM_TILES.update(gemm)
    _gpu_tiles_set = _gpu_tiles_set or bool(gpu)


@functools.lru_cache(maxsize=64)
def _row_tiles(seg: Segments, bm: int, device):
    """(tiles int32 [n, 3] = (expert, first row, rows), seg_off int32 [E+1]) for ``grouped_rows_kernel``: ``bm``
    rows per tile over each expert's rows."""
    counts = torch.tensor(seg.counts, dtype=torch.int64)
    e, t0 = _segment_tiles(counts, bm)
    first = torch.tensor(seg.offsets[:-1], dtype=torch.int64)[e] + t0
    tiles = torch.stack([e, first, torch.clamp(counts[e] - t0, max=bm)], 1).to(torch.int32).reshape(-1, 3)
    off = torch.tensor(seg.offsets, dtype=torch.int32)
    return host_to_device(tiles, device), host_to_device(off, device)


@functools.lru_cache(maxsize=64)
def _padded_offsets(seg: Segments, device):
    return host_to_device(torch.tensor(seg.padded_offsets, dtype=torch.int32), device)


def _fp8_arg(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if INTERPRET else t


def grouped_fp8_rows(a: FP8RowTensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """C ``[T, N]`` = per expert e ``A_e @ B_e^T`` (``gemm.grouped_rows_kernel``). a: ``FP8RowTensor`` ``[T, Kc]``
    over E segments; b ``[E, N, Kc]`` E4M3 contiguous; b_scale ``[E, N/128, Kc/128]`` float32 contiguous."""
    from . import gemm

    t, kc = a.data.shape
    e, n, _ = b.shape
    seg = a.segments
    bm, bn, group_m, warps, stages = GEMM_TILES["rows"]
    c = torch.empty(t, n, dtype=out_dtype, device=a.data.device)
    tiles, off = _row_tiles(seg, bm, a.data.device)
    n_tiles = tiles.shape[0]
    if n_tiles and n:
        grid = (n_tiles * triton.cdiv(n, bn),)
        gemm.grouped_rows_kernel[grid](_fp8_arg(a.data), a.scales, _fp8_arg(b), b_scale, c, tiles, off, n, n_tiles,
                                       KC=kc, BM=bm, BN=bn, GROUP_M=group_m, EMULATE=INTERPRET,
                                       num_warps=warps, num_stages=stages)
    return c


@functools.lru_cache(maxsize=16)
def _tma_available(device: torch.device) -> bool:
    """Whether the wgrad can load its tiles by TMA here: a Hopper-or-newer GPU and a Triton with device-side tensor
    descriptors and the launch-time scratch allocator (``triton.runtime._allocation``, Triton >= 3.3). Asked once per
    device (every wgrad launch asks)."""
    if INTERPRET or device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return False
    try:
        from triton.runtime import _allocation
    except ImportError:
        return False
    return hasattr(triton.language, "make_tensor_descriptor") and hasattr(_allocation, "_allocator")


@contextlib.contextmanager
def _descriptor_scratch(device: torch.device):
    """Triton's launch-time allocator set, for this launch only, to torch's caching allocator on ``device``: the
    device-side TMA descriptors (128 bytes each, two per program) are written there. The process-wide
    ``triton.set_allocator`` is left as the caller set it."""
    from triton.runtime import _allocation

    token = _allocation._allocator.set(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def grouped_fp8_wgrad(a: FP8ColTensor, b: FP8ColTensor, out_dtype=torch.bfloat16, tma: bool | None = None,
                      accumulate_into: Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
    """C ``[E, N, K]`` = per expert ``A_e B_e^T`` over its (padded) tokens; a: columns of N channels, b: columns of
    K channels, over the same segments. ``tma`` (None: where ``_tma_available``): ``gemm.grouped_wgrad_tma_kernel``
    (tiles loaded by TMA; bit for bit the same result), else ``gemm.grouped_wgrad_kernel`` (pointer loads).

    ``accumulate_into``: E contiguous ``[N, K]`` float32 or bf16 tensors of one storage (megatron's ``main_grad``
    views into its DDP buffer): each gets ``+= A_e B_e^T`` (float32 sum, one rounding to its dtype) and None is
    returned; no ``[E, N, K]`` output is made."""
    from . import gemm

    seg = a.segments
    n, k = a.channels, b.channels
    bn, bk, warps, stages = GEMM_TILES["wgrad"]
    dev = a.data.device
    if accumulate_into is None:
        c = torch.empty(seg.num, n, k, dtype=out_dtype, device=dev)
        coff = c   # unused without ACCUMULATE
    else:
        c, coff = _accumulation_targets(accumulate_into, seg.num, n, k, dev)
    if seg.num and n and k:
        use_tma = _tma_available(dev) if tma is None else tma
        grid = (triton.cdiv(n, bn), triton.cdiv(k, bk), seg.num)
        args = (_fp8_arg(a.data), a.scales, _fp8_arg(b.data), b.scales, c, coff, _padded_offsets(seg, dev), n, k,
                max(seg.padded_counts) // 128 if INTERPRET else 0)
        kw = dict(BN=bn, BK=bk, EMULATE=INTERPRET, ACCUMULATE=accumulate_into is not None, num_warps=warps,
                  num_stages=stages)
        if use_tma:
            with _descriptor_scratch(dev):
                gemm.grouped_wgrad_tma_kernel[grid](*args, **kw)
        else:
            gemm.grouped_wgrad_kernel[grid](*args, **kw)
    return None if accumulate_into is not None else c


def _accumulation_targets(targets: Sequence[torch.Tensor], e_num: int, n: int, k: int,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(one flat tensor over the targets' storage, int64 ``[E]`` element offsets of each target in it), after
    checking what ``grouped_fp8_wgrad(accumulate_into=)`` needs of them."""
    if len(targets) != e_num:
        raise ValueError(f"accumulate_into: {len(targets)} tensors for {e_num} experts")
    t0 = targets[0]
    if t0.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"accumulate_into: dtype {t0.dtype}; float32 or bfloat16 (a main-gradient buffer)")
    storage = t0.untyped_storage()
    for i, t in enumerate(targets):
        if t.shape != (n, k) or not t.is_contiguous() or t.dtype != t0.dtype or t.device != device:
            raise ValueError(f"accumulate_into[{i}]: {tuple(t.shape)} {t.dtype} on {t.device}, contiguous "
                             f"{t.is_contiguous()}; each must be a contiguous [{n}, {k}] {t0.dtype} on {device}")
        if t.untyped_storage().data_ptr() != storage.data_ptr():
            raise ValueError(f"accumulate_into[{i}] lies in another storage than accumulate_into[0]: the targets "
                             "must be views of one buffer (megatron's DDP gradient buffer)")
    size = t0.element_size()
    flat = torch.empty(0, dtype=t0.dtype, device=device).set_(storage, 0, (storage.nbytes() // size,), (1,))
    offsets = [(t.data_ptr() - storage.data_ptr()) // size for t in targets]
    return flat, host_to_device(torch.tensor(offsets, dtype=torch.int64), device)  # queued, not a pageable copy's sync
