"""Issue P8, candidate ``gluon``: the grouped FP8 weight-gradient GEMM in Gluon, with one wgmma in flight across
the promotion (ping-pong between two partial accumulators of one warpgroup).

Why Gluon. Triton 3.6 on sm_90 waits for every wgmma (``wgmma.wait_group 0``) before a promotion that reads its
result, so the tensor cores idle while the CUDA cores promote (results/moe_layer/README.md, section "The grouped
wgrad"); neither a lag-one formulation in plain Triton nor ``warp_specialize`` changed the PTX. Gluon exposes the
wait: ``warpgroup_mma_wait(num_outstanding=1, ...)``.

What the kernel computes: as the package's ``grouped_wgrad_tma_kernel``
(kernels/fp4moe_kernels/triton_kernels/gemm.py), per expert e with token segment [p0, p0 + mp) (mp a multiple of
128), C_e[N, K] = sum over 128-token blocks j, in order j = 0, 1, ..., of ``acc + (part_j * sa_j[:, None]) *
sb_j[None, :]`` with part_j = A_j[BN, 128] @ B_j[BK, 128]^T (FP8 E4M3, FP32 accumulation), the same promotion
expression and the same summation order as ``_promote``, so the output is meant to be bit-equal to the package's.

Structure (one program per (n tile, k tile, expert); grid and operands as the package's kernel):

* per-expert device-side TMA descriptors (``tma.make_tensor_descriptor``: base ``+ N * p0``, shape ``[N, mp]``,
  strides ``[mp, 1]``, block ``[BN, 128]`` / ``[BK, 128]``; rows past N / K read as zero), built only when the
  expert has rows (an empty expert gets no descriptor; its tile is stored as zeros). A host-side descriptor over the
  whole array cannot express the layout: each expert's [N, mp] block has its own row stride mp. The scratch for the
  descriptors comes from ``triton.set_allocator`` as for the package's TMA kernel;
* a ring of STAGES shared-memory stages (A [BN, 128] + B [BK, 128] FP8 each) with one mbarrier per stage
  (``expect`` + two TMA loads; block j lives in stage j % STAGES, phase (j // STAGES) & 1); the prologue loads
  blocks 0 .. STAGES-1;
* block 0: wgmma, wait(0). Main loop, two blocks per iteration (j = 1, 3, 5, ...; the complete, not yet promoted
  partial of block j-1 carried in): wait for block j's tiles, issue its wgmma asynchronously into a fresh accumulator
  (``use_acc=False``); refill block j-1's stage with block j-1+STAGES; promote block j-1 (overlaps block j's wgmma);
  issue block j+1's wgmma (queued behind block j's: no tensor-core gap); ``warpgroup_mma_wait(num_outstanding=1)``:
  block j complete, block j+1 in flight; refill block j's stage; promote block j (overlaps block j+1's wgmma);
  ``wait(0)``: block j+1's partial, carried to the next iteration. Tail: an even block count runs block nj-1 during
  block nj-2's promotion; the last partial is promoted after the loop. No wgmma is in flight across the loop's back
  edge: with an in-flight accumulator carried (the plain lag-one loop with wait(1) at the same place every
  iteration, tried first) LLVM copies the in-flight registers at the phi and ptxas serializes every wgmma (C7514,
  "non wgmma instructions reading accumulator registers"); the cost is one wait(0) per two blocks;
* store bf16 / fp32 [E, N, K] straight from the wgmma register layout, masked at the N and K edges.

Registers: the running accumulator, the partial being promoted and the partial in flight (3 x BN*BK/128 FP32 per
thread at one warpgroup: 192 at 64x128 / 128x64) plus the scales. 128x64 at 4 warps compiles to 255 registers
without spills; 64x128 spills (its 128 K scales per block are 32 values and 32 addresses per thread against 16 at
128x64), so 128x64 is the first config.

``python tools/device/wgrad_gluon.py --aot`` (TRITON_INTERPRET=0, no GPU needed) compiles the kernel for sm_90a and
prints registers, spills, shared memory, the ptxas wgmma-serialization warning if any, and the census of
``wgmma.wait_group`` by argument in the PTX (and ``WARPGROUP.DEPBAR`` in the SASS); it exits non-zero on a compile
error, a spill or a serialized wgmma. Gluon has no interpreter: the kernel runs on a Hopper GPU only
(tools/device/bench_wgrad.py times it and checks it bit for bit against the package's kernel).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as ttgl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

# (BN, BK, num_warps, STAGES), bench_wgrad.py runs them all; --aot compiles the first (--all: every one). At sm_90:
# 128x64 w4 255 regs / 0 spill; 64x64 w4 180 / 0; 64x128 w4 (the package's tile) and 128x128 w8 spill (536 / 248 B);
# two warpgroups (8 warps, each its own 64 rows): 128x64 222 / 0, 256x64 255 / 0
CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (256, 64, 8, 3), (128, 64, 4, 4), (128, 64, 4, 2), (64, 64, 4, 4),
           (64, 128, 4, 3), (128, 128, 8, 3)]


@gluon.constexpr_function
def _warps_per_cta(BN, num_warps):
    """wgmma warps: the [4, 1] atom, doubled along N (16 rows per warp) while that does not broadcast, then along K."""
    w = [4, 1]
    while w[0] * w[1] != num_warps:
        if BN > 16 * w[0]:
            w[0] *= 2
        else:
            w[1] *= 2
    return w


@gluon.constexpr_function
def _instr_n(BN, BK, num_warps):
    """The largest wgmma n (multiple of 8, <= 256) that divides BK and fits the warps along K."""
    reps_n = triton.cdiv(num_warps, triton.cdiv(BN, 16))
    max_n = max(BK // reps_n, 8)
    n = 256
    while n > max_n or BK % n != 0:
        n -= 8
    return n


@gluon.jit
def _issue_load(adesc, bdesc, a_s, b_s, bars, jb, n0, k0, pred, STAGES: ttgl.constexpr, NBYTES: ttgl.constexpr):
    """TMA loads of token block jb's A and B tiles into stage jb % STAGES (skipped where not pred)."""
    s = jb % STAGES
    bar = bars.index(s)
    mbarrier.expect(bar, NBYTES, pred=pred)
    tma.async_copy_global_to_shared(adesc, [n0, jb * 128], bar, a_s.index(s), pred=pred)
    tma.async_copy_global_to_shared(bdesc, [k0, jb * 128], bar, b_s.index(s), pred=pred)


