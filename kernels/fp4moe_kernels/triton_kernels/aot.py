"""Compile the kernels for Hopper (sm_90) without a GPU: ``python -m fp4moe_kernels.triton_kernels.aot``.

Run it with ``TRITON_INTERPRET=0`` (under the interpreter ``triton.jit`` yields no compilable kernels).

Uses Triton's own ptxas/cuobjdump (shipped in the triton wheel). Reports, per kernel, registers, spill
bytes, shared memory and a SASS instruction census (memory ops, FP8 conversions), so that a compile
error, a register spill or a lost vector load shows up on a CPU machine before any GPU time is spent.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import col, fused_swiglu, gemm, launchers, permute, row, weight

_FP8 = {"M": "i32", "K": "constexpr", "R": "constexpr"}

# kernel name -> (jit function, signature: argument name -> Triton type or "constexpr")
KERNELS = {
    "bf16_to_fp4_row": (row.bf16_to_fp4_row_kernel,
                        {"x_ptr": "*i32", "q_ptr": "*u8", "s_ptr": "*u8", "NB": "i32", "R": "constexpr",
                         "RULE_CEIL": "constexpr", "X_BF16": "constexpr", "EMULATE": "constexpr"}),
    "fp4_to_bf16": (row.fp4_to_bf16_kernel,
                    {"q_ptr": "*u8", "s_ptr": "*u8", "o_ptr": "*i32", "NB": "i32", "R": "constexpr",
                     "EMULATE": "constexpr"}),
    "bf16_to_fp8_row": (row.bf16_to_fp8_row_kernel,
                        {"x_ptr": "*i32", "q_ptr": "*i16", "s_ptr": "*fp32", "row_seg_ptr": "*i32",
                         "seg_off_ptr": "*i32", **_FP8, "SINGLE_SEGMENT": "constexpr", "EMULATE": "constexpr",
                         "X_BF16": "constexpr"}),
    "bf16_to_fp4_and_fp8_row": (row.bf16_to_fp4_and_fp8_row_kernel,
                                {"x_ptr": "*i32", "q4_ptr": "*u8", "s4_ptr": "*u8", "q8_ptr": "*i16", "s8_ptr": "*fp32",
                                 "row_seg_ptr": "*i32", "seg_off_ptr": "*i32", **_FP8, "RULE_CEIL": "constexpr",
                                 "SINGLE_SEGMENT": "constexpr", "EMULATE": "constexpr", "X_BF16": "constexpr"}),
    "fp4_row_to_fp8_row": (row.fp4_row_to_fp8_row_kernel,
                           {"q_ptr": "*u8", "s_ptr": "*u8", "o_ptr": "*i16", "os_ptr": "*fp32", "row_seg_ptr": "*i32",
                            "seg_off_ptr": "*i32", **_FP8, "SINGLE_SEGMENT": "constexpr", "EMULATE": "constexpr"}),
    "fp8_row_to_fp4": (row.fp8_row_to_fp4_kernel,
                       {"q_ptr": "*i16", "s_ptr": "*fp32", "row_seg_ptr": "*i32", "seg_off_ptr": "*i32",
                        "o_ptr": "*u8", "os_ptr": "*u8", **_FP8, "RULE_CEIL": "constexpr",
                        "SINGLE_SEGMENT": "constexpr", "EMULATE": "constexpr"}),
    "fp4_row_to_fp8_col": (col.fp4_row_to_fp8_col_kernel,
                           {"q_ptr": "*u8", "s_ptr": "*u8", "o_ptr": "*u8", "os_ptr": "*fp32", "tiles_ptr": "*i32",
                            "K": "constexpr", "BN": "constexpr", "EMULATE": "constexpr"}),
    "bf16_to_fp8_col": (col.bf16_to_fp8_col_kernel,
                        {"x_ptr": "*i32", "o_ptr": "*i32", "os_ptr": "*fp32", "tiles_ptr": "*i32",
                         "K": "constexpr", "BN": "constexpr", "EMULATE": "constexpr", "X_BF16": "constexpr"}),
    "bf16_to_fp8_row_col": (col.bf16_to_fp8_row_col_kernel,
                            {"x_ptr": "*i16", "q_ptr": "*u8", "qs_ptr": "*fp32", "o_ptr": "*u8", "os_ptr": "*fp32",
                             "tiles_ptr": "*i32", "K": "constexpr", "BN": "constexpr", "EMULATE": "constexpr",
                             "X_BF16": "constexpr"}),
    "quantize_weight_128x128": (weight.quantize_weight_128x128_kernel,
                                {"w_ptr": "*i16", "off_ptr": "*i64", "q_ptr": "*i16", "s_ptr": "*fp32", "qt_ptr": "*u8",
                                 "st_ptr": "*fp32", "K": "constexpr", "N": "constexpr", "TRANSPOSE": "constexpr",
                                 "EMULATE": "constexpr", "UNIT": "constexpr"}),
    "swiglu_fwd": (fused_swiglu._swiglu_fwd_kernel,
                   {"h_ptr": "*bf16", "p_ptr": "*fp32", "z_ptr": "*i16", "T": "i32", "F": "constexpr",
                    "HAS_P": "constexpr", "BT": "constexpr", "BF": "constexpr"}),
    "swiglu_bwd": (fused_swiglu._swiglu_bwd_kernel,
                   {"h_ptr": "*bf16", "dz_ptr": "*bf16", "p_ptr": "*fp32", "dh_ptr": "*i16", "dp_ptr": "*fp32",
                    "T": "i32", "F": "constexpr", "HAS_P": "constexpr", "BT": "constexpr", "BF": "constexpr"}),
    "swiglu_fwd_fp4": (fused_swiglu._swiglu_fwd_fp4_kernel,
                       {"h_ptr": "*i32", "p_ptr": "*fp32", "z_ptr": "*i32", "q_ptr": "*u8", "s_ptr": "*u8", "NB": "i32",
                        "F": "constexpr", "HAS_P": "constexpr", "RULE_CEIL": "constexpr", "R": "constexpr",
                        "EMULATE": "constexpr"}),
    "swiglu_bwd_fp4": (fused_swiglu._swiglu_bwd_fp4_kernel,
                       {"q_ptr": "*u8", "s_ptr": "*u8", "dz_ptr": "*bf16", "p_ptr": "*fp32", "dh_ptr": "*i16",
                        "dp_ptr": "*fp32", "T": "i32", "F": "constexpr", "HAS_P": "constexpr", "BT": "constexpr",
                        "BF": "constexpr"}),
    "swiglu_bwd_fp4_blocks": (fused_swiglu._swiglu_bwd_fp4_blocks_kernel,
                              {"q_ptr": "*u8", "s_ptr": "*u8", "dz_ptr": "*i32", "p_ptr": "*fp32", "dh_ptr": "*i32",
                               "dp_ptr": "*fp32", "T": "i32", "F": "constexpr", "HAS_P": "constexpr", "CB": "constexpr",
                               "RPP": "constexpr"}),
    "swiglu_fwd_fp8": (fused_swiglu._swiglu_fp8_kernel,
                       {"h_ptr": "*bf16", "p_ptr": "*fp32", "q_ptr": "*u8", "qs_ptr": "*fp32", "o_ptr": "*u8",
                        "os_ptr": "*fp32", "tiles_ptr": "*i32", "F": "constexpr", "BN": "constexpr", "HAS_P": "constexpr",
                        "COLS": "constexpr", "EMULATE": "constexpr"}),
    "swiglu_bwd_fp8": (fused_swiglu._swiglu_bwd_fp8_kernel,
                       {"h_ptr": "*bf16", "hs_ptr": "*u8", "dz_ptr": "*bf16", "p_ptr": "*fp32", "q_ptr": "*u8",
                        "qs_ptr": "*fp32", "o_ptr": "*u8", "os_ptr": "*fp32", "dp_ptr": "*fp32", "tiles_ptr": "*i32",
                        "T": "i32", "F": "constexpr", "BN": "constexpr", "HAS_P": "constexpr", "H_FP4": "constexpr",
                        "COLS": "constexpr", "EMULATE": "constexpr"}),
    "gather_sum_rows": (permute.gather_sum_rows_kernel,
                        {"g_ptr": "*i16", "order_ptr": "*i64", "out_ptr": "*i16", "T": "i32", "H": "constexpr",
                         "K": "constexpr", "BT": "constexpr", "BH": "constexpr"}),
    "grouped_fp8_rows": (gemm.grouped_rows_kernel,
                         {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "c_ptr": "*bf16",
                          "tiles_ptr": "*i32", "seg_off_ptr": "*i32", "N": "i32", "n_tiles": "i32", "KC": "constexpr",
                          "BM": "constexpr", "BN": "constexpr", "GROUP_M": "constexpr", "EMULATE": "constexpr"}),
    "grouped_fp8_wgrad": (gemm.grouped_wgrad_kernel,
                          {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "c_ptr": "*bf16",
                           "coff_ptr": "*i64", "poff_ptr": "*i32", "N": "i32", "K": "i32", "MAXJ": "constexpr",
                           "BN": "constexpr", "BK": "constexpr", "EMULATE": "constexpr", "ACCUMULATE": "constexpr"}),
}


# Spill bytes accepted per kernel with the launcher's tile, each measured faster than the spill-free tiles.
# fp4_row_to_fp8_col at one warp (128 tokens x 32 channels per warp): 362 us against 484 us at four warps
# (H200 sweep, results/kernels/kernels_h200_2026-12-01_52fe029.json); only its general path spills, the fast
# path alone compiles without. Two rewrites with fewer registers were slower on the H200 (results/kernels/README.md,
# 2026-12-01 second section): the two paths as two launches (1.27x the time, kernels_h200_2026-12-01_split-col) and
# one integer path for every element (1.18x, kernels_h200_2026-12-01_single-path-col).
SPILL_ALLOWED = {"fp4_row_to_fp8_col": 1024}


def _gemm_consts(name: str, k: int) -> tuple[dict, int, int]:
    """(constexprs, num_warps, num_stages) of a grouped GEMM kernel at contraction ``k``, the launcher's tiles."""
    if name == "grouped_fp8_rows":
        bm, bn, group_m, warps, stages = launchers.GEMM_TILES["rows"]
        return {"KC": k, "BM": bm, "BN": bn, "GROUP_M": group_m, "EMULATE": False}, warps, stages
    bn, bk, warps, stages = launchers.GEMM_TILES["wgrad"]
    return {"MAXJ": 0, "BN": bn, "BK": bk, "EMULATE": False, "ACCUMULATE": False}, warps, stages


