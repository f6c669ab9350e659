"""Ragged per-expert segments: every conversion of the reference, run once over all segments, must give per
segment exactly what it gives on that segment alone; plus the counts / shape validation messages."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4moe_kernels import reference as R
from fp4moe_kernels.formats import FormatError, MXFP4Tensor, Segments
from oracles import PROFILE as SHARED_PROFILE

PROFILE = settings(SHARED_PROFILE, max_examples=40)


def rand_bf16(rng, m, k, *, p_nonfinite=0.0) -> torch.Tensor:
    """bf16 [m, k] with a log-uniform scale per 32-block, +0 elements and -0 blocks: this file's own
    distribution (not oracles.rand_bf16, which draws differently), kept so the examples stay the same."""
    x = rng.standard_normal((m, k)) * np.repeat(np.exp2(rng.uniform(-40, 40, (m, k // 32))), 32, axis=1)
    x[rng.random((m, k)) < 0.05] = 0.0
    x[np.repeat(rng.random((m, k // 32)) < 0.05, 32, axis=1)] = -0.0
    nf = rng.random((m, k)) < p_nonfinite
    x[nf] = rng.choice([np.nan, np.inf, -np.inf], int(nf.sum()))
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (FP8 compared as uint8; FP32 scales as int32)."""
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and torch.equal(u8(a), u8(b))


def mx_rows(a: MXFP4Tensor, r0: int, r1: int) -> MXFP4Tensor:
    return MXFP4Tensor(a.data[r0:r1].contiguous(), a.scales[r0:r1].contiguous(), (r1 - r0, a.shape[1]))


count_values = st.one_of(st.sampled_from([0, 0, 1, 31, 32, 33, 127, 128, 129]), st.integers(0, 200))


@st.composite
def ragged_counts(draw):
    kind = draw(st.sampled_from(["mixed", "single", "one_of_many", "all_zero", "none"]))
    if kind == "mixed":
        return draw(st.lists(count_values, min_size=1, max_size=5))
    if kind == "single":
        return [draw(count_values)]
    if kind == "one_of_many":
        e = draw(st.integers(2, 8))
        c = [0] * e
        c[draw(st.integers(0, e - 1))] = draw(st.integers(1, 200))
        return c
    if kind == "all_zero":
        return [0] * draw(st.integers(1, 5))
    return None


@PROFILE
@given(seed=st.integers(0, 2**32 - 1), g=st.integers(1, 2), counts=ragged_counts(),
       p_nonfinite=st.sampled_from([0.0, 0.002]))
