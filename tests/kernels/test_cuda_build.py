"""The CUDA C++ kernels (fp4moe_kernels/cuda_kernels/*.cu) compile for Hopper (sm_90) without register spills,
wherever nvcc is installed (no GPU needed); their bit-exactness is tests/kernels/test_cuda_col.py's (GPU)."""
import re
import shutil
import subprocess

import pytest

from fp4moe_kernels import cuda_kernels


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("name", sorted(cuda_kernels.SOURCES))
def test_compiles_for_sm90_without_spills(name, tmp_path):
    out = subprocess.run(["nvcc", "-std=c++17", "-O3", "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v",
                          "-cubin", "-o", str(tmp_path / "k.cubin"), str(cuda_kernels.SOURCES[name])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", out.stderr)]
    spills = [int(b) for b in re.findall(r"(\d+) bytes spill (?:stores|loads)", out.stderr)]
    assert len(regs) == len(cuda_kernels.VARIANTS)  # one kernel per variant
    assert max(regs) <= 128 and not any(spills), out.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_col_fast_path_on_the_cpu(tmp_path):
    """fp4_row_to_fp8_col_check.cu: the prmt fast path's per-thread code, compiled for the host, on every packed byte
    under every block code and on random byte columns, against the scalar rule (exponents, fast-path test, bytes)."""
    src = cuda_kernels.SOURCES["fp4_row_to_fp8_col"].with_name("fp4_row_to_fp8_col_check.cu")
    exe = tmp_path / "check"
    out = subprocess.run(["nvcc", "-std=c++17", "-O2", "-o", str(exe), str(src)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    run = subprocess.run([str(exe), "100000"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and " 0 mismatches" in run.stdout, run.stdout[-3000:]


def test_unavailable_without_a_gpu_says_why():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert cuda_kernels.available() == "no CUDA GPU"


def test_col_input_problem_names_what_the_kernel_cannot_take():
    """The one check both the CUDA launcher (raises) and ops.fp4_row_to_fp8_col (falls back to Triton) apply."""
    import torch

    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import MXFP4Tensor

    a = ref.bf16_to_fp4_row(torch.randn(8, 256).to(torch.bfloat16))
    assert cuda_kernels.col_input_problem(a) is None
    assert "multiple of 128" in cuda_kernels.col_input_problem(ref.bf16_to_fp4_row(torch.randn(8, 96).to(torch.bfloat16)))
    shifted = torch.empty(a.data.numel() + 1, dtype=torch.uint8)[1:].view(8, 128)  # 1 byte off alignment
    assert "aligned" in cuda_kernels.col_input_problem(MXFP4Tensor(shifted, a.scales, a.shape))


def test_each_source_text_builds_under_its_own_name(tmp_path):
    """A copy of the package whose .cu differs (an older commit's, loaded beside this one by the kernel benchmark's
    --baseline) gets another library name and build folder, so the process opens its library and not this one's;
    an identical copy shares this one's build."""
    import shutil as sh
    from pathlib import Path

    import fp4moe_kernels
    from fp4moe_kernels.bench import conversions as bench

    src = Path(fp4moe_kernels.__file__).parent
    same, other = tmp_path / "same" / "fp4moe_kernels", tmp_path / "other" / "fp4moe_kernels"
    for folder in (same, other):
        sh.copytree(src, folder, ignore=sh.ignore_patterns("__pycache__"))
    cu = other / "cuda_kernels" / "fp4_row_to_fp8_col.cu"
    cu.write_text(cu.read_text() + "\n// another commit's text\n")
    names = [bench.BASELINE_MODULE + "_same", bench.BASELINE_MODULE + "_other"]
    try:
        bench.load_baseline(str(same), names[0])
        bench.load_baseline(str(other), names[1])
        import importlib

        ours = cuda_kernels.build_name("fp4_row_to_fp8_col")
        theirs = [importlib.import_module(f"{n}.cuda_kernels").build_name("fp4_row_to_fp8_col") for n in names]
        assert re.fullmatch(r"fp4moe_fp4_row_to_fp8_col_[0-9a-f]{12}", ours)
        assert theirs[0] == ours and theirs[1] != ours
    finally:
        import sys

        for name in [m for m in sys.modules if m.startswith(bench.BASELINE_MODULE)]:
            del sys.modules[name]