@dataclass
class Report:
    kernel: str
    config: dict
    registers: int
    spill_bytes: int
    shared_bytes: int
    sass: dict  # instruction class -> count

    def line(self) -> str:
        s = " ".join(f"{k}={v}" for k, v in self.sass.items())
        return (f"{self.kernel:26s} {self.config} regs={self.registers} spill={self.spill_bytes}B "
                f"smem={self.shared_bytes}B {s}")


def _bin(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def sm90_sass(ptx: str) -> tuple[str, str]:
    """(``ptxas -v`` log, ``cuobjdump -sass`` listing) of ``ptx`` assembled for sm_90a by Triton's bundled ptxas."""
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
        with open(src, "w") as fh:
            fh.write(ptx)
        log = subprocess.run([_bin("ptxas"), "-arch=sm_90a", "-v", src, "-o", cubin], capture_output=True, text=True,
                             check=True).stderr
        sass = subprocess.run([_bin("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return log, sass


def compile_kernel(name: str, k: int = 7168, tile=None, **flags) -> Report:
    """Compile kernel ``name`` for sm_90 with channel count ``k`` and the launcher's tile (or ``tile``)."""
    fn, sig = KERNELS[name]
    stages = 3
    if name.startswith("grouped_fp8_"):
        consts, warps, stages = _gemm_consts(name, k)
    elif name == "gather_sum_rows":  # k = H; top-8 rows per token, the launcher's tile
        bt, bh, warps = tile or permute.TILE
        consts = {"H": k, "K": flags.get("K", 8), "BT": bt, "BH": bh}
    elif name.startswith("swiglu_"):  # k = the FFN width F, the launcher's tiles, weighted by routing probabilities
        bt, bf, warps = fused_swiglu.FWD_TILE if name.startswith("swiglu_fwd") else fused_swiglu.BWD_TILE
        consts = {"F": k, "HAS_P": flags.get("HAS_P", True), "BT": bt, "BF": bf}
        if name == "swiglu_fwd_fp4":
            r, warps = tile or fused_swiglu.FWD_FP4_TILE
            consts = {"F": k, "HAS_P": flags.get("HAS_P", True), "RULE_CEIL": flags.get("RULE_CEIL", True), "R": r,
                      "EMULATE": False}
        if name in ("swiglu_fwd_fp8", "swiglu_bwd_fp8"):  # k = F; with columns, weighted; the backward from BF16 h
            bn, warps = tile or (fused_swiglu.FWD_FP8_TILE if name == "swiglu_fwd_fp8" else fused_swiglu.BWD_FP8_TILE)
            consts = {"F": k, "BN": bn, "HAS_P": flags.get("HAS_P", True), "COLS": flags.get("COLS", True),
                      "EMULATE": False}
            if name == "swiglu_bwd_fp8":
                consts["H_FP4"] = flags.get("H_FP4", False)
                if consts["H_FP4"]:  # h's MXFP4 data as bytes
                    sig = {**sig, "h_ptr": "*u8"}
        if name == "swiglu_bwd_fp4_blocks":
            cb, rpp, warps = tile or fused_swiglu.BWD_FP4_BLOCKS_TILE
            consts = {"F": k, "HAS_P": flags.get("HAS_P", True), "CB": cb, "RPP": rpp}
    else:
        size, _, warps = tile or launchers.TILES[name]
        consts = {"K": k, "EMULATE": False, "BN": size, "R": size, "N": 4096}
        for c in ("RULE_CEIL", "X_BF16", "SINGLE_SEGMENT", "TRANSPOSE"):
            if c in sig:
                consts[c] = flags.get(c, True)
        if "UNIT" in sig:  # the weight quantizer's expert alignment in elements: 8 (16 B, the usual case) or flags'
            consts["UNIT"] = flags.get("UNIT", 8)
        consts = {c: v for c, v in consts.items() if c in sig}
    # the JIT specializes 16-byte-aligned pointers (torch allocations are); say so, or loads stay scalar
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t.startswith("*")}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    out, sass = sm90_sass(compiled.asm["ptx"])
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", out))
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\d+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M)
    census = {
        "instr": len(ops),
        "LDG": sum(o.startswith("LDG") for o in ops),
        "STG": sum(o.startswith("STG") for o in ops),
        "LDL/STL": sum(o.startswith(("LDL", "STL")) for o in ops),
        "F2FP": sum(o.startswith("F2FP") for o in ops),
        "wide LDG/STG": sum(o.startswith(("LDG", "STG")) and (".128" in o or ".64" in o) for o in ops),
        "ops": sorted(set(o for o in ops if o.startswith(("LDG", "STG")))),
    }
    return Report(name, consts, regs, spill, compiled.metadata.shared, census)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp4moe_kernels.triton_kernels.aot", description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=7168, help="channels (default 7168)")
    p.add_argument("--json", action="store_true", help="print one JSON report per line instead of text")
    p.add_argument("kernels", nargs="*", default=list(KERNELS), help="kernel names (default all)")
    args = p.parse_args(argv)
    bad = 0
    for name in args.kernels:
        r = compile_kernel(name, args.k)
        bad += r.spill_bytes > SPILL_ALLOWED.get(name, 0)
        print(json.dumps(dataclasses.asdict(r)) if args.json else r.line())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
