"""fp4moe_kernels.kernel_names: every kernel the package launches is known by the name a profiler gives it, and the
layer benchmark's profile counts fp4moe's grouped GEMMs as GEMMs (they were 'elementwise/other' before: 4.9 of the
7.2 ms that the H100 run of 09feb1b put there for fp8@deepgemm was grouped_wgrad_tma_kernel)."""
from __future__ import annotations

import re
from pathlib import Path

import fp4moe_kernels
from fp4moe_kernels.kernel_names import kernel_kind, kernel_names

PACKAGE = Path(fp4moe_kernels.__file__).resolve().parent


def test_every_kernel_the_package_launches_is_named():
    """Each Triton launch ``name[grid](...)`` in triton_kernels/ and the CUDA kernel the extension builds."""
    launched = {m for src in (PACKAGE / "triton_kernels").glob("*.py")
                for m in re.findall(r"\b(\w+_kernel)\[", src.read_text())}
    assert len(launched) >= 20, launched
    names = kernel_names()
    assert launched <= set(names), launched - set(names)
    assert names["fp4_row_to_fp8_col"] == "other"   # cuda_kernels/fp4_row_to_fp8_col.cu's __global__ function
    # the GEMMs are what triton_kernels/gemm.py defines, nothing else
    assert {n for n, kind in names.items() if kind == "gemm"} == {
        "grouped_rows_kernel", "grouped_wgrad_kernel", "grouped_wgrad_tma_kernel"}
    # Triton helpers (@triton.jit functions that are not launched) are not kernels
    assert "_quant_cols" not in names and "_swiglu_grads" not in names


def test_kernel_kind_reads_the_names_a_profiler_gives():
    assert kernel_kind("grouped_wgrad_tma_kernel") == "gemm"
    assert kernel_kind("quantize_weight_128x128_kernel") == "other"
    assert kernel_kind("void fp4_row_to_fp8_col<4>(unsigned char const*, unsigned char const*, unsigned char*, "
                       "float*, int const*, int, int)") == "other"
    assert kernel_kind("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") is None
    assert kernel_kind("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long)") is None
    assert kernel_kind("void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u, 7168u>(...)") is None


def test_layer_benchmark_profile_categories():
    """The names of the H100 layer run's top kernels (results/moe_layer/moe_layer_h100_ep1_wcache_mb8_2026-12-06_09feb1b)."""
    from fp4moe.bench.moe_layer import OWN_OTHER, _category

    assert _category("grouped_wgrad_tma_kernel") == "gemm"
    assert _category("grouped_rows_kernel") == "gemm"
    assert _category("void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u, 7168u, 4096u>") == "gemm"
    assert _category("nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_coopA_algo2_Ablk128_Bvec128_TNN") == "gemm"
    for own in ("quantize_weight_128x128_kernel", "bf16_to_fp8_row_kernel", "_swiglu_bwd_kernel",
                "gather_sum_rows_kernel", "void fp4_row_to_fp8_col<4>(unsigned char const*, int)"):
        assert _category(own) == OWN_OTHER, own
    assert _category("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long)") == \
        "index/sort"
    assert _category("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16>>") == \
        "elementwise/other"
    assert _category("ncclDevKernel_AllToAll") == "nccl"