@gluon.jit
def _issue_mma(a_s, b_s, bars, j, zero, STAGES: ttgl.constexpr):
    """Wait for block j's tiles, then start its wgmma asynchronously into a fresh accumulator; returns the token."""
    s = j % STAGES
    mbarrier.wait(bars.index(s), (j // STAGES) & 1)
    return warpgroup_mma(a_s.index(s), b_s.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _scales(j, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask, N, K):
    """1x128 scales of token block j, as the package's _promote loads them."""
    sa = ttgl.load(sa_ptr + (p0 // 128 + j) * N + rn, mask=nmask, other=0.0)
    sb = ttgl.load(sb_ptr + (p0 // 128 + j) * K + rk, mask=kmask, other=0.0)
    return sa, sb


@gluon.jit
def wgrad_gluon_kernel(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, poff_ptr, N, K,
                       BN: ttgl.constexpr, BK: ttgl.constexpr, STAGES: ttgl.constexpr, num_warps: ttgl.constexpr):
    e = ttgl.program_id(2)
    n0 = ttgl.program_id(0) * BN
    k0 = ttgl.program_id(1) * BK
    p0 = ttgl.multiple_of(ttgl.load(poff_ptr + e), 128).to(ttgl.int64)
    mp = ttgl.multiple_of(ttgl.load(poff_ptr + e + 1) - ttgl.load(poff_ptr + e), 128).to(ttgl.int64)
    nj = (mp // 128).to(ttgl.int32)

    mma: ttgl.constexpr = ttgl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=_warps_per_cta(BN, num_warps),
                                                     instr_shape=[16, _instr_n(BN, BK, num_warps), 32])
    a_layout: ttgl.constexpr = ttgl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    b_layout: ttgl.constexpr = ttgl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    NBYTES: ttgl.constexpr = (BN + BK) * 128

    rn = n0 + ttgl.arange(0, BN, layout=ttgl.SliceLayout(1, mma))
    rk = k0 + ttgl.arange(0, BK, layout=ttgl.SliceLayout(0, mma))
    nmask = rn < N
    kmask = rk < K
    acc = ttgl.zeros([BN, BK], ttgl.float32, layout=mma)

    a_s = ttgl.allocate_shared_memory(ttgl.float8e4nv, [STAGES, BN, 128], a_layout)
    b_s = ttgl.allocate_shared_memory(ttgl.float8e4nv, [STAGES, BK, 128], b_layout)
    bars = ttgl.allocate_shared_memory(ttgl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in ttgl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)

    if nj > 0:  # an empty expert gets no descriptor (a zero-sized box); its tile is stored as zeros
        adesc = tma.make_tensor_descriptor(a_ptr + N * p0, shape=[N, mp.to(ttgl.int32)], strides=[mp, 1],
                                           block_shape=[BN, 128], layout=a_layout)
        bdesc = tma.make_tensor_descriptor(b_ptr + K * p0, shape=[K, mp.to(ttgl.int32)], strides=[mp, 1],
                                           block_shape=[BK, 128], layout=b_layout)
        for s in ttgl.static_range(STAGES):
            _issue_load(adesc, bdesc, a_s, b_s, bars, s, n0, k0, s < nj, STAGES, NBYTES)
        # Two blocks per iteration, and no wgmma in flight across the loop's back edge: an in-flight accumulator
        # carried to the next iteration is copied by LLVM's phi moves, and ptxas then serializes every wgmma
        # (C7514). The partial carried from one iteration to the next (block j-1's) is complete, not yet promoted.
        # Block 0 first (the only wait without a promotion to overlap):
        zero = ttgl.zeros([BN, BK], ttgl.float32, layout=mma)  # not read: use_acc=False
        part = warpgroup_mma_wait(num_outstanding=0, deps=[_issue_mma(a_s, b_s, bars, 0, zero, STAGES)])
        for i in range(0, (nj - 1) // 2):
            j = 2 * i + 1
            tok_a = _issue_mma(a_s, b_s, bars, j, zero, STAGES)  # block j runs while block j-1 is promoted
            _issue_load(adesc, bdesc, a_s, b_s, bars, j - 1 + STAGES, n0, k0, j - 1 + STAGES < nj, STAGES, NBYTES)
            sa, sb = _scales(j - 1, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask, N, K)
            acc = acc + (part * sa[:, None]) * sb[None, :]
            tok_b = _issue_mma(a_s, b_s, bars, j + 1, zero, STAGES)  # queued behind block j: no tensor-core gap
            sa, sb = _scales(j, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask, N, K)
            part_a = warpgroup_mma_wait(num_outstanding=1, deps=[tok_a])  # block j done, block j+1 in flight
            _issue_load(adesc, bdesc, a_s, b_s, bars, j + STAGES, n0, k0, j + STAGES < nj, STAGES, NBYTES)
            acc = acc + (part_a * sa[:, None]) * sb[None, :]  # block j, while block j+1 runs
            part = warpgroup_mma_wait(num_outstanding=0, deps=[tok_b])
        if (nj - 1) % 2 == 1:  # an even block count: block nj-1 left, run while block nj-2 is promoted
            tok_a = _issue_mma(a_s, b_s, bars, nj - 1, zero, STAGES)
            sa, sb = _scales(nj - 2, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask, N, K)
            acc = acc + (part * sa[:, None]) * sb[None, :]
            part = warpgroup_mma_wait(num_outstanding=0, deps=[tok_a])
        sa, sb = _scales(nj - 1, sa_ptr, sb_ptr, p0, rn, rk, nmask, kmask, N, K)
        acc = acc + (part * sa[:, None]) * sb[None, :]

    for s in ttgl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    c_ptrs = c_ptr + (e.to(ttgl.int64) * N + rn[:, None]) * K + rk[None, :]
    ttgl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=nmask[:, None] & kmask[None, :])


def launch(a, b, c, poff, bn=64, bk=128, warps=4, stages=3):
    """C [E, N, K] (preallocated ``c``, bf16 or fp32) = per expert A_e B_e^T; ``a``, ``b`` FP8ColTensor, ``poff`` the
    experts' int32 padded row offsets (E + 1) on the device. Needs ``triton.set_allocator`` (descriptor scratch)."""
    seg = a.segments
    n, k = a.channels, b.channels
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk), seg.num)
    wgrad_gluon_kernel[grid](a.data, a.scales, b.data, b.scales, c, poff, n, k, BN=bn, BK=bk, STAGES=stages,
                             num_warps=warps)
    return c


# ----------------------------------------------------------------------------------------------- AOT (CPU)

SIG = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "c_ptr": "*bf16",
       "poff_ptr": "*i32", "N": "i32", "K": "i32", "BN": "constexpr", "BK": "constexpr", "STAGES": "constexpr",
       "num_warps": "constexpr"}


def aot(bn=64, bk=128, warps=4, stages=3) -> dict:
    """Compile for sm_90a on the CPU: registers, spills, shared memory, wgmma wait census (PTX and SASS)."""
    from fp4moe_kernels.triton_kernels.aot import sm90_sass
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(SIG.values()) if t.startswith("*")}
    src = GluonASTSource(fn=wgrad_gluon_kernel, signature=SIG,
                         constexprs={"BN": bn, "BK": bk, "STAGES": stages, "num_warps": warps}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx_text = compiled.asm["ptx"]
    out, sass = sm90_sass(ptx_text)
    waits = collections.Counter(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx_text))
    depbar = collections.Counter(re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)", sass))
    serialized = [ln.strip() for ln in out.splitlines() if "serialized" in ln]
    return {
        "config": {"BN": bn, "BK": bk, "warps": warps, "stages": stages},
        "registers": int(re.search(r"Used (\d+) registers", out).group(1)),
        "spill_bytes": sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out)),
        "shared_bytes": compiled.metadata.shared,
        "global_scratch_bytes": getattr(compiled.metadata, "global_scratch_size", None),
        "ptx_wgmma_mma_async": len(re.findall(r"wgmma\.mma_async", ptx_text)),
        "ptx_wgmma_wait_group": {f"wait_group {k}": v for k, v in sorted(waits.items())},
        "sass_WARPGROUP.DEPBAR.LE": {f"gsb0, {k}": v for k, v in sorted(depbar.items())},
        "sass_HGMMA/QGMMA": len(re.findall(r"\b[HQ]GMMA\.", sass)),
        "ptxas_serialization_warnings": serialized,
        "_ptx": ptx_text,
        "_sass": sass,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--aot", action="store_true", help="compile for sm_90a on the CPU and print the report")
    p.add_argument("--all", action="store_true", help="every config in CONFIGS (default: the first)")
    p.add_argument("--dump", help="folder to write each config's PTX and SASS into")
    args = p.parse_args(argv)
    if not args.aot:
        p.error("only --aot is available here; tools/device/bench_wgrad.py runs the kernel on a GPU")
    bad = 0
    for cfg in (CONFIGS if args.all else CONFIGS[:1]):
        try:
            r = aot(*cfg)
        except Exception as exc:  # a compile error: print it whole, fail
            import traceback
            traceback.print_exception(exc)
            bad += 1
            continue
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            tag = "bn{}_bk{}_w{}_s{}".format(*cfg)
            for kind in ("ptx", "sass"):
                with open(os.path.join(args.dump, f"wgrad_gluon_{tag}.{kind}"), "w") as fh:
                    fh.write(r[f"_{kind}"])
        bad += r["spill_bytes"] > 0 or bool(r["ptxas_serialization_warnings"])
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
