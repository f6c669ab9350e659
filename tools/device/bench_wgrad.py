"""Issue P8: new structures for the grouped FP8 weight-gradient GEMM, timed against the package's
``grouped_wgrad_kernel`` and one dense blockwise ``F.scaled_mm`` of equal work, on one Hopper GPU.

What it measures. DeepSeek-V3's routed experts on one GPU: 32 experts, 32768 routed rows ragged over them (one
empty expert, one of 5 rows; ``counts_v3`` as tools/device/bench_deepgemm.py has it), tokens padded to 128 per
expert. fc1 wgrad (C_e [N=4096, K=7168] = dY_e^T X_e) and fc2 wgrad (C_e [N=7168, K=2048]). Both operands are
``FP8ColTensor`` columns built by the project's own quantizer (``fp4moe_kernels.convert.bf16_to_fp8_col``) with 1x128
FP32 power-of-two scales along tokens; the BF16 sources are randn times a power of two per token (2^-4 .. 2^4), so
that the scales differ from block to block and the bit-equality check below means something. Output bf16
``[E, N, K]`` as ``launchers.grouped_fp8_wgrad`` returns it.

Rows of the table (``$OUT/wgrad/wgrad_<gpu>.md`` and ``.json``): ms (``triton.testing.do_bench``, warmup 25 ms,
rep 100 ms), TFLOP/s counting the real rows only (2 M N K, M = 32768), ratio to the dense reference (one
``fp8_mm(..., "wgrad")`` = ``F.scaled_mm`` BlockWise1x128 x BlockWise1x128 of M x N x K, timed as
src/fp4moe/bench/moe_layer.py's ``_gemm_compare`` times it), ratio to the current kernel, and against the current
kernel's output: max |diff| and whether bit-equal (bf16). Candidates that keep the per-element summation order (the
same 128-token block order, the promotion ``acc + (part * sa[:, None]) * sb[None, :]``) should be bit-equal; a
candidate that fails to compile or run is recorded with the last lines of its traceback, the others still run.

    python tools/device/bench_wgrad.py --out $OUT/wgrad          # GPU (H200): about 2-3 minutes, compiles included
    python tools/device/bench_wgrad.py --cpu-check               # CPU, TRITON_INTERPRET=1 (set by the script)

``--cpu-check`` runs every candidate under the Triton interpreter (FP8 as uint8 decoded exactly: the package's
``_load_fp8`` / ``_dot_t`` with ``EMULATE``) at 3 experts with counts [0, 5, 300], N=256, K=384 (float32 output)
and compares each with the package's kernel (bit-equality and max |diff|); it exits non-zero if one differs by more
than 1e-5 relative or does not zero the empty expert.

Candidates (each its own @triton.jit kernel below; several tile configs each, ``CONFIGS``):

* ``current``: the package's ``grouped_wgrad_kernel`` (pointer loads, fresh dot per 128-token block, then the
  promotion: the wgmma is waited for before every promotion), at GEMM_TILES["wgrad"] and at 128x128 / 8 warps.
* ``lag1`` (idea a): lag-one promotion. The dot of block j is issued before block j-1's partial is promoted (the
  previous partial and its scales are loop-carried), so the asynchronous wgmma of block j can run while the CUDA
  cores do block j-1's FMAs; the last partial is promoted after the loop. Pointer loads. Same summation order as the
  package's kernel. Tiles 64x128 / 4 warps, 128x128 / 8 warps (idea b), 64x256 and 128x256 / 8 warps.
* ``tma`` (idea c): per-expert device-side TMA descriptors (``tl.make_tensor_descriptor``: base ``+ N * p0``,
  shape ``[N, mp]``, strides ``[mp, 1]``, block ``[BN, 128]``; ``triton.set_allocator`` gives the scratch), with
  ``LAG`` = plain or lag-one promotion, and ``WS`` = ``tl.range(..., warp_specialize=True)`` (Triton 3.6 documents it
  for Blackwell; tried here in case it lowers on Hopper; the interpreter ignores it). Tiles 64x128 / 4 warps at 2-4
  stages (2-3 programs per SM), 128x64 / 4, 128x128 / 8, 128x256 / 8. Runs under the interpreter too.
* ``persistent`` (idea d): ``per_sm`` programs per SM loop over a host-built tile table (expert, n tile, k tile;
  largest experts first, k tile outer, n tile inner) with the plain promotion, pointer (``TMA=False``, the
  package's ``_wgrad_step``) or TMA loads, so one tile's epilogue store overlaps the next tile's first loads and no
  wave tail is left per expert; ``maxnreg`` caps registers so that 3 programs fit on an SM.

Compiled for sm_90 on a CPU host (``triton.compile`` with ``GPUTarget("cuda", 90, 32)``, ptxas -v; Triton 3.6) before
the GPU run: every config compiles. Registers / spills per thread: current 64x128 w4 234/0 (2 programs per SM);
lag1 255 with spills (24-72 B) and, in its PTX, ``wgmma.wait_group 0`` still right after the block's wgmma, before
the previous block's FMAs: Triton makes a dot "properly async" only when its result feeds the next dot's accumulator,
so lag-one gains nothing in Triton 3.6 (kept to measure it). tma 64x128 w4 160/0 (3 programs per SM at s3: the
promotion of one program overlaps the wgmma of another), the loop body 128 FP32 ops of promotion + ~60 others
against ~330 PTX lines with pointer loads. WS: the ``tt.warp_specialize`` attribute stays, the PTX is that of the
plain tma config (not applied on sm_90). 128x256 spills (192 B). persistent TMA 204 regs (x2/SM) or 167 under
maxnreg 168 (x3/SM).

* ``gluon``: tools/device/wgrad_gluon.py, the ping-pong the README's section "The grouped wgrad" asks for, in Gluon
  (``triton.experimental.gluon``, Triton 3.6): per-expert device-side TMA descriptors, a ring of STAGES shared-memory
  stages with mbarriers, wgmma issued asynchronously into a fresh accumulator per 128-token block, and
  ``warpgroup_mma_wait(num_outstanding=1)`` so that block j's wgmma runs while block j-1's partial is promoted
  (``wgmma.wait_group 1`` / ``WARPGROUP.DEPBAR.LE gsb0, 0x1`` in the loop, two blocks per iteration, a wait(0) at the
  iteration's end so that no wgmma is in flight across the back edge; the module's docstring says why).
  Same summation order and promotion expression as the package's kernel: expected bit-equal. Tiles
  ``wgrad_gluon.CONFIGS`` (128x64 / 4 warps at 2-4 stages: 255 registers, no spill; two warpgroups of 64 rows each,
  128x64 and 256x64 / 8 warps: 222 / 255 registers, no spill; 64x64 / 4; 64x128 / 4 and 128x128 / 8, which spill at
  sm_90, for comparison). Gluon has no interpreter:
  ``--cpu-check`` skips it (``python tools/device/wgrad_gluon.py --aot`` compiles it for sm_90 on a CPU instead).

Idea (e) (merging two blocks' partials when their scales are equal) is not tried: it changes the summation order and
is data dependent.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

if "--cpu-check" in sys.argv:  # before triton is imported: kernels are interpreted iff this is set at import
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "kernels")]

from fp4moe_kernels.triton_kernels.common import INTERPRET  # noqa: E402
from fp4moe_kernels.triton_kernels.gemm import _dec, _dot_t, _load_fp8, _wgrad_step  # noqa: E402

try:  # the Gluon candidate (a Triton without triton.experimental.gluon: recorded as an error, the others run)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import wgrad_gluon  # noqa: E402
    _GLUON_ERROR = None
except Exception as _exc:  # noqa: BLE001
    wgrad_gluon, _GLUON_ERROR = None, repr(_exc)


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _block_ptr_loads(j, live, a_ptr, b_ptr, sa_ptr, sb_ptr, p0, mp, rn, rk, nmask, kmask, N, K,
                     EMULATE: tl.constexpr):
    """(partial product, sa, sb) of token block j of one expert, pointer loads (as the package's _wgrad_step)."""
    rt = j * 128 + tl.arange(0, 128)
    a = _load_fp8(a_ptr + N * p0 + rn[:, None].to(tl.int64) * mp + rt[None, :], nmask[:, None] & live, EMULATE)
    b = _load_fp8(b_ptr + K * p0 + rk[:, None].to(tl.int64) * mp + rt[None, :], kmask[:, None] & live, EMULATE)
    part = _dot_t(a, b, EMULATE)
    sa = tl.load(sa_ptr + (p0 // 128 + j) * N + rn, mask=nmask & live, other=0.0)
    sb = tl.load(sb_ptr + (p0 // 128 + j) * K + rk, mask=kmask & live, other=0.0)
    return part, sa, sb


@triton.jit
def wgrad_lag1_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, poff_ptr, N, K, MAXJ: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, EMULATE: tl.constexpr):
    """(a) lag-one promotion, pointer loads, grid (n tiles, k tiles, experts) as the package's kernel."""
    e = tl.program_id(2)
    tn = tl.program_id(0)
    tk = tl.program_id(1)
    p0 = tl.multiple_of(tl.load(poff_ptr + e), 128).to(tl.int64)
    mp = tl.multiple_of(tl.load(poff_ptr + e + 1) - tl.load(poff_ptr + e), 128).to(tl.int64)
    rn = tn * BN + tl.arange(0, BN)
    rk = tk * BK + tl.arange(0, BK)
    nmask = rn < N
    kmask = rk < K
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    part = tl.zeros((BN, BK), dtype=tl.float32)
    sa = tl.zeros((BN,), dtype=tl.float32)
    sb = tl.zeros((BK,), dtype=tl.float32)
    nj = mp // 128
    if EMULATE:
        for j in range(0, MAXJ):
            nxt, sa_n, sb_n = _block_ptr_loads(j, j < nj, a_ptr, b_ptr, sa_ptr, sb_ptr, p0, mp, rn, rk, nmask, kmask,
                                               N, K, EMULATE)
            acc = acc + (part * sa[:, None]) * sb[None, :]
            part, sa, sb = nxt, sa_n, sb_n
    else:
        for j in range(0, nj):
            nxt, sa_n, sb_n = _block_ptr_loads(j, True, a_ptr, b_ptr, sa_ptr, sb_ptr, p0, mp, rn, rk, nmask, kmask,
                                               N, K, EMULATE)
            acc = acc + (part * sa[:, None]) * sb[None, :]  # block j-1's, while block j's wgmma runs
            part, sa, sb = nxt, sa_n, sb_n
    acc = acc + (part * sa[:, None]) * sb[None, :]
    c_ptrs = c_ptr + (e.to(tl.int64) * N + rn[:, None]) * K + rk[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


@triton.jit
def _tma_block(adesc, bdesc, j, live, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask, N, K, n0, k0,
               EMULATE: tl.constexpr):
    """(partial product, sa, sb) of token block j through the expert's descriptors (out-of-range rows/tokens read 0)."""
    t0 = j * 128  # descriptor offsets must be int32: j is (nj is int32 in _tma_tile_acc)
    a = _dec(adesc.load([n0, t0]), EMULATE)
    b = _dec(bdesc.load([k0, t0]), EMULATE)
    part = _dot_t(a, b, EMULATE)
    sa = tl.load(sa_ptr + (p0 // 128 + j) * N + rn, mask=nmask & live, other=0.0)
    sb = tl.load(sb_ptr + (p0 // 128 + j) * K + rk, mask=kmask & live, other=0.0)
    return part, sa, sb


@triton.jit
def _tma_tile_acc(a_ptr, sa_ptr, b_ptr, sb_ptr, p0, mp, N, K, n0, k0, MAXJ: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, LAG: tl.constexpr, WS: tl.constexpr, EMULATE: tl.constexpr):
    """FP32 accumulator [BN, BK] of one (expert, n tile, k tile) through per-expert TMA descriptors."""
    rn = n0 + tl.arange(0, BN)
    rk = k0 + tl.arange(0, BK)
    nmask = rn < N
    kmask = rk < K
    acc = tl.zeros((BN, BK), dtype=tl.float32)
    nj = (mp // 128).to(tl.int32)
    if mp > 0:  # no descriptor of an empty expert (a zero-sized TMA box)
        adesc = tl.make_tensor_descriptor(a_ptr + N * p0, shape=[N, mp.to(tl.int32)], strides=[mp, 1],
                                          block_shape=[BN, 128])
        bdesc = tl.make_tensor_descriptor(b_ptr + K * p0, shape=[K, mp.to(tl.int32)], strides=[mp, 1],
                                          block_shape=[BK, 128])
        if LAG:
            part = tl.zeros((BN, BK), dtype=tl.float32)
            sa = tl.zeros((BN,), dtype=tl.float32)
            sb = tl.zeros((BK,), dtype=tl.float32)
            if EMULATE:
                for j in range(0, MAXJ):
                    nxt, sa_n, sb_n = _tma_block(adesc, bdesc, j, j < nj, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask,
                                                 N, K, n0, k0, EMULATE)
                    acc = acc + (part * sa[:, None]) * sb[None, :]
                    part, sa, sb = nxt, sa_n, sb_n
            else:
                for j in tl.range(0, nj, warp_specialize=WS):
                    nxt, sa_n, sb_n = _tma_block(adesc, bdesc, j, True, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask,
                                                 N, K, n0, k0, EMULATE)
                    acc = acc + (part * sa[:, None]) * sb[None, :]
                    part, sa, sb = nxt, sa_n, sb_n
            acc = acc + (part * sa[:, None]) * sb[None, :]
        else:
            if EMULATE:
                for j in range(0, MAXJ):
                    part, sa, sb = _tma_block(adesc, bdesc, j, j < nj, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask,
                                              N, K, n0, k0, EMULATE)
                    acc = acc + (part * sa[:, None]) * sb[None, :]
            else:
                for j in tl.range(0, nj, warp_specialize=WS):
                    part, sa, sb = _tma_block(adesc, bdesc, j, True, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask,
                                              N, K, n0, k0, EMULATE)
                    acc = acc + (part * sa[:, None]) * sb[None, :]
    return acc


@triton.jit
def wgrad_tma_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, poff_ptr, N, K, MAXJ: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, LAG: tl.constexpr, WS: tl.constexpr, EMULATE: tl.constexpr):
    """(c) TMA loads through per-expert device-side descriptors; LAG: lag-one promotion; WS: warp_specialize."""
    e = tl.program_id(2)
    n0 = tl.program_id(0) * BN
    k0 = tl.program_id(1) * BK
    p0 = tl.multiple_of(tl.load(poff_ptr + e), 128).to(tl.int64)
    mp = tl.multiple_of(tl.load(poff_ptr + e + 1) - tl.load(poff_ptr + e), 128).to(tl.int64)
    acc = _tma_tile_acc(a_ptr, sa_ptr, b_ptr, sb_ptr, p0, mp, N, K, n0, k0, MAXJ, BN, BK, LAG, WS, EMULATE)
    rn = n0 + tl.arange(0, BN)
    rk = k0 + tl.arange(0, BK)
    c_ptrs = c_ptr + (e.to(tl.int64) * N + rn[:, None]) * K + rk[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rn < N)[:, None] & (rk < K)[None, :])


@triton.jit
def _persistent_tile(t, valid, a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, poff_ptr, tiles_ptr, N, K, MAXJ: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr, EMULATE: tl.constexpr):
    e = tl.load(tiles_ptr + t * 3)
    n0 = tl.load(tiles_ptr + t * 3 + 1) * BN
    k0 = tl.load(tiles_ptr + t * 3 + 2) * BK
    p0 = tl.multiple_of(tl.load(poff_ptr + e), 128).to(tl.int64)
    mp = tl.multiple_of(tl.load(poff_ptr + e + 1) - tl.load(poff_ptr + e), 128).to(tl.int64)
    rn = n0 + tl.arange(0, BN)
    rk = k0 + tl.arange(0, BK)
    nmask = rn < N
    kmask = rk < K
    if TMA:
        acc = _tma_tile_acc(a_ptr, sa_ptr, b_ptr, sb_ptr, p0, mp, N, K, n0, k0, MAXJ, BN, BK, False, False, EMULATE)
    else:  # the package's step (pointer loads, fresh dot, promotion)
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        nj = mp // 128
        if EMULATE:
            for j in range(0, MAXJ):
                acc = _wgrad_step(acc, j, j < nj, a_ptr, b_ptr, sa_ptr, sb_ptr, p0, mp, rn, rk, nmask, kmask, N, K,
                                  EMULATE)
        else:
            for j in range(0, nj):
                acc = _wgrad_step(acc, j, True, a_ptr, b_ptr, sa_ptr, sb_ptr, p0, mp, rn, rk, nmask, kmask, N, K,
                                  EMULATE)
    c_ptrs = c_ptr + (e.to(tl.int64) * N + rn[:, None]) * K + rk[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=nmask[:, None] & kmask[None, :] & valid)


@triton.jit
def wgrad_persistent_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, poff_ptr, tiles_ptr, n_tiles, N, K,
                            MAXJ: tl.constexpr, MAXT: tl.constexpr, NPROG: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, TMA: tl.constexpr, EMULATE: tl.constexpr):
    """(d) persistent: NPROG programs stride over the tile table (int32 [n_tiles, 3] = expert, n tile, k tile)."""
    pid = tl.program_id(0)
    if EMULATE:  # the interpreter's range() needs host ints: MAXT rounds per program, the tail masked
        for i in range(0, MAXT):
            t = pid + i * NPROG
            _persistent_tile(tl.minimum(t, n_tiles - 1), t < n_tiles, a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, poff_ptr,
                             tiles_ptr, N, K, MAXJ, BN, BK, TMA, EMULATE)
    else:
        for t in range(pid, n_tiles, NPROG):
            _persistent_tile(t, True, a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, poff_ptr, tiles_ptr, N, K, MAXJ, BN, BK,
                             TMA, EMULATE)


# ----------------------------------------------------------------------------------------------- launchers


def _fp8(t):
    return t.view(torch.uint8) if INTERPRET else t


_CACHE: dict = {}


def _poff(seg, dev):
    key = ("poff", seg, str(dev))
    if key not in _CACHE:
        _CACHE[key] = torch.tensor(seg.padded_offsets, dtype=torch.int32, device=dev)
    return _CACHE[key]


def _persistent_tiles(seg, n, k, bn, bk, dev):
    """int32 [T, 3] (expert, n tile, k tile): experts by descending padded count (empty ones last: they store
    zeros), k tile outer, n tile inner. Built once per shape (the launchers cache theirs the same way)."""
    key = ("tiles", seg, n, k, bn, bk, str(dev))
    if key not in _CACHE:
        order = sorted(range(seg.num), key=lambda e: -seg.padded_counts[e])
        nt, kt = triton.cdiv(n, bn), triton.cdiv(k, bk)
        tn = torch.arange(nt).repeat(kt)
        tk = torch.arange(kt).repeat_interleave(nt)
        rows = [torch.stack([torch.full_like(tn, e), tn, tk], 1) for e in order]
        _CACHE[key] = torch.cat(rows).to(torch.int32).contiguous().to(dev)
    return _CACHE[key]


def _nprog(dev) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4


def launch(name: str, cfg: dict, a, b, out_dtype=torch.bfloat16) -> torch.Tensor:
    """C [E, N, K] = per expert A_e B_e^T by candidate ``name`` with ``cfg`` (BN, BK, warps, stages, flags)."""
    from fp4moe_kernels.triton_kernels import launchers

    seg = a.segments
    n, k, dev = a.channels, b.channels, a.data.device
    if name == "current":
        saved = launchers.GEMM_TILES["wgrad"]
        launchers.GEMM_TILES["wgrad"] = (cfg["BN"], cfg["BK"], cfg["warps"], cfg["stages"])
        try:
            return launchers.grouped_fp8_wgrad(a, b, out_dtype=out_dtype)
        finally:
            launchers.GEMM_TILES["wgrad"] = saved
    bn, bk = cfg["BN"], cfg["BK"]
    c = torch.empty(seg.num, n, k, dtype=out_dtype, device=dev)
    maxj = max(seg.padded_counts) // 128 if INTERPRET else 0
    args = (_fp8(a.data), a.scales, _fp8(b.data), b.scales, c, _poff(seg, dev))
    meta = dict(num_warps=cfg["warps"], num_stages=cfg["stages"])
    if cfg.get("maxnreg") and not INTERPRET:
        meta["maxnreg"] = cfg["maxnreg"]  # register cap, so that per_sm programs fit on one SM
    if name == "lag1":
        grid = (triton.cdiv(n, bn), triton.cdiv(k, bk), seg.num)
        wgrad_lag1_kernel[grid](*args, n, k, maxj, BN=bn, BK=bk, EMULATE=INTERPRET, **meta)
    elif name == "tma":
        grid = (triton.cdiv(n, bn), triton.cdiv(k, bk), seg.num)
        wgrad_tma_kernel[grid](*args, n, k, maxj, BN=bn, BK=bk, LAG=cfg["LAG"], WS=cfg.get("WS", False),
                               EMULATE=INTERPRET, **meta)
    elif name == "gluon":
        if INTERPRET:
            raise RuntimeError("gluon: no interpreter for Gluon kernels (GPU only)")
        if wgrad_gluon is None:
            raise RuntimeError(f"gluon: import failed: {_GLUON_ERROR}")
        wgrad_gluon.launch(a, b, c, _poff(seg, dev), bn=bn, bk=bk, warps=cfg["warps"], stages=cfg["stages"])
    elif name == "persistent":
        tiles = _persistent_tiles(seg, n, k, bn, bk, dev)
        nprog = min(_nprog(dev) * cfg.get("per_sm", 1), tiles.shape[0])
        maxt = triton.cdiv(tiles.shape[0], nprog) if INTERPRET else 0
        wgrad_persistent_kernel[(nprog,)](*args, tiles, tiles.shape[0], n, k, maxj, maxt, NPROG=nprog, BN=bn, BK=bk,
                                          TMA=cfg["TMA"], EMULATE=INTERPRET, **meta)
    else:
        raise KeyError(name)
    return c


def _c(bn, bk, warps, stages, **flags):
    return dict(BN=bn, BK=bk, warps=warps, stages=stages, **flags)


# (candidate, config) pairs, in the order they run on the GPU. The first is the package's kernel as it ships.
CONFIGS = [
    ("current", _c(64, 128, 4, 3)),
    ("current", _c(128, 128, 8, 3)),
    ("lag1", _c(64, 128, 4, 3)),
    ("lag1", _c(128, 128, 8, 3)),
    ("tma", _c(64, 128, 4, 3, LAG=False)),
    ("tma", _c(64, 128, 4, 4, LAG=False)),
    ("tma", _c(64, 128, 4, 2, LAG=False)),
    ("tma", _c(128, 64, 4, 3, LAG=False)),
    ("tma", _c(128, 128, 8, 3, LAG=False)),
    ("tma", _c(128, 128, 8, 4, LAG=False)),
    ("tma", _c(128, 256, 8, 3, LAG=False)),
    ("tma", _c(64, 128, 4, 3, LAG=True)),
    ("tma", _c(128, 128, 8, 4, LAG=True)),
    ("tma", _c(128, 128, 8, 4, LAG=False, WS=True)),
    ("persistent", _c(64, 128, 4, 3, TMA=True, per_sm=2)),
    ("persistent", _c(64, 128, 4, 3, TMA=True, per_sm=3, maxnreg=168)),
    ("persistent", _c(64, 128, 4, 4, TMA=True, per_sm=2)),
    ("persistent", _c(128, 128, 8, 4, TMA=True, per_sm=1)),
    ("persistent", _c(64, 128, 4, 3, TMA=False, per_sm=2)),
] + [("gluon", _c(bn, bk, warps, stages)) for bn, bk, warps, stages in
     (wgrad_gluon.CONFIGS if wgrad_gluon is not None else [(64, 128, 4, 3)])]

CPU_CONFIGS = [("lag1", _c(64, 128, 4, 3)), ("lag1", _c(128, 256, 8, 3)), ("lag1", _c(128, 128, 8, 3)),
               ("tma", _c(64, 128, 4, 4, LAG=False)), ("tma", _c(128, 256, 8, 3, LAG=True)),
               ("tma", _c(128, 128, 8, 4, LAG=False, WS=True)), ("tma", _c(128, 128, 8, 4, LAG=True)),
               ("persistent", _c(64, 128, 4, 4, TMA=False)), ("persistent", _c(128, 256, 8, 4, TMA=True))]


def label(name, cfg) -> str:
    flags = "".join(f" {k}" for k in ("LAG", "WS", "TMA") if cfg.get(k))
    flags += f" x{cfg['per_sm']}/SM" if "per_sm" in cfg else ""
    flags += f" maxnreg {cfg['maxnreg']}" if "maxnreg" in cfg else ""
    return f"{name} {cfg['BN']}x{cfg['BK']} w{cfg['warps']} s{cfg['stages']}{flags}"


# ----------------------------------------------------------------------------------------------- operands


def counts_v3(e=32, rows=32768, seed=0) -> list[int]:
    """tools/device/bench_deepgemm.py's counts: uneven loads, expert 3 empty, expert 7 with 5 rows."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(e, generator=g) + 0.5
    c = torch.multinomial(p / p.sum(), rows, replacement=True, generator=g).bincount(minlength=e).tolist()
    c[0] += c[3] + c[7] - 5
    c[3] = 0
    c[7] = 5
    return c


def operands(counts, n, k, dev, seed=0):
    """(a, b) FP8ColTensor over ``counts``: dY [M, n] and X [M, k] BF16 randn times 2^u per token (u in -4..4)
    quantized by fp4moe_kernels.convert.bf16_to_fp8_col (the Triton kernel on CUDA, the reference on CPU)."""
    from fp4moe_kernels import convert as kops
    from fp4moe_kernels.formats import Segments

    m = sum(counts)
    seg = Segments.of(counts, m)
    g = torch.Generator(device=dev).manual_seed(seed)

    def src(c):
        f = torch.exp2(torch.randint(-4, 5, (m, 1), device=dev, generator=g).float())
        return (torch.randn(m, c, device=dev, generator=g) * f).to(torch.bfloat16)

    dy, x = src(n), src(k)
    return kops.bf16_to_fp8_col(dy, seg), kops.bf16_to_fp8_col(x, seg), dy, x


def compare(out, ref) -> dict:
    d = (out.float() - ref.float()).abs()
    rel = float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    return {"max_abs_diff": float(d.max()), "rel_diff": rel, "bit_equal": bool(torch.equal(out, ref))}


def _tail(exc) -> str:
    return "".join(traceback.format_exception(exc)).strip().splitlines()[-6:]


# ----------------------------------------------------------------------------------------------- modes


def cpu_check() -> int:
    """Every CPU_CONFIGS candidate against the package's kernel at the same BN x BK (numpy's float32 matmul, which
    the interpreter's dot is, rounds differently per block shape, so only equal tiles can be bit-equal here)."""
    counts, n, k = [0, 5, 300], 256, 384
    a, b, _, _ = operands(counts, n, k, torch.device("cpu"))
    refs = {}
    bad = 0
    print(f"cpu-check (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}): counts {counts}, N={n}, K={k}, "
          f"float32 output, each against `current` at the same BN x BK")
    for name, cfg in CPU_CONFIGS:
        t0 = time.time()
        tile = (cfg["BN"], cfg["BK"])
        try:
            if tile not in refs:
                refs[tile] = launch("current", _c(*tile, 4, 3), a, b, out_dtype=torch.float32)
            out = launch(name, cfg, a, b, out_dtype=torch.float32)
            r = compare(out, refs[tile])
            ok = r["rel_diff"] < 1e-5 and not out[0].any() and (name == "current" or r["bit_equal"])
            bad += not ok
            print(f"  {label(name, cfg):40s} max|diff| {r['max_abs_diff']:.3e} rel {r['rel_diff']:.2e} "
                  f"bit-equal {r['bit_equal']} empty-expert-zero {not out[0].any()} "
                  f"{'OK' if ok else 'FAIL'} ({time.time() - t0:.1f} s)")
        except Exception as exc:
            bad += 1
            print(f"  {label(name, cfg):40s} ERROR\n    " + "\n    ".join(_tail(exc)))
    if (64, 128) in refs and (128, 256) in refs:
        r = compare(refs[(128, 256)], refs[(64, 128)])
        print(f"  (current 128x256 vs current 64x128: max|diff| {r['max_abs_diff']:.3e} rel {r['rel_diff']:.2e}, "
              f"bit-equal {r['bit_equal']}: numpy's block-shape rounding, not a kernel difference)")
    print("  gluon: skipped (Gluon kernels have no interpreter; "
          "`TRITON_INTERPRET=0 python tools/device/wgrad_gluon.py --aot` compiles it for sm_90 on a CPU)")
    print("cpu-check:", "PASS" if not bad else f"{bad} FAILED")
    return 1 if bad else 0


def gpu_run(args) -> dict:
    from triton.testing import do_bench

    from fp4moe.ops.fp8_gemm import fp8_mm
    from fp4moe_kernels import convert as kops

    dev = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    counts = counts_v3()
    m = sum(counts)
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": os.environ.get("FP4MOE_COMMIT"), "counts": counts, "M": m, "rows": [], "errors": {}}
    t_start = time.time()
    for gemm, n, k in (("fc1 wgrad", 4096, 7168), ("fc2 wgrad", 7168, 2048)):
        a, b, dy, x = operands(counts, n, k, dev)
        flops = 2 * m * n * k
        # dense reference of equal work, as src/fp4moe/bench/moe_layer.py's _gemm_compare: one segment of all M rows
        dense_a, dense_b = kops.bf16_to_fp8_col(dy), kops.bf16_to_fp8_col(x)
        del dy, x
        dense_ms = float(do_bench(lambda: fp8_mm(*dense_a.segment(0), *dense_b.segment(0), "wgrad", check=False),
                                  warmup=25, rep=100))
        del dense_a, dense_b
        doc["rows"].append({"gemm": gemm, "N": n, "K": k, "candidate": "dense F.scaled_mm (M x N x K)",
                            "ms": dense_ms, "tflops": flops / dense_ms / 1e9, "x_dense": 1.0})
        print(json.dumps(doc["rows"][-1]), flush=True)
        ref = launch(*CONFIGS[0], a, b)
        refs = {(CONFIGS[0][1]["BN"], CONFIGS[0][1]["BK"]): ref}
        torch.cuda.synchronize()
        cur_ms = None
        for name, cfg in CONFIGS:
            lab = label(name, cfg)
            row = {"gemm": gemm, "N": n, "K": k, "candidate": lab, "config": cfg}
            if args.only and not any(s in lab for s in args.only):
                continue
            if time.time() - t_start > args.budget_s:
                row["error"] = f"skipped: past the {args.budget_s} s budget"
                doc["rows"].append(row)
                continue
            try:
                t0 = time.time()
                out = launch(name, cfg, a, b)
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.time() - t0, 2)  # compile (first shape) + one run
                row.update(compare(out, ref))
                tile = (cfg["BN"], cfg["BK"])
                if name == "current":
                    refs.setdefault(tile, out)
                elif tile in refs and refs[tile] is not ref:  # also against `current` at the same BN x BK
                    row.update({f"{kk}_same_tile": v for kk, v in compare(out, refs[tile]).items()})
                row["empty_expert_zero"] = not bool(out[3].any())
                del out
                ms = float(do_bench(lambda: launch(name, cfg, a, b), warmup=25, rep=100))
                cur_ms = ms if cur_ms is None else cur_ms
                row.update(ms=ms, tflops=flops / ms / 1e9, x_dense=dense_ms / ms, x_current=cur_ms / ms)
            except Exception as exc:
                row["error"] = "\n".join(_tail(exc))
                doc["errors"][f"{gemm} {lab}"] = row["error"]
                print(f"{gemm} {lab} FAILED:\n" + row["error"], flush=True)
                torch.cuda.synchronize()
            doc["rows"].append(row)
            print(json.dumps({kk: v for kk, v in row.items() if kk != "config"}), flush=True)
        del a, b, ref, refs
        torch.cuda.empty_cache()
    doc["wall_s"] = round(time.time() - t_start, 1)
    return doc


def markdown(doc) -> str:
    L = [f"# Grouped FP8 wgrad candidates ({doc['gpu']}, torch {doc['torch']}, triton {doc['triton']}, "
         f"code {doc['commit']})", "",
         f"M = {doc['M']} routed rows over {len(doc['counts'])} experts {doc['counts']}; TFLOP/s count 2 M N K; "
         f"diff against `current` at the package's tiles (bf16 output); wall {doc.get('wall_s')} s.", "",
         "| GEMM | candidate | ms | TFLOP/s | x dense | x current | max abs diff | bit-equal | empty expert 0 | first call s |",
         "|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    def same(r):
        if "bit_equal_same_tile" not in r:
            return ""
        return f" (same tile: {r['bit_equal_same_tile']}, {r['max_abs_diff_same_tile']:.1e})"

    for r in doc["rows"]:
        if "error" in r:
            L.append(f"| {r['gemm']} | {r['candidate']} | error: {r['error'].splitlines()[-1][:120]} | | | | | | | |")
            continue
        L.append(f"| {r['gemm']} | {r['candidate']} | {f(r.get('ms'), '.3f')} | {f(r.get('tflops'), '.1f')} | "
                 f"{f(r.get('x_dense'), '.3f')} | {f(r.get('x_current'), '.3f')} | {f(r.get('max_abs_diff'), '.3e')} | "
                 f"{r.get('bit_equal', '')}{same(r)} | {r.get('empty_expert_zero', '')} | {r.get('first_call_s', '')} |")
    for kk, v in doc["errors"].items():
        L += ["", f"**{kk}**:", "```", v, "```"]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/kernels/wgrad", help="folder for wgrad_<gpu>.md / .json")
    p.add_argument("--cpu-check", action="store_true", help="every candidate under the interpreter, small shape")
    p.add_argument("--only", nargs="*", help="run only candidates whose label contains one of these strings")
    p.add_argument("--budget-s", type=float, default=240.0, help="skip the remaining candidates after this many s")
    args = p.parse_args(argv)
    if args.cpu_check:
        return cpu_check()
    if not torch.cuda.is_available():
        sys.exit("bench_wgrad: needs a CUDA GPU (Hopper); --cpu-check runs on the CPU")
    doc = gpu_run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from fp4moe.bench.moe_layer import gpu_slug

    slug = gpu_slug(doc["gpu"])
    (out / f"wgrad_{slug}.json").write_text(json.dumps(doc, indent=1))
    (out / f"wgrad_{slug}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
