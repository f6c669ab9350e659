"""Kernels against the reference, bit for bit, on adversarial random inputs: ``python -m fp4moe_kernels.selfcheck``.

On a CUDA GPU this checks every Triton kernel at DeepSeek-V3 shapes; on the CPU it runs the same kernels
under the Triton interpreter (``TRITON_INTERPRET=1``, set automatically when no GPU is present) at small
shapes. The tests (``tests/kernels/test_kernels_exact.py``) use the same inputs and comparisons.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import dataclass

import torch

from . import reference as ref
from .formats import FP8ColTensor, FP8RowTensor, MXFP4Tensor, Segments

CONVERSIONS = (
    "bf16_to_fp4_row",
    "bf16_to_fp4_row_floor",
    "fp4_to_bf16",
    "fp4_row_to_fp8_row",
    "fp4_row_to_fp8_col",
    "fp8_row_to_fp4",
    "bf16_to_fp8_row",
    "bf16_to_fp8_col",
    "bf16_to_fp4_and_fp8_row",
    "bf16_to_fp8_row_col",
)


def make_input(m: int, k: int, seed: int, device="cpu", special: bool = True, spread: int = 30) -> torch.Tensor:
    """BF16 ``[M, K]`` that exercises the formats: per-row magnitudes over 2**+-min(12, spread), per-32-block
    exponent offsets 0..``spread`` (spreads inside 128-groups: 30 reaches every slow path, 4 is typical of real
    activations and keeps the kernels' fast paths), exact zeros, -0.0, all-zero blocks, BF16 denormals,
    and (``special``) a few NaN / +-Inf, a first row up to BF16's largest magnitude and a last row around 2**-126.
    Never all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    rs = min(12, spread)
    row = torch.exp2(torch.randint(-rs, rs + 1, (m, 1), generator=g).double())
    blk = torch.exp2(-torch.randint(0, spread + 1, (m, k // 32, 1), generator=g).double())
    blk = torch.where(torch.rand(m, k // 32, 1, generator=g) < 0.7, torch.ones_like(blk), blk)
    x = (x.reshape(m, k // 32, 32) * blk).reshape(m, k) * row
    x[torch.rand(m, k, generator=g) < 0.03] = 0.0
    x[torch.rand(m, k, generator=g) < 0.01] = -0.0
    zb = torch.rand(m, k // 32, generator=g) < 0.03
    x = x.reshape(m, k // 32, 32).masked_fill(zb.unsqueeze(-1), 0.0).reshape(m, k)
    if m > 0:
        x[torch.randint(0, m, (max(1, m // 16),), generator=g), torch.randint(0, k, (max(1, m // 16),), generator=g)] = 3e-39
    if special and m > 1:
        # the ends of the exponent range: a row up to BF16's largest finite magnitude (FP8 row scales 2**120-121,
        # products that leave float32 if formed as E4M3 x scale) and a row around 2**-126 (BF16 denormals, FP8
        # scale 2**-126, FP32-denormal products)
        x[0] = (torch.rand(k, generator=g, dtype=torch.float64) * 3.98 - 1.99) * 2.0 ** 127
        x[m - 1] = torch.randn(k, generator=g, dtype=torch.float64) * 2.0 ** -126
    if special and m > 0:
        n = max(1, m * k // 4096)
        for v in (float("nan"), float("inf"), float("-inf")):
            x[torch.randint(0, m, (n,), generator=g), torch.randint(0, k, (n,), generator=g)] = v
    return x.to(torch.bfloat16).to(device)


def make_counts(m: int, experts: int, seed: int, zero_frac: float = 0.2) -> list[int]:
    """Ragged per-expert token counts summing to M, some experts empty (seeded multinomial)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(experts, generator=g)
    w[torch.rand(experts, generator=g) < zero_frac] = 0
    if w.sum() == 0:
        w[0] = 1
    return torch.bincount(torch.multinomial(w, m, replacement=True, generator=g), minlength=experts).tolist() if m else [0] * experts


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


def _diff_float(a: torch.Tensor, b: torch.Tensor, name: str) -> list[str]:
    """Bitwise comparison of FP8/BF16 tensors; NaN positions must match (NaN payload bits may differ)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return [f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"]
    na, nb = torch.isnan(a.float()), torch.isnan(b.float())
    bad = (na != nb) | (~na & (_bits(a) != _bits(b)))
    n = int(bad.sum())
    if n == 0:
        return []
    i = bad.nonzero()[0].tolist()
    return [f"{name}: {n} of {a.numel()} differ, first at {i}: {a[tuple(i)].float().item()} vs {b[tuple(i)].float().item()}"]


def _diff_exact(a: torch.Tensor, b: torch.Tensor, name: str) -> list[str]:
    if a.shape != b.shape or a.dtype != b.dtype:
        return [f"{name}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"]
    bad = a != b
    n = int(bad.sum())
    if n == 0:
        return []
    i = bad.nonzero()[0].tolist()
    return [f"{name}: {n} of {a.numel()} differ, first at {i}: {a[tuple(i)].item()} vs {b[tuple(i)].item()}"]


def compare(got, want, name: str = "out") -> list[str]:
    """Differences between two conversion results (any of the formats, a tensor, or a tuple); [] if equal."""
    if isinstance(want, tuple):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in compare(g, w, f"{name}[{i}]")]
    if type(got) is not type(want):
        return [f"{name}: type {type(got).__name__} vs {type(want).__name__}"]
    if isinstance(want, MXFP4Tensor):
        return _diff_exact(got.data.cpu(), want.data.cpu(), f"{name}.data") + _diff_exact(
            got.scales.cpu(), want.scales.cpu(), f"{name}.scales")
    if isinstance(want, (FP8RowTensor, FP8ColTensor)):
        seg = [] if got.segments == want.segments else [f"{name}: segments differ"]
        return seg + _diff_float(got.data.cpu(), want.data.cpu(), f"{name}.data") + _diff_exact(
            got.scales.cpu(), want.scales.cpu(), f"{name}.scales")
    return _diff_float(got.cpu(), want.cpu(), name)


@dataclass
class Case:
    conversion: str
    m: int
    k: int
    counts: list[int] | None
    seed: int
    spread: int = 30
    special: bool = True  # NaN / Inf present (forces the kernels' general paths where they appear)

    @property
    def label(self) -> str:
        seg = "1 segment" if self.counts is None else f"{len(self.counts)} experts ({sum(c == 0 for c in self.counts)} empty)"
        return f"{self.conversion} {self.m}x{self.k} {seg} spread {self.spread}"


def _impl(kind: str):
    """'convert': the public API (CUDA -> kernels, CPU -> reference); 'triton': the kernel launchers on any
    device (CPU needs TRITON_INTERPRET=1)."""
    if kind == "convert":
        from . import convert

        return convert
    from .triton_kernels import launchers

    return launchers


def run_case(case: Case, device, impl: str = "convert", inputs: dict | None = None) -> list[str]:
    """Run one conversion with the kernels and the reference on the same input; return the differences. ``inputs``
    keeps each input for the cases that share it (every conversion of a shape: generating one on the host takes
    seconds at DeepSeek-V3 shapes); nothing writes into an input."""
    lib = _impl(impl)
    key = (case.m, case.k, case.seed, str(device), case.special, case.spread)
    x = None if inputs is None else inputs.get(key)
    if x is None:
        x = make_input(case.m, case.k, case.seed, device, special=case.special, spread=case.spread)
        if inputs is not None:
            inputs[key] = x
    seg = Segments.of(case.counts, case.m)
    name = case.conversion
    if name.startswith("bf16_to_fp4_row"):
        rule = "floor" if name.endswith("floor") else "ceil"
        return compare(lib.bf16_to_fp4_row(x, rule), ref.bf16_to_fp4_row(x, rule))
    if name == "bf16_to_fp8_row":
        return compare(lib.bf16_to_fp8_row(x, seg), ref.bf16_to_fp8_row(x, seg))
    if name == "bf16_to_fp8_col":
        return compare(lib.bf16_to_fp8_col(x, seg), ref.bf16_to_fp8_col(x, seg))
    if name == "bf16_to_fp8_row_col":
        return compare(lib.bf16_to_fp8_row_col(x, seg), ref.bf16_to_fp8_row_col(x, seg))
    if name == "bf16_to_fp4_and_fp8_row":
        return compare(lib.bf16_to_fp4_and_fp8_row(x, seg), ref.bf16_to_fp4_and_fp8_row(x, seg))
    a = ref.bf16_to_fp4_row(x)
    if name == "fp4_to_bf16":
        return compare(lib.fp4_to_bf16(a), ref.fp4_to_bf16(a))
    if name == "fp4_row_to_fp8_row":
        return compare(lib.fp4_row_to_fp8_row(a, seg), ref.fp4_row_to_fp8_row(a, seg))
    if name == "fp4_row_to_fp8_col":
        return compare(lib.fp4_row_to_fp8_col(a, seg), ref.fp4_row_to_fp8_col(a, seg))
    if name == "fp8_row_to_fp4":
        f = ref.bf16_to_fp8_row(x, seg)
        return compare(lib.fp8_row_to_fp4(f), ref.fp8_row_to_fp4(f))
    raise ValueError(f"unknown conversion {name!r}; known: {CONVERSIONS}")


def every_bf16_near_scales(scale_exps=(-127, -126, -125, -100, -4, -1, 0, 1, 7, 60, 124, 125)) -> torch.Tensor:
    """BF16 ``[N, 32]`` blocks that put every BF16 magnitude in [2**(s-5), 6 * 2**s] (both signs; plus zeros,
    -0 and BF16 denormals for the smallest s) under the block scale 2**s, for each s of ``scale_exps``: the
    first element of each block is 6 * 2**s, which gives UE8M0 code 127 + s under both scale rules, so every
    E2M1 rounding threshold and tie of every binade is hit exactly. Exhaustive for the E2M1 encoder."""
    blocks = []
    all_bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).double()  # finite >= 0
    for s in scale_exps:
        top = 6.0 * 2.0 ** s
        mags = all_bits[(all_bits <= top) & ((all_bits >= top * 2.0 ** -8) | (s < -120))]
        vals = torch.cat([mags, -mags])
        n = -(-vals.numel() // 31)
        body = torch.cat([vals, torch.zeros(n * 31 - vals.numel(), dtype=torch.float64)]).reshape(n, 31)
        blocks.append(torch.cat([torch.full((n, 1), top, dtype=torch.float64), body], dim=1))
    return torch.cat(blocks).to(torch.bfloat16)


def every_fp4_byte_and_code() -> MXFP4Tensor:
    """MXFP4 ``[4096, 32]``: every packed byte (16 per block, so 16 blocks cover all 256) under every UE8M0 code
    0..255. Exhaustive for the decoders (FP4ToBF16; per-element part of the FP8 conversions)."""
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16).repeat(256, 1)
    scales = torch.arange(256, dtype=torch.int32).repeat_interleave(16).to(torch.uint8).reshape(4096, 1)
    return MXFP4Tensor(data.contiguous(), scales.contiguous(), (4096, 32))


def gpu_cases(seed: int = 0) -> list[Case]:
    """DeepSeek-V3 shapes: tokens x 7168 (hidden), x 2048 (expert ffn), ragged over 32 experts, and odd sizes."""
    shapes = [
        (4096, 7168, None),
        (4096, 2048, None),
        (8192, 7168, make_counts(8192, 32, seed + 1)),
        (3000, 2048, make_counts(3000, 32, seed + 2, zero_frac=0.4)),
        (1, 7168, None),
        (129, 256, [0, 129, 0]),
    ]
    cases = [Case(c, m, k, cnt, seed + i) for i, (m, k, cnt) in enumerate(shapes) for c in CONVERSIONS]
    # small exponent spreads, as in real activations: the kernels' integer fast paths
    cases += [Case(c, 4096, 7168, make_counts(4096, 32, seed + 9), seed + 9, spread=3, special=False)
              for c in CONVERSIONS]
    return cases


def cpu_cases(seed: int = 0) -> list[Case]:
    """Small shapes for the Triton interpreter: tails, empty experts, a 0-row input."""
    shapes = [(200, 256, [10, 0, 130, 60], 30), (64, 128, None, 30), (130, 384, make_counts(130, 5, seed + 3), 30),
              (0, 128, None, 30), (160, 256, [100, 0, 60], 3)]
    return [Case(c, m, k, cnt, seed + i, sp, special=sp > 4) for i, (m, k, cnt, sp) in enumerate(shapes)
            for c in CONVERSIONS]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fp4moe_kernels.selfcheck", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0); use fresh seeds to re-check")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    device = "cuda" if cuda else "cpu"
    cases = gpu_cases(args.seed) if cuda else cpu_cases(args.seed)
    where = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)"
    print(f"kernel self-check on {where}: {len(cases)} cases, kernels vs reference, bit for bit")
    failed = 0
    t0 = time.time()
    if not cuda:  # the interpreter evaluates both sides of NaN-producing selects with numpy: harmless
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    inputs: dict = {}
    for case in cases:
        diffs = run_case(case, device, impl="convert" if cuda else "triton", inputs=inputs)
        failed += bool(diffs)
        print(f"  {'ok  ' if not diffs else 'FAIL'} {case.label}" + ("" if not diffs else "\n       " + "\n       ".join(diffs)))
    print(f"{len(cases) - failed} passed, {failed} failed ({time.time() - t0:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
