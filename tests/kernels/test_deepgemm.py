"""fp4moe_kernels.deepgemm on a machine without it (CPU here): every way it can be missing is one message that names
the fix, the row-alignment check runs before anything is loaded, and the switch takes the value. The GEMM itself is
tested on the GPU (tests/ops/test_grouped_experts.py, test_gpu_deepgemm_*)."""
from __future__ import annotations

import pytest
import torch

from fp4moe_kernels import deepgemm, switches
from fp4moe_kernels import convert as kops
from fp4moe_kernels.formats import FormatError, Segments


@pytest.fixture
def fresh(monkeypatch):
    deepgemm._load.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the GPU check, to the import
    yield monkeypatch
    deepgemm._load.cache_clear()


def test_not_installed_and_no_folder_names_both_fixes(fresh):
    fresh.delenv(deepgemm.ENV_DIR, raising=False)
    fresh.setitem(__import__("sys").modules, "deep_gemm", None)  # an import of it fails
    why = deepgemm.why_unavailable()
    assert "pip install deepinfer-gemm" in why and "python -m fp4moe_kernels.deepgemm build" in why
    with pytest.raises(deepgemm.DeepGEMMUnavailable, match="kernels.grouped_gemm=deepgemm: .*grouped_gemm=triton"):
        deepgemm.load()


def test_a_folder_that_is_not_a_build_says_so(fresh, tmp_path):
    fresh.setitem(__import__("sys").modules, "deep_gemm", None)
    fresh.setenv(deepgemm.ENV_DIR, str(tmp_path))
    assert deepgemm.why_unavailable() == (
        f"${deepgemm.ENV_DIR}={tmp_path} is not a DeepGEMM build (no build/_C.so or src/deepinfer_gemm-*): write it "
        f"with python -m fp4moe_kernels.deepgemm build --sdist <sdist> --out {tmp_path}")


def test_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert deepgemm.why_unavailable() == "DeepGEMM needs a CUDA GPU (Hopper)" and not deepgemm.available()


def test_rows_not_aligned_to_128_are_refused_before_loading():
    seg = Segments((128, 5))
    row = kops.bf16_to_fp8_row(torch.randn(133, 128).to(torch.bfloat16), seg)
    w = torch.zeros(2, 128, 128).to(torch.float8_e4m3fn)
    with pytest.raises(FormatError, match="multiple of 128, got \\[5\\]"):
        deepgemm.m_grouped_rows(row, w, torch.ones(2, 1, 1))
    assert deepgemm.row_aligned(Segments((128, 0, 256))) and not deepgemm.row_aligned(seg)


def test_scale_layout_gathers_segment_major_scales_into_one_mn_major_matrix():
    """fp4moe's row scales are segment-major (expert e's [K/128, m_e] block after expert e-1's); mn_major_scales
    makes the [K/128, M] matrix DeepGEMM reads, equal to the dense scale matrix transposed; each row's expert."""
    seg = Segments((256, 0, 128))
    row = kops.bf16_to_fp8_row(torch.randn(384, 512).to(torch.bfloat16) * torch.rand(384, 1) * 100, seg)
    m_indices = deepgemm.expert_of_rows(seg, torch.device("cpu"))
    assert m_indices.tolist() == [0] * 256 + [2] * 128 and m_indices.dtype == torch.int32
    assert torch.equal(deepgemm.mn_major_scales(row), row.scale_matrix().t())


@pytest.mark.parametrize("counts", [(128,), (0, 384, 0, 128, 256), (512, 128, 0), (0, 0, 128)])
@pytest.mark.parametrize("k", [128, 384, 896])
def test_scale_layout_by_chunk_gather_equals_the_dense_scale_matrix(counts, k):
    """The row-aligned path (one gather of 128-float chunks) against the dense scale matrix transposed, with empty
    experts first, between and last and K/128 from 1 to 7; unaligned rows take the concatenation, also equal."""
    seg = Segments(counts)
    x = torch.randn(seg.total, k) * torch.rand(seg.total, 1) * 100
    row = kops.bf16_to_fp8_row(x.to(torch.bfloat16), seg)
    assert torch.equal(deepgemm.mn_major_scales(row), row.scale_matrix().t())
    ragged = Segments(tuple(max(c - 3, 0) for c in counts))
    row = kops.bf16_to_fp8_row(x[: ragged.total].to(torch.bfloat16), ragged)
    assert torch.equal(deepgemm.mn_major_scales(row), row.scale_matrix().t())


def test_the_switch_takes_deepgemm_and_cpu_runs_the_loop():
    from fp4moe.ops.grouped_experts import gemm_backend, gemm_row_align
    from fp4moe.recipe import Recipe

    with switches.use(switches.Switches(grouped_gemm="deepgemm")):
        assert switches.current().grouped_gemm == "deepgemm"
        assert gemm_backend(torch.device("cpu")) == "loop" and gemm_row_align(torch.device("cpu"), Recipe.fp8()) == 1
    with pytest.raises(switches.SwitchError, match="'deepgemm'"):
        switches.Switches(grouped_gemm="cublas")


def test_build_without_the_sdist_says_where_to_get_it(tmp_path, capsys):
    with pytest.raises(SystemExit):
        deepgemm.main(["build", "--sdist", str(tmp_path / "nope.tar.gz"), "--out", str(tmp_path / "o")])
    assert "pip download --no-deps --no-binary :all: deepinfer-gemm" in capsys.readouterr().err


def test_the_trainer_refuses_deepgemm_on_a_gpu_where_it_does_not_load(fresh):
    """fp4moe.ops.kernel_switches (the trainer's check before the model is built) names the reason and the fix."""
    from fp4moe.ops import SwitchError, kernel_switches

    fresh.setitem(__import__("sys").modules, "deep_gemm", None)
    fresh.delenv(deepgemm.ENV_DIR, raising=False)
    with pytest.raises(SwitchError, match="kernels.grouped_gemm=deepgemm: DeepGEMM is not installed .*pip install"):
        kernel_switches({"grouped_gemm": "deepgemm"})
    assert kernel_switches({"grouped_gemm": "triton"}).grouped_gemm == "triton"
