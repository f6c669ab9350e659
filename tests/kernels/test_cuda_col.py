"""The CUDA C++ FP4RowToFP8Col (fp4moe_kernels.cuda_kernels), every variant, bit for bit against the
reference: every packed byte under every UE8M0 code, typical activations with rare tiles, and random inputs with
every special value at DeepSeek-V3 shapes over ragged experts. GPU only (it needs nvcc and a Hopper GPU)."""
import pytest
import torch

from fp4moe_kernels import reference as ref
from fp4moe_kernels import selfcheck
from fp4moe_kernels.formats import MXFP4Tensor, Segments

cuda_kernels = pytest.importorskip("fp4moe_kernels.cuda_kernels")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_kernels.available() is not None,
                                                  reason=str(cuda_kernels.available()))]


def _check(a: MXFP4Tensor, counts, variant):
    a = MXFP4Tensor(a.data.cuda(), a.scales.cuda(), a.shape)  # the reference runs on CUDA tensors too
    seg = Segments.of(counts, a.shape[0])
    assert not selfcheck.compare(cuda_kernels.fp4_row_to_fp8_col(a, seg, variant), ref.fp4_row_to_fp8_col(a, seg))


@pytest.mark.parametrize("variant", list(cuda_kernels.VARIANTS))
def test_every_byte_and_scale_code(variant):
    a = selfcheck.every_fp4_byte_and_code()
    data, scales = a.data.reshape(-1, 64), a.scales.reshape(-1, 4)  # [1024, 128]
    perm = torch.randperm(1024, generator=torch.Generator().manual_seed(1))
    for d, s in ((data, scales), (data[perm], scales[perm])):
        _check(MXFP4Tensor(d.contiguous(), s.contiguous(), (1024, 128)), [300, 0, 724], variant)


@pytest.mark.parametrize("variant", list(cuda_kernels.VARIANTS))
def test_typical_tiles_with_rare_ones(variant):
    x = selfcheck.make_input(384, 256, 5, spread=3, special=False).float()
    x[10, 40] = float("nan")
    x[300, 128:160] *= 2.0 ** -60
    _check(ref.bf16_to_fp4_row(x.to(torch.bfloat16)), [200, 0, 184], variant)


@pytest.mark.parametrize("variant", list(cuda_kernels.VARIANTS))
@pytest.mark.parametrize("m,k,experts,spread", [(8192, 7168, 32, 30), (4096, 7168, 32, 3), (4096, 2048, None, 3),
                                                (1, 7168, None, 30), (129, 256, 3, 30)])
def test_random_inputs(variant, m, k, experts, spread):
    counts = None if experts is None else selfcheck.make_counts(m, experts, m + k)
    x = selfcheck.make_input(m, k, m + spread, "cuda", spread=spread, special=spread > 4)
    _check(ref.bf16_to_fp4_row(x), counts, variant)


@pytest.mark.parametrize("mode, runs_cuda", [(None, True), ("auto", True), ("1", True), ("0", False)])
def test_ops_switch_picks_the_kernel_with_the_same_bits_as_triton(monkeypatch, mode, runs_cuda):
    """ops.fp4_row_to_fp8_col (the trainer's call) runs the CUDA kernel by default and with FP4MOE_CUDA_COL=1, the
    Triton kernel with 0 (a spy counts the CUDA calls); either way the output is the Triton kernel's, bit for bit."""
    from fp4moe_kernels import convert as ops
    from fp4moe_kernels.triton_kernels import launchers

    x = selfcheck.make_input(4096, 2048, 7, "cuda", spread=4, special=False)
    a = ops.bf16_to_fp4_row(x)
    counts = selfcheck.make_counts(4096, 16, 7)
    calls = []
    real = cuda_kernels.fp4_row_to_fp8_col
    monkeypatch.setattr(cuda_kernels, "fp4_row_to_fp8_col", lambda *args: calls.append(1) or real(*args))
    if mode is None:
        monkeypatch.delenv(ops.CUDA_COL_ENV, raising=False)
    else:
        monkeypatch.setenv(ops.CUDA_COL_ENV, mode)
    got = ops.fp4_row_to_fp8_col(a, counts)
    assert len(calls) == int(runs_cuda)
    assert not selfcheck.compare(got, launchers.fp4_row_to_fp8_col(a, Segments.of(counts, 4096)))