def test_every_conversion_is_per_segment(seed, g, counts, p_nonfinite):
    rng = np.random.default_rng(seed)
    k = 128 * g
    m = sum(counts) if counts is not None else int(rng.integers(0, 200))
    x = rand_bf16(rng, m, k, p_nonfinite=p_nonfinite)
    a = R.bf16_to_fp4_row(x)
    seg = Segments.of(counts, m)
    offs = seg.offsets

    fr = R.bf16_to_fp8_row(x, counts)
    fc = R.bf16_to_fp8_col(x, counts)
    gr = R.fp4_row_to_fp8_row(a, counts)
    gc = R.fp4_row_to_fp8_col(a, counts)
    back = R.fp8_row_to_fp4(fr)
    fa, ff = R.bf16_to_fp4_and_fp8_row(x, counts)
    assert fr.segments == fc.segments == gr.segments == gc.segments == ff.segments == seg

    # row-local outputs do not depend on the segmentation at all
    assert same(fr.data, R.bf16_to_fp8_row(x).data) and same(gr.data, R.fp4_row_to_fp8_row(a).data)
    assert same(fa.data, a.data) and same(fa.scales, a.scales)

    for e, (r0, r1) in enumerate(zip(offs[:-1], offs[1:])):
        c = r1 - r0
        xs, as_ = x[r0:r1], mx_rows(a, r0, r1)
        for ragged, alone in ((fr, R.bf16_to_fp8_row(xs)), (gr, R.fp4_row_to_fp8_row(as_)), (ff, R.bf16_to_fp8_row(xs))):
            d, s = ragged.segment(e)
            d1, s1 = alone.segment(0)
            assert same(d, d1) and same(s.contiguous(), s1.contiguous())
            assert tuple(s.shape) == (c, g)
            if c > 0:
                assert s.stride() == (1, c), s.stride()
            # the flat segment-major buffer holds exactly the single-segment buffer at [g*r0, g*r1)
            assert same(ragged.scales[g * r0 : g * r1], alone.scales)
        for ragged, alone in ((fc, R.bf16_to_fp8_col(xs)), (gc, R.fp4_row_to_fp8_col(as_))):
            d, s = ragged.segment(e)
            d1, s1 = alone.segment(0)
            p = seg.padded_counts[e]
            assert tuple(d.shape) == (k, p) and tuple(s.shape) == (k, p // 128)
            assert same(d, d1) and same(s.contiguous(), s1.contiguous())
            p0 = seg.padded_offsets[e]
            assert same(ragged.data[k * p0 : k * (p0 + p)], alone.data)
            assert same(ragged.scales[p0 // 128 : (p0 + p) // 128], alone.scales)
        # the per-segment views decode (by hand) back to x within half an E4M3 ulp
        x64 = xs.to(torch.float64)
        fin = torch.isfinite(x64)
        d, s = fr.segment(e)
        s_el = s.to(torch.float64).repeat_interleave(128, dim=1)
        err = (d.to(torch.float64) * s_el - x64).abs()
        assert bool((err <= 2.0**-4 * x64.abs() + 2.0**-10 * s_el)[fin].all())
        d, s = fc.segment(e)
        s_el = s.to(torch.float64).repeat_interleave(128, dim=1)[:, :c].t()
        err = (d[:, :c].t().to(torch.float64) * s_el - x64).abs()
        assert bool((err <= 2.0**-4 * x64.abs() + 2.0**-10 * s_el)[fin].all())
        b1 = R.fp8_row_to_fp4(R.bf16_to_fp8_row(xs))
        assert same(back.data[r0:r1], b1.data) and same(back.scales[r0:r1], b1.scales)


@pytest.mark.parametrize("counts", [[0, 5, 0, 200, 7], [212], [0, 0, 212, 0]])
def test_counts_forms_are_equivalent(counts):
    rng = np.random.default_rng(5)
    x = rand_bf16(rng, 212, 256)
    a = R.bf16_to_fp4_row(x)
    forms = [counts, tuple(counts), torch.tensor(counts, dtype=torch.int64), torch.tensor(counts, dtype=torch.int32),
             Segments(tuple(counts))]
    if len(counts) == 1:
        forms.append(None)
    outs = [(R.bf16_to_fp8_row(x, c), R.fp4_row_to_fp8_col(a, c)) for c in forms]
    for r, col in outs[1:]:
        assert same(r.data, outs[0][0].data) and same(r.scales, outs[0][0].scales)
        assert same(col.data, outs[0][1].data) and same(col.scales, outs[0][1].scales)


def test_segments_offsets_by_hand():
    s = Segments.of([0, 5, 128, 0, 129], 262)
    assert s.num == 5 and s.total == 262
    assert s.offsets == (0, 0, 5, 133, 133, 262)
    assert s.padded_counts == (0, 128, 128, 0, 256)
    assert s.padded_offsets == (0, 0, 128, 256, 256, 512)
    assert s.padded_total == 512
    assert Segments.of(None, 7).counts == (7,)


@pytest.mark.parametrize("counts", [(7,), (0, 5, 128, 0, 129), (3, 0), (0, 0, 4)])
def test_row_segments_name_each_rows_segment(counts):
    """Each row's segment (the FP8 row kernels' row_seg, DeepGEMM's m_indices), int32 on the asked device, with
    empty segments first, between and last: segment e owns rows offsets[e] .. offsets[e+1]."""
    s = Segments(counts)
    ids = s.row_segments(torch.device("cpu"))
    assert ids.dtype == torch.int32 and ids.shape == (s.total,)
    assert ids.tolist() == [e for e, c in enumerate(counts) for _ in range(c)]
    assert Segments((0, 0)).row_segments("cpu").shape == (0,)


def test_empty_inputs():
    for counts in (None, [0], [0, 0, 0]):
        x = torch.zeros(0, 256, dtype=torch.bfloat16)
        a = R.bf16_to_fp4_row(x)
        assert a.data.shape == (0, 128) and a.scales.shape == (0, 8)
        f = R.bf16_to_fp8_row(x, counts)
        assert f.data.shape == (0, 256) and f.scales.shape == (0,)
        assert R.bf16_to_fp8_col(x, counts).data.shape == (0,)
        assert R.fp4_row_to_fp8_row(a, counts).data.shape == (0, 256)
        c = R.fp4_row_to_fp8_col(a, counts)
        assert c.data.shape == (0,) and c.scales.shape == (0, 256)
        assert R.fp8_row_to_fp4(f).data.shape == (0, 128)
        assert R.fp4_to_bf16(a).shape == (0, 256)


# ------------------------------------------------------------------------------------------ validation

CONVS = {
    "bf16_to_fp8_row": lambda x, a, c: R.bf16_to_fp8_row(x, c),
    "bf16_to_fp8_col": lambda x, a, c: R.bf16_to_fp8_col(x, c),
    "fp4_row_to_fp8_row": lambda x, a, c: R.fp4_row_to_fp8_row(a, c),
    "fp4_row_to_fp8_col": lambda x, a, c: R.fp4_row_to_fp8_col(a, c),
    "bf16_to_fp4_and_fp8_row": lambda x, a, c: R.bf16_to_fp4_and_fp8_row(x, c),
}

BAD_COUNTS = [
    ([4, 5], "sum to 9 but the tensor has 10 rows"),
    ([4, 7], "sum to 11 but the tensor has 10 rows"),
    ([-1, 11], "non-negative"),
    (torch.tensor([-2, 12]), "non-negative"),
    (torch.tensor([[4, 6]]), "1-D integer tensor"),
    (torch.tensor([4.0, 6.0]), "1-D integer tensor"),
    (torch.tensor([True, False]), "1-D integer tensor"),
    ([], "empty"),
]


@pytest.mark.parametrize("name", list(CONVS))
@pytest.mark.parametrize("counts,msg", BAD_COUNTS, ids=[str(i) for i in range(len(BAD_COUNTS))])
def test_bad_counts_raise_format_error(name, counts, msg):
    x = torch.ones(10, 128, dtype=torch.bfloat16)
    a = R.bf16_to_fp4_row(x)
    with pytest.raises(FormatError, match=msg):
        CONVS[name](x, a, counts)


def test_non_integral_float_counts_are_rejected():
    """[1.5, 2.5] covers 3 rows only after int() truncation to (1, 2); it must not be accepted silently
    (Segments.of truncates every element of a Python sequence with int())."""
    with pytest.raises(FormatError, match="int"):
        Segments.of([1.5, 2.5], 3)
    with pytest.raises(FormatError, match="int"):
        R.bf16_to_fp8_row(torch.ones(3, 128, dtype=torch.bfloat16), [1.5, 2.5])


@pytest.mark.parametrize(
    "fn,shape,msg",
    [(R.bf16_to_fp4_row, (4, 48), "multiple of 32"), (R.bf16_to_fp8_row, (4, 64), "multiple of 128"),
     (R.bf16_to_fp4_row, (256,), "2-D"), (R.bf16_to_fp8_col, (256,), "2-D")],
    ids=["fp4_row_k48", "fp8_row_k64", "fp4_row_1d", "fp8_col_1d"],
)
def test_bf16_conversions_validate_shape_with_format_error(fn, shape, msg):
    """fp4_row_to_fp8_row/col raise FormatError('... multiple of 128'); the BF16 entry points must too
    (formats.check_2d exists for this) instead of a RuntimeError/ValueError from a reshape or an unpack."""
    with pytest.raises(FormatError, match=msg):
        fn(torch.ones(*shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_any_float_dtype_is_accepted_and_agrees(dtype):
    # values exactly representable in every dtype -> identical outputs
    rng = np.random.default_rng(11)
    x = torch.from_numpy((rng.integers(-64, 65, (8, 256)) * 2.0 ** rng.integers(-6, 6, (8, 1))).astype(np.float32))
    ref_a, ref_f = R.bf16_to_fp4_row(x.to(torch.bfloat16)), R.bf16_to_fp8_row(x.to(torch.bfloat16))
    a, f = R.bf16_to_fp4_row(x.to(dtype)), R.bf16_to_fp8_row(x.to(dtype))
    assert same(a.data, ref_a.data) and same(a.scales, ref_a.scales)
    assert same(f.data, ref_f.data) and same(f.scales, ref_f.scales)
