"""Issue 28 (P8), a maintained library measured before writing our own: DeepGEMM's grouped FP8 GEMMs (PyPI
``deepinfer-gemm``, an sdist: built here with torch's extension loader, its kernels JIT-compiled by NVCC) against
fp4moe's grouped Triton kernels and one dense ``F.scaled_mm`` of equal work, on one Hopper GPU.

Shapes: DeepSeek-V3's routed experts on one GPU (32 experts, top-8 of 4096 tokens = 32768 rows, H 7168, F 2048;
fc1 = gate+up N 4096), with one empty and one 5-row expert among ragged counts. Scales as the recipe has them:
activations 1x128 FP32 powers of two, weights 128x128 (fprop / dgrad); wgrad both operands 1x128 along tokens
(fp4moe's column layout, tokens padded to 128 per expert). DeepGEMM's m-grouped kernel needs each expert's rows
padded to its alignment (``m_indices`` -1 on the padding): the padding copy is timed apart (``pad_ms``).
TFLOP/s count the real rows only (2 M N K). ``rel_err``: ||out - ref|| / ||ref|| against an FP32 product of the
dequantized operands over three experts (the largest, the 5-row one, a typical one).

    python tools/device/bench_deepgemm.py --sdist build/deepgemm/deepinfer_gemm-2.8.2.tar.gz --out $OUT/deepgemm

Carried in build/deepgemm/: the sdist and include/ (elfutils' headers: ``apt-get download libdw-dev libelf-dev``,
``dpkg-deb -x`` each, copy usr/include), which the sdist's C++ includes and the GPU image lacks.

Writes ``deepgemm_<gpu>.json`` and ``.md`` (build time, each candidate's ms, TFLOP/s, ratio to dense, error, or
the error message of a candidate that did not run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "kernels")]


def build_deepgemm(sdist: Path, work: Path, headers: Path | None):
    """DeepGEMM built from its sdist into ``work`` (``fp4moe_kernels.deepgemm.build``) and imported from there;
    returns (module, seconds)."""
    from fp4moe_kernels import deepgemm

    secs = deepgemm.build(sdist, work, headers)
    return deepgemm._from_dir(work), secs


def counts_v3(e=32, rows=32768, seed=0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(e, generator=g) + 0.5  # uneven: 0.5-1.5 x the mean load
    c = torch.multinomial(p / p.sum(), rows, replacement=True, generator=g).bincount(minlength=e).tolist()
    c[0] += c[3] + c[7] - 5
    c[3] = 0
    c[7] = 5
    return c


def bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100))


def rel(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def run(args) -> dict:
    from fp4moe.ops.fp8_gemm import fp8_mm
    from fp4moe_kernels.formats import Segments
    from fp4moe_kernels.triton_kernels import launchers as L

    dev = torch.device("cuda")
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": os.environ.get("FP4MOE_COMMIT"),
           "sdist": Path(args.sdist).name, "rows": [], "errors": {}}
    try:
        headers = Path(args.headers) if args.headers and Path(args.headers).is_dir() else None
        dg, secs = build_deepgemm(Path(args.sdist), Path(args.work), headers)
        doc["build_s"] = round(secs, 1)
        doc["alignment"] = int(dg.get_mk_alignment_for_contiguous_layout())
    except Exception as exc:  # record why the library did not build; the Triton and dense rows still run
        dg = None
        doc["errors"]["build"] = "".join(traceback.format_exception_only(exc))[-3000:]
        traceback.print_exc()
    counts = counts_v3()
    seg = Segments(tuple(counts))
    m, e = seg.total, seg.num
    doc["counts"] = counts
    picks = [max(range(e), key=counts.__getitem__), 7, 1]
    torch.manual_seed(0)

    def row(gemm, backend, n, k, ms, err=None, **extra):
        flops = 2 * m * n * k
        r = {"gemm": gemm, "backend": backend, "M": m, "N": n, "K": k, "ms": round(ms, 4),
             "tflops": round(flops / ms / 1e9, 1), "rel_err": err, **extra}
        doc["rows"].append(r)
        print(json.dumps(r), flush=True)

    for gemm, n, k in (("fc1_fprop", 4096, 7168), ("fc2_fprop", 7168, 2048), ("fc1_dgrad", 7168, 4096),
                       ("fc2_dgrad", 2048, 7168)):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(e * n, k, device=dev) * 0.02).to(torch.bfloat16)
        a = L.bf16_to_fp8_row(x, seg)
        sa = a.scale_matrix().contiguous()
        wq, ws = L.quantize_weight_128x128(w, rows_per_expert=n)
        wq3, ws3 = wq.view(e, n, k), ws.view(e, n // 128, k // 128)
        ref = {}
        for i in picks:
            r0, r1 = seg.offsets[i], seg.offsets[i + 1]
            xa = a.data[r0:r1].float() * sa[r0:r1].repeat_interleave(128, 1)
            wb = wq3[i].float() * ws3[i].repeat_interleave(128, 0).repeat_interleave(128, 1)
            ref[i] = xa @ wb.t()

        def err_of(out, off=None):
            off = off or seg.offsets
            return max(rel(out[off[i]:off[i] + counts[i]], ref[i]) for i in picks if counts[i])

        dense_ms = bench(lambda: fp8_mm(a.data, sa, wq[:n], ws[: n // 128], "fprop", check=False))
        row(gemm, "dense F.scaled_mm (one weight, M x N x K)", n, k, dense_ms)
        out = L.grouped_fp8_rows(a, wq3, ws3)
        row(gemm, "fp4moe grouped Triton", n, k, bench(lambda: L.grouped_fp8_rows(a, wq3, ws3)), err_of(out))
        if dg is None:
            continue
        try:
            al = doc["alignment"]
            pc = [(c + al - 1) // al * al for c in counts]
            poff = [0]
            for c in pc:
                poff.append(poff[-1] + c)
            mp = poff[-1]
            src_rows = torch.cat([torch.arange(seg.offsets[i], seg.offsets[i + 1]) for i in range(e)]).to(dev)
            dst_rows = torch.cat([torch.arange(poff[i], poff[i] + counts[i]) for i in range(e)]).to(dev)
            m_idx = torch.full((mp,), -1, dtype=torch.int32, device=dev)
            for i in range(e):
                m_idx[poff[i]:poff[i] + counts[i]] = i
            ap = torch.zeros(mp, k, dtype=torch.float8_e4m3fn, device=dev)
            sp = torch.ones(mp, k // 128, dtype=torch.float32, device=dev)

            def pad():
                ap.view(torch.uint8).index_copy_(0, dst_rows, a.data.view(torch.uint8).index_select(0, src_rows))
                sp.index_copy_(0, dst_rows, sa.index_select(0, src_rows))

            pad()
            d = torch.empty(mp, n, dtype=torch.bfloat16, device=dev)
            call = lambda: dg.m_grouped_fp8_gemm_nt_contiguous((ap, sp), (wq3, ws3), d, m_idx)  # noqa: E731
            call()
            torch.cuda.synchronize()
            row(gemm, "DeepGEMM m_grouped_fp8_gemm_nt_contiguous (rows padded)", n, k, bench(call),
                err_of(d, poff), pad_ms=round(bench(pad), 4), padded_rows=mp)
        except Exception as exc:
            doc["errors"][f"{gemm} m_grouped"] = "".join(traceback.format_exception_only(exc))[-2000:]
            traceback.print_exc()
        try:
            dd = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            call = lambda: dg.fp8_gemm_nt((a.data, sa), (wq[:n], ws[: n // 128]), dd)  # noqa: E731
            call()
            row(gemm, "DeepGEMM fp8_gemm_nt dense (one weight)", n, k, bench(call))
        except Exception as exc:
            doc["errors"][f"{gemm} dense"] = "".join(traceback.format_exception_only(exc))[-2000:]

    for gemm, n, k in (("fc1_wgrad", 4096, 7168), ("fc2_wgrad", 7168, 2048)):
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ca, cb = L.bf16_to_fp8_col(dy, seg), L.bf16_to_fp8_col(x, seg)
        out = L.grouped_fp8_wgrad(ca, cb)

        def col(ct, i):  # expert i's [channels, padded tokens] in FP32, dequantized
            data, scale = ct.segment(i)
            return data.float() * scale.repeat_interleave(128, 1)

        ref = {i: col(ca, i) @ col(cb, i).t() for i in picks if counts[i]}
        err = max(rel(out[i], ref[i]) for i in ref)
        one = Segments((m,))
        da, db = L.bf16_to_fp8_col(dy, one), L.bf16_to_fp8_col(x, one)
        mp1 = one.padded_total
        a2, b2 = da.data.view(n, mp1), db.data.view(k, mp1)
        s2a, s2b = da.scales.t().contiguous(), db.scales.t().contiguous()
        row(gemm, "dense F.scaled_mm (one weight, M x N x K)", n, k,
            bench(lambda: fp8_mm(a2, s2a, b2, s2b, "wgrad", check=False)))
        row(gemm, "fp4moe grouped Triton", n, k, bench(lambda: L.grouped_fp8_wgrad(ca, cb)), err)
        if dg is None:
            continue
        try:
            ks = list(seg.padded_counts)
            ks_t = torch.tensor(ks, dtype=torch.int32, device=dev)
            d = torch.zeros(e, n, k, dtype=torch.float32, device=dev)
            # operands as [channels, sum of padded tokens] row-major (each expert a column block), scales
            # [sum_k/128, channels] as fp4moe's column layout has them
            def whole(ct):
                return torch.cat([ct.segment(i)[0] for i in range(e)], dim=1).contiguous()

            # scales: DeepGEMM's SM90 path reads a 2-D FP32 scale tensor as [channels, sum_k/128] (MN-major after
            # get_mn_major_tma_aligned_tensor): fp4moe's [sum_k/128, channels] transposed is that, as a view
            blocks, mat = (ca.data, cb.data), (whole(ca), whole(cb))
            for label, (xa, xb), (sxa, sxb) in (
                    ("per-expert blocks, scales [sum_k/128, channels]", blocks, (ca.scales, cb.scales)),
                    ("per-expert blocks, scales [channels, sum_k/128]", blocks, (ca.scales.t(), cb.scales.t())),
                    ("[channels, tokens], scales [channels, sum_k/128]", mat, (ca.scales.t(), cb.scales.t()))):
                call = lambda: dg.k_grouped_fp8_gemm_nt_contiguous((xa, sxa), (xb, sxb), d, ks,  # noqa: E731
                                                                    ks_t, d)
                d.zero_()
                call()
                torch.cuda.synchronize()
                e2 = max(rel(d[i], ref[i]) for i in ref)
                row(gemm, f"DeepGEMM k_grouped_fp8_gemm_nt_contiguous ({label}; accumulates into FP32)", n, k,
                    bench(call), e2)
        except Exception as exc:
            doc["errors"][f"{gemm} k_grouped"] = "".join(traceback.format_exception_only(exc))[-2000:]
            traceback.print_exc()
    return doc


def markdown(doc) -> str:
    L = [f"# DeepGEMM vs fp4moe grouped FP8 GEMMs ({doc['gpu']}, torch {doc['torch']}, code {doc['commit']})", "",
         f"{doc['sdist']}; built in {doc.get('build_s')} s; alignment {doc.get('alignment')}; counts {doc['counts']}",
         "", "| GEMM | backend | M | N | K | ms | TFLOP/s | x dense | rel. error | pad ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    dense = {r["gemm"]: r["ms"] for r in doc["rows"] if r["backend"].startswith("dense")}
    for r in doc["rows"]:
        x = dense[r["gemm"]] / r["ms"] if r["gemm"] in dense else None
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
        L.append(f"| {r['gemm']} | {r['backend']} | {r['M']} | {r['N']} | {r['K']} | {r['ms']:.3f} | {r['tflops']} | "
                 f"{x:.2f} | {err} | {r.get('pad_ms', '')} |")
    for k, v in doc["errors"].items():
        L += ["", f"**{k}**: `{v.strip().splitlines()[-1][:400]}`"]
    return "\n".join(L) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sdist", required=True, help="deepinfer_gemm-<v>.tar.gz (PyPI sdist)")
    p.add_argument("--out", required=True, help="folder for deepgemm_<gpu>.json / .md")
    p.add_argument("--headers", default=str(ROOT / "build" / "deepgemm" / "include"),
                   help="elfutils development headers (apt-get download libdw-dev libelf-dev; dpkg-deb -x)")
    p.add_argument("--work", default="/tmp/deepgemm_build", help="where the sdist is unpacked and built")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_deepgemm: needs a CUDA GPU (Hopper)")
    Path(args.work).mkdir(parents=True, exist_ok=True)
    doc = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "deepgemm_h200.json").write_text(json.dumps(doc, indent=1))
    (out / "deepgemm_h200.md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
