"""Every Triton kernel equals the reference bit for bit.

CPU: the kernels run under the Triton interpreter on small shapes with tails, empty experts and 0 rows.
GPU (``-m gpu``): compiled kernels at DeepSeek-V3 shapes (tokens x 7168 and x 2048, ragged over 32
experts), on fresh random inputs each session (seed printed on failure; set FP4MOE_TEST_SEED to replay).
"""
import os
import random

import pytest
import torch

from fp4moe_kernels import selfcheck

SEED = int(os.environ.get("FP4MOE_TEST_SEED", random.randrange(1 << 20)))


def _id(case) -> str:
    """A test id that does not depend on the seed (the random counts do)."""
    seg = "1seg" if case.counts is None else f"{len(case.counts)}experts"
    return f"{case.conversion}-{case.m}x{case.k}-{seg}-spread{case.spread}"
CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
@pytest.mark.parametrize("case", selfcheck.cpu_cases(SEED), ids=_id)
def test_kernel_matches_reference_interpreted(case):
    diffs = selfcheck.run_case(case, "cpu", impl="triton")
    assert not diffs, f"seed {SEED}: " + "; ".join(diffs)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("case", selfcheck.gpu_cases(SEED), ids=_id)
def test_kernel_matches_reference_gpu(case):
    diffs = selfcheck.run_case(case, "cuda", impl="ops")
    assert not diffs, f"seed {SEED}: " + "; ".join(diffs)


def test_compare_detects_a_single_flipped_bit():
    """The comparison used above is not vacuous: one changed FP8 bit or scale code is reported."""
    from fp4moe_kernels import reference as ref

    x = selfcheck.make_input(64, 256, SEED, special=False)
    f = ref.bf16_to_fp8_row(x, [30, 34])
    g = ref.bf16_to_fp8_row(x, [30, 34])
    assert selfcheck.compare(g, f) == []
    g.data.view(torch.uint8)[5, 7] ^= 1
    assert any("data" in d for d in selfcheck.compare(g, f))
    a = ref.bf16_to_fp4_row(x)
    b = ref.bf16_to_fp4_row(x)
    b.scales[3, 2] += 1
    assert any("scales" in d for d in selfcheck.compare(b, a))
