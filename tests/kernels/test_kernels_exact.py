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


# The CPU cases share their inputs between the conversions of a shape, as ``python -m fp4moe_kernels.selfcheck``
# does; test_the_self_check_can_share_inputs_between_conversions then checks that none was written into.
SHARED_INPUTS: dict = {}
RAN_SHARED: set[str] = set()  # labels of the cases run on SHARED_INPUTS


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
@pytest.mark.parametrize("case", selfcheck.cpu_cases(SEED), ids=_id)
def test_kernel_matches_reference_interpreted(case):
    diffs = selfcheck.run_case(case, "cpu", impl="triton", inputs=SHARED_INPUTS)
    RAN_SHARED.add(case.label)
    assert not diffs, f"seed {SEED}: " + "; ".join(diffs)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("case", selfcheck.gpu_cases(SEED), ids=_id)
def test_kernel_matches_reference_gpu(case):
    diffs = selfcheck.run_case(case, "cuda", impl="convert")
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


def _codec_devices():
    out = []
    if INTERPRET:
        out.append(pytest.param("cpu", id="interpreted"))
    out.append(pytest.param("cuda", id="gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]))
    return out


@pytest.mark.parametrize("device", _codec_devices())
@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_e2m1_encoder_on_every_bf16_magnitude_near_a_dozen_scales(device, rule):
    """The kernels' E2M1 encoder (float-add rounding, fp4moe_kernels.triton_kernels.common) against the
    reference on every BF16 value of the six binades below each block scale, ties included, for both
    scale rules, through the three kernels that encode."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import FP8RowTensor, Segments
    from fp4moe_kernels.triton_kernels import launchers

    x = selfcheck.every_bf16_near_scales().to(device)
    assert not selfcheck.compare(launchers.bf16_to_fp4_row(x, rule), ref.bf16_to_fp4_row(x.cpu(), rule))
    if rule == "ceil":  # the fused kernel and FP8 row -> MXFP4 use the default rule
        x128 = x[: x.shape[0] // 4 * 4].reshape(-1, 128)
        seg = Segments.of(None, x128.shape[0])
        got = launchers.bf16_to_fp4_and_fp8_row(x128, seg)
        assert not selfcheck.compare(got, ref.bf16_to_fp4_and_fp8_row(x128.cpu(), None))
        f = ref.bf16_to_fp8_row(x128.cpu(), None)
        f_dev = FP8RowTensor(f.data.to(device), f.scales.to(device), f.segments)
        assert not selfcheck.compare(launchers.fp8_row_to_fp4(f_dev), ref.fp8_row_to_fp4(f))


@pytest.mark.parametrize("device", _codec_devices())
@pytest.mark.parametrize("e4m3, scale_exp", [(None, None), (0x7E, 121), (0x7E, 127), (0x70, 120), (0x01, 127),
                                             (0x7E, 63), (0x7E, 64), (0x01, -126)])
def test_fp8_row_to_fp4_at_the_ends_of_the_exponent_range(device, e4m3, scale_exp):
    """FP8RowToFP4 where E4M3 x scale leaves float32: the kernel formed the product in float32, so one >= 2**128
    became Inf and its 32-block a NaN block (code 255, data 0). (None, None): the case found in review, a BF16 row
    whose element 0 is 0x7F78 (1.9375 * 2**127) through bf16_to_fp8_row (E4M3 256, scale 2**120): the reference
    gives code 253 and the element 4.0 (2**128). The others are FP8 rows built directly (scales up to 2**127 are
    in the format): E4M3 byte ``e4m3`` (0x7E = 448, 0x70 = 256, 0x01 = 2**-9) at element 0 under scale
    2**scale_exp, beside 1.0 (far below it) and an E4M3 denormal in the other blocks of the group; code 254 with
    elements saturated at 6 where the value passes 6 * 2**127, and both sides of the kernel's 2**64 switch."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import FP8RowTensor, Segments
    from fp4moe_kernels.triton_kernels import launchers

    if e4m3 is None:
        bits = torch.zeros(1, 128, dtype=torch.int16)
        bits[0, 0] = 0x7F78
        f = ref.bf16_to_fp8_row(bits.view(torch.bfloat16), None)
        want = ref.fp8_row_to_fp4(f)
        assert want.scales[0, 0].item() == 253 and ref.dequantize_mxfp4(want)[0, 0].item() == 2.0 ** 128
    else:
        data = torch.zeros(1, 128, dtype=torch.uint8)
        data[0, 0], data[0, 40], data[0, 70], data[0, 100] = e4m3, 0x38, 0x01, 0x85  # 448..., 1.0, 2**-9, -5 * 2**-9
        f = FP8RowTensor(data.view(torch.float8_e4m3fn), torch.tensor([2.0 ** scale_exp]), Segments.of(None, 1))
        want = ref.fp8_row_to_fp4(f)
    got = launchers.fp8_row_to_fp4(FP8RowTensor(f.data.to(device), f.scales.to(device), f.segments))
    assert not selfcheck.compare(got, want)


def _every_e4m3_byte_below_every_block_max() -> torch.Tensor:
    """[G, 128] uint8 E4M3 rows: for each of the 126 finite nonzero magnitudes m, blocks whose element 0 is m and whose
    other elements run through every magnitude <= m (E4M3 subnormals and 0 included), so every byte meets every block
    maximum (every block offset d); signs from a fixed pattern (-0 = 0x80 included, and a block of each sign byte);
    then blocks with NaN (0x7F, 0xFF) at the first, a middle and the last element, and an all-zero block."""
    blocks = []
    for m in range(1, 127):
        below = list(range(m + 1))
        for c in range(0, len(below), 31):
            blocks.append([m] + below[c:c + 31] + [0] * (31 - len(below[c:c + 31])))
    data = torch.tensor(blocks, dtype=torch.int64)
    i = torch.arange(data.numel()).reshape(data.shape)
    data = data | (((i * 7 + i // 32) % 3 == 0).to(torch.int64) << 7)  # about one element in three negative
    extra = torch.zeros(8, 32, dtype=torch.int64)
    extra[0, 0], extra[1, 17], extra[2, 31], extra[3, 5] = 0x7F, 0xFF, 0x7F, 0xFF
    extra[3, 6] = 0x7E
    extra[4, :] = 0x80  # -0 everywhere: code 0, nibbles 8
    extra[5, :] = torch.arange(32) | 0x80  # negative subnormals and small normals
    extra[6, :] = torch.arange(95, 127)  # the top magnitudes
    blocks = torch.cat([data, extra])  # extra[7]: an all-zero block
    blocks = torch.cat([blocks, torch.zeros((-blocks.shape[0]) % 4, 32, dtype=torch.int64)])
    return blocks.reshape(-1, 128).to(torch.uint8)


@pytest.mark.parametrize("device", _codec_devices())
@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_fp8_row_to_fp4_on_every_e4m3_byte_below_every_block_max(device, rule):
    """FP8RowToFP4 (f16x2 E2M1 rounding on the E4M3 values, block codes from the E4M3 maximum, packed nibbles,
    signs from the E4M3 bytes) against the reference on every E4M3 byte under every block maximum, NaN bytes, -0,
    for both scale rules and group scales 2**k across the range (code clamped at 0 for k = -126 and at 254, with
    saturating elements, for k >= 121)."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import FP8RowTensor, Segments
    from fp4moe_kernels.triton_kernels import launchers

    rows = _every_e4m3_byte_below_every_block_max()
    ks = [0, -126, 127, 121, 64, 63, -9, 100]
    data = torch.cat([rows] * len(ks))  # one row = one group here (K = 128)
    scales = torch.tensor([2.0 ** k for k in ks], dtype=torch.float32).repeat_interleave(rows.shape[0])
    f = FP8RowTensor(data.view(torch.float8_e4m3fn), scales, Segments.of(None, data.shape[0]))
    want = ref.fp8_row_to_fp4(f, rule)
    got = launchers.fp8_row_to_fp4(FP8RowTensor(f.data.to(device), f.scales.to(device), f.segments), rule)
    assert not selfcheck.compare(got, want)


@pytest.mark.parametrize("device", _codec_devices())
def test_fp4_decoders_on_every_byte_and_scale_code(device):
    """FP4 -> BF16 and MXFP4 -> FP8 row (per-element decode from bits) on all 256 packed bytes x 256 UE8M0
    codes (0: the FP32-denormal scale, 255: NaN blocks) against the reference."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import MXFP4Tensor, Segments
    from fp4moe_kernels.triton_kernels import launchers

    a = selfcheck.every_fp4_byte_and_code()
    a_dev = MXFP4Tensor(a.data.to(device), a.scales.to(device), a.shape)
    assert not selfcheck.compare(launchers.fp4_to_bf16(a_dev), ref.fp4_to_bf16(a))
    # 128-channel groups: four blocks of one scale code each, so every group is lossless
    a128 = MXFP4Tensor(a.data.reshape(-1, 64), a.scales.reshape(-1, 4), (1024, 128))
    a128_dev = MXFP4Tensor(a128.data.to(device), a128.scales.to(device), a128.shape)
    assert not selfcheck.compare(launchers.fp4_row_to_fp8_row(a128_dev, Segments.of(None, 1024)), ref.fp4_row_to_fp8_row(a128, None))


@pytest.mark.parametrize("device", _codec_devices())
def test_fp4_row_to_fp8_row_on_mixed_block_codes(device):
    """FP4RowToFP8Row on random bytes in groups whose four blocks carry different UE8M0 codes: 0..40 below the
    group's largest (blocks more than 14 below land in E4M3 subnormals or round to +-0), NaN blocks (255) in any of
    the four places, code-0 blocks, and groups of fully random codes; ragged segments with an empty expert. The
    kernel reads a group's four codes as one little-endian 32-bit word, block 4g+k in byte k: a wrong byte order
    or shift gives the wrong block its code here."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import MXFP4Tensor, Segments
    from fp4moe_kernels.triton_kernels import launchers

    gen = torch.Generator().manual_seed(7)
    m, k = 300, 512
    data = torch.randint(0, 256, (m, k // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    top = torch.randint(0, 255, (m, k // 128, 1), generator=gen)
    codes = (top - torch.randint(0, 41, (m, k // 128, 4), generator=gen)).clamp(min=0)
    wild = torch.rand(m, k // 128, 1, generator=gen) < 0.1
    codes = torch.where(wild, torch.randint(0, 256, codes.shape, generator=gen), codes)
    codes = torch.where(torch.rand(codes.shape, generator=gen) < 0.05, 255, codes)
    codes[:4, 0] = torch.tensor([[255, 3, 200, 0], [0, 0, 0, 255], [254, 0, 1, 240], [1, 2, 250, 255]])
    a = MXFP4Tensor(data, codes.reshape(m, k // 32).to(torch.uint8), (m, k))
    seg = Segments.of([120, 0, 180], m)
    want = ref.fp4_row_to_fp8_row(a, seg)
    got = launchers.fp4_row_to_fp8_row(MXFP4Tensor(a.data.to(device), a.scales.to(device), a.shape), seg)
    assert not selfcheck.compare(got, want)
    assert torch.equal(got.data.cpu().view(torch.uint8), want.data.view(torch.uint8))  # NaN blocks: 0x7F, no sign

    def odd(t, off=1):  # a contiguous view ``off`` bytes past an 8-byte boundary (the launcher copies data that is
        # not 8-byte aligned, scales that are not 4-byte aligned, before the word loads)
        buf = torch.empty(t.numel() + 8, dtype=t.dtype, device=device)
        v = buf[(-buf.data_ptr() + off) % 8:][: t.numel()].view(t.shape)
        assert v.data_ptr() % 8 == off
        v.copy_(t)
        return v

    assert not selfcheck.compare(launchers.fp4_row_to_fp8_row(MXFP4Tensor(odd(a.data), odd(a.scales), a.shape), seg),
                                 want)
    assert not selfcheck.compare(launchers.fp4_row_to_fp8_row(MXFP4Tensor(odd(a.data, 4), a.scales.to(device), a.shape),
                                                              seg), want)


@pytest.mark.parametrize("device", _codec_devices())
def test_fp4_row_to_fp8_col_on_every_byte_and_scale_code(device):
    """FP4RowToFP8Col on all 256 packed bytes x 256 UE8M0 codes (0: the FP32-denormal scale, 255: NaN blocks),
    in two token orders (a channel's 128 tokens span 32 consecutive codes, or codes spread over the whole range):
    each channel's scale comes from its largest element, the rest land anywhere from E4M3 normals to zero."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import MXFP4Tensor, Segments
    from fp4moe_kernels.triton_kernels import launchers

    a = selfcheck.every_fp4_byte_and_code()
    data, scales = a.data.reshape(-1, 64), a.scales.reshape(-1, 4)  # [1024, 128]
    perm = torch.randperm(1024, generator=torch.Generator().manual_seed(1))
    for d, s in ((data, scales), (data[perm], scales[perm])):
        a128 = MXFP4Tensor(d.contiguous(), s.contiguous(), (1024, 128))
        seg = Segments.of([300, 0, 724], 1024)
        got = launchers.fp4_row_to_fp8_col(MXFP4Tensor(a128.data.to(device), a128.scales.to(device), a128.shape), seg)
        assert not selfcheck.compare(got, ref.fp4_row_to_fp8_col(a128, seg))


@pytest.mark.parametrize("device", _codec_devices())
def test_fp4_row_to_fp8_col_fast_and_rare_tiles(device):
    """FP4RowToFP8Col on typical activations (spread 3) with a NaN block in one tile and a block 2**-60 below its
    neighbours (E4M3 subnormals and zeros after the channel's scale) in another; every byte and scale against the
    reference."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import MXFP4Tensor, Segments
    from fp4moe_kernels.triton_kernels import launchers

    counts = [200, 0, 184]
    x = selfcheck.make_input(384, 256, 5, spread=3, special=False).float()
    x[10, 40] = float("nan")  # tile (tokens 0-127, channels 32-63): code 255
    x[300, 128:160] *= 2.0 ** -60  # tile (second expert, tokens 100-183, channels 128-159)
    a = ref.bf16_to_fp4_row(x.to(torch.bfloat16))
    seg = Segments.of(counts, 384)
    got = launchers.fp4_row_to_fp8_col(MXFP4Tensor(a.data.to(device), a.scales.to(device), a.shape), seg)
    assert not selfcheck.compare(got, ref.fp4_row_to_fp8_col(a, seg))


@pytest.mark.parametrize("device", _codec_devices())
def test_bf16_to_fp8_col_on_every_bf16_pattern_and_edge_channels(device):
    """BF16 -> FP8 column (two channels per 32-bit word, a packed s16 max for the amax, Inf/NaN lanes made positive
    NaNs before the scaling): every one of the 65536 BF16 bit patterns once (NaN and Inf of both signs, -0,
    denormals), then channels built to separate the two lanes of a word: an all-NaN/Inf channel beside a finite one
    (amax 0, scale 1, bytes 0x7F), channels of BF16 denormals only (scale 2**-126), amax at 448 * 2**k and one step
    above, a lone Inf or -NaN among tiny values; ragged segments with odd lengths and empty experts (padding
    zeros), and a BF16 view at an odd element offset. The same for the fused row + column quantizer (rows: the
    channels above are the 1x128 groups' elements too)."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import Segments
    from fp4moe_kernels.triton_kernels import launchers

    g = torch.Generator().manual_seed(7)
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)[torch.randperm(65536, generator=g)]
    edge = torch.randint(-32768, 32768, (256, 256), generator=g, dtype=torch.int32).to(torch.int16)
    c = torch.arange(256)
    edge[:, c % 8 == 0] = torch.tensor([0x7F80, -128, 0x7FC0, -64, 0x7F81])[torch.randint(0, 5, (256, 32), generator=g)].to(torch.int16)
    edge[:, c % 8 == 2] = torch.randint(-128, 128, (256, 32), generator=g).to(torch.int16) & -32641  # sign | 0..0x7F
    edge[:, c % 8 == 3] = torch.randint(0, 0x7F80, (256, 32), generator=g).to(torch.int16)  # finite, any exponent
    edge[:, c % 8 == 4] = 0x3F80  # 1.0 ...
    edge[5, c % 8 == 4] = 0x43E0  # ... and 448: scale 1
    edge[:, c % 8 == 5] = -16512  # -1.0 ...
    edge[9, c % 8 == 5] = -15391  # ... and -(448 + 2): scale 2
    edge[:, c % 8 == 6] = torch.randint(-128, 128, (256, 32), generator=g).to(torch.int16) & -32641
    edge[3, c % 8 == 6] = 0x7F80  # one Inf among denormals: scale from the denormals
    edge[:, c % 8 == 7] = 0x0001
    edge[7, c % 8 == 7] = -64  # -NaN
    for bits, counts in ((every.reshape(256, 256), [256]), (edge, [1, 0, 130, 0, 125])):
        x = bits.view(torch.bfloat16)
        seg = Segments.of(counts, 256)
        got = launchers.bf16_to_fp8_col(x.to(device), seg)
        assert not selfcheck.compare(got, ref.bf16_to_fp8_col(x, seg))
        # the fused row + column quantizer on the same patterns: both copies the reference's
        both = launchers.bf16_to_fp8_row_col(x.to(device), seg)
        assert not selfcheck.compare(both, ref.bf16_to_fp8_row_col(x, seg))
    buf = torch.cat([torch.zeros(1, dtype=torch.int16), edge.reshape(-1)]).view(torch.bfloat16)
    odd = buf.to(device)[1:].view(256, 256)
    seg = Segments.of([100, 156], 256)
    assert not selfcheck.compare(launchers.bf16_to_fp8_col(odd, seg), ref.bf16_to_fp8_col(edge.view(torch.bfloat16), seg))
    assert not selfcheck.compare(launchers.bf16_to_fp8_row_col(odd, seg),
                                 ref.bf16_to_fp8_row_col(edge.view(torch.bfloat16), seg))


@pytest.mark.parametrize("device", _codec_devices())
@pytest.mark.parametrize("bn", [32, 64, 128])
def test_bf16_to_fp8_row_col_in_every_chunk_width(device, bn, monkeypatch):
    """The fused row + column quantizer takes its 128-channel group in chunks of BN channels (two passes: the rows'
    amax, then both copies per chunk) or, at 128, at once: every width the benchmark sweeps gives the reference's bits,
    on ragged segments longer than one 128-token tile, with NaN / Inf and a spread of exponents."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import Segments
    from fp4moe_kernels.triton_kernels import launchers

    monkeypatch.setitem(launchers.TILES, "bf16_to_fp8_row_col", (bn, 0, 2))
    x = selfcheck.make_input(300, 384, SEED + bn, special=True)
    seg = Segments.of([0, 170, 1, 129, 0], 300)
    got = launchers.bf16_to_fp8_row_col(x.to(device), seg)
    assert not selfcheck.compare(got, ref.bf16_to_fp8_row_col(x, seg))


@pytest.mark.skipif(not INTERPRET, reason="CPU kernel tests need TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
def test_the_self_check_can_share_inputs_between_conversions():
    """selfcheck.main generates each input once for every conversion of its shape: no kernel or reference may write
    into it, so after all cases each kept input still equals a fresh one, bit for bit. The cases ran on
    SHARED_INPUTS in test_kernel_matches_reference_interpreted; those that did not (a selection of tests) run here."""
    cases = selfcheck.cpu_cases(SEED)
    for case in cases:
        if case.label not in RAN_SHARED:
            diffs = selfcheck.run_case(case, "cpu", impl="triton", inputs=SHARED_INPUTS)
            assert not diffs, f"seed {SEED}: {case.label}"
    assert len(SHARED_INPUTS) < len(cases)
    for (m, k, seed, device, special, spread), x in SHARED_INPUTS.items():
        fresh = selfcheck.make_input(m, k, seed, device, special=special, spread=spread)
        assert torch.equal(x.view(torch.int16), fresh.view(torch.int16))


@pytest.mark.parametrize("device", _codec_devices())
def test_fp4_to_bf16_on_unaligned_odd_inputs(device):
    """FP4 -> BF16 reads the packed data as int32 words: inputs at an odd byte offset (the launcher copies them to an
    aligned buffer) and a block count that is not a multiple of the tile, with every UE8M0 code and NaN blocks."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import MXFP4Tensor
    from fp4moe_kernels.triton_kernels import launchers

    g = torch.Generator().manual_seed(7)
    m, k = 37, 96  # 111 blocks
    raw = torch.randint(0, 256, (m * k // 2 + 1,), generator=g, dtype=torch.int32).to(torch.uint8)
    codes = torch.arange(m * k // 32, dtype=torch.int32) * 7 % 256  # 0, 7, .., 252, 3, ..: 255 (NaN) included
    codes[5] = 255
    a = MXFP4Tensor(raw[1:].reshape(m, k // 2), codes.to(torch.uint8).reshape(m, k // 32), (m, k))
    dev = MXFP4Tensor(raw.to(device)[1:].reshape(m, k // 2), a.scales.to(device), (m, k))
    assert dev.data.data_ptr() % 4 != 0
    assert not selfcheck.compare(launchers.fp4_to_bf16(dev), ref.fp4_to_bf16(a))


def _bf16_blocks_below_every_kind_of_block_max(seed: int = 0) -> torch.Tensor:
    """BF16 [N, 32] blocks (N a multiple of 4, so they also make 128-element groups): for block maxima M with every
    kind of exponent (BF16 denormals, the smallest normals, 1, the top codes 252/253) and significand (1.0, 1.5
    exactly, just above 1.5, the largest), element 0 is M (or -M) and the other 31 run through every BF16 magnitude
    in the nine binades below |M| (both signs, -0 and zeros included): the ceil rule's ties at 1.5, the floor rule's
    elements in (6, 8) that saturate at 6, and values scaled into E2M1's subnormal step. Plus blocks with NaN, +Inf
    or -Inf beside finite values, all -0 blocks and all zero blocks."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for e in (0, 1, 2, 3, 9, 100, 126, 127, 128, 200, 252, 253, 254):
        for f in (0x00, 0x01, 0x3F, 0x40, 0x41, 0x7F):
            top = (e << 7) | f
            if e == 0 and f == 0:
                continue
            mags = torch.arange(max(top - 9 * 128, 0), top + 1, dtype=torch.int32)
            vals = torch.cat([mags, mags | 0x8000])
            vals = vals[torch.randperm(vals.numel(), generator=g)]
            n = -(-vals.numel() // 31)
            body = torch.cat([vals, torch.zeros(n * 31 - vals.numel(), dtype=torch.int32)]).reshape(n, 31)
            first = torch.full((n, 1), top, dtype=torch.int32) | (torch.randint(0, 2, (n, 1), generator=g) << 15)
            rows.append(torch.cat([first, body], dim=1))
    special = torch.randint(0, 0x7F80, (12, 32), generator=g, dtype=torch.int32)
    for i, v in enumerate((0x7FC0, 0x7F80, 0xFF80, 0xFFC1, 0x7F81, 0x7F80)):
        special[2 * i, (7 * i) % 32] = v
        special[2 * i + 1, 31 - i] = v
    rows += [special, torch.full((2, 32), 0x8000, dtype=torch.int32), torch.zeros(2, 32, dtype=torch.int32)]
    x = torch.cat(rows)
    x = torch.cat([x, torch.zeros((-x.shape[0]) % 4, 32, dtype=torch.int32)])
    return x.to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("device", _codec_devices())
@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_bf16_encoders_below_every_kind_of_block_max(device, rule):
    """BF16ToFP4Row (packed 16-bit max and BF16x2 E2M1 rounding, row._bf16_mxfp4_blocks) and the fused
    BF16 -> (MXFP4, FP8 row) against the reference on every BF16 magnitude in the nine binades under block maxima
    of every kind, NaN/Inf blocks, -0, BF16 denormals, both rules (the fused kernel: ceil), with a ragged last tile
    (the rows are not a multiple of any tile)."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import Segments
    from fp4moe_kernels.triton_kernels import launchers

    x = _bf16_blocks_below_every_kind_of_block_max().to(device)
    assert not selfcheck.compare(launchers.bf16_to_fp4_row(x, rule), ref.bf16_to_fp4_row(x.cpu(), rule))
    x2 = x.reshape(-1, 160)[:-1]  # another row length, 5 blocks per row
    assert not selfcheck.compare(launchers.bf16_to_fp4_row(x2, rule), ref.bf16_to_fp4_row(x2.cpu(), rule))
    if rule == "ceil":
        x128 = x.reshape(-1, 128)
        seg = Segments.of(None, x128.shape[0])
        got = launchers.bf16_to_fp4_and_fp8_row(x128, seg)
        assert not selfcheck.compare(got, ref.bf16_to_fp4_and_fp8_row(x128.cpu(), None))


@pytest.mark.parametrize("device", _codec_devices())
@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_swiglu_fwd_fp4_below_every_kind_of_block_max(device, rule):
    """swiglu_fwd_fp4 (h's MXFP4 by row._bf16_mxfp4_encode, z from the same int64 words) on the blocks of
    test_bf16_encoders_below_every_kind_of_block_max laid out as h [T, 2F]: MXFP4 = the reference's, z = swiglu_fwd's
    bit for bit (g, u not denormal), F = 64 and 96 (2 and 3 blocks per half), weighted and not, T not a multiple of the tile, and an h
    view 4 bytes off 8-byte alignment (copied by the launcher). The GPU runs the launcher's tile; the interpreter 1024
    blocks per program (three programs, the last ragged): the per-element code is the same, and at 32 blocks per
    program the interpreter took ~110 s per rule (CI), at 1024 about 1/20 of that."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import MXFP4Tensor
    from fp4moe_kernels.triton_kernels.fused_swiglu import swiglu_fwd, swiglu_fwd_fp4

    tile = None if device == "cuda" else (1024, 1)
    x = _bf16_blocks_below_every_kind_of_block_max()
    n = x.shape[0]
    hs = [x.reshape(-1, 128), x.reshape(-1, 128)[:-1], x[: n // 6 * 6].reshape(-1, 192)]
    hs = [h.to(device) for h in hs]
    # the offset view is taken on the device: .to(device) of a CPU view allocates afresh (8-byte aligned)
    buf = torch.cat([torch.zeros(2, dtype=torch.bfloat16), x[:48].reshape(-1)]).to(device)
    hs.append(buf[2:].view(-1, 128))
    for i, h in enumerate(hs):
        if i == 3:
            assert h.data_ptr() % 8 == 4
        for probs in (None, torch.rand(h.shape[0], generator=torch.Generator().manual_seed(i)).to(device)):
            z, (q, s) = swiglu_fwd_fp4(h, probs, rule, tile=tile)
            want = ref.bf16_to_fp4_row(h.cpu(), rule)
            assert not selfcheck.compare(MXFP4Tensor(q.cpu(), s.cpu(), tuple(h.shape)), want)
            # z where g and u are not BF16 denormals: the plain kernel's bf16 -> float32 load under the interpreter
            # treats those differently from the exact shift (a difference older than the packed encoder, 6aa9148)
            e = h.cpu().view(torch.int16).to(torch.int32) & 0x7F80
            ok = ((e[:, : h.shape[1] // 2] != 0) & (e[:, h.shape[1] // 2:] != 0)).to(z.device)
            assert torch.equal(z.view(torch.int16)[ok], swiglu_fwd(h.contiguous(), probs).view(torch.int16)[ok])


@pytest.mark.parametrize("device", _codec_devices())
def test_bf16_encoders_on_an_input_4_bytes_off_8_byte_alignment(device):
    """The BF16 MXFP4 encoders read blocks as int64 pairs; an input view 4 bytes past an 8-byte boundary is copied
    by the launchers first (else misaligned loads on a GPU); the result is the reference's."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import Segments
    from fp4moe_kernels.triton_kernels import launchers

    buf = torch.randn(2 + 8 * 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
    x = buf[2:].view(8, 256)
    assert x.data_ptr() % 8 == 4
    assert not selfcheck.compare(launchers.bf16_to_fp4_row(x), ref.bf16_to_fp4_row(x.cpu()))
    got = launchers.bf16_to_fp4_and_fp8_row(x, Segments.of(None, 8))
    assert not selfcheck.compare(got, ref.bf16_to_fp4_and_fp8_row(x.cpu(), None))


@pytest.mark.parametrize("device", _codec_devices())
def test_fp8_row_to_fp4_on_an_input_4_bytes_off_8_byte_alignment_and_a_tail(device):
    """FP8RowToFP4 reads each group as int64 pairs of words: an FP8 view 4 bytes past an 8-byte boundary is copied by
    the launcher first (else misaligned loads on a GPU). 3 experts over 301 rows of K = 128: a last program that is
    mostly past the end (its threads re-read the last group and store nothing)."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import FP8RowTensor, Segments

    from fp4moe_kernels.triton_kernels import launchers

    rows = torch.cat([_every_e4m3_byte_below_every_block_max()] * 4)[:301]
    buf = torch.zeros(4 + rows.numel(), dtype=torch.uint8)
    buf[4:] = rows.reshape(-1)
    buf = buf.to(device)
    data = buf[4:].view(301, 128).view(torch.float8_e4m3fn)
    assert data.data_ptr() % 8 == 4
    scales = torch.tensor([2.0 ** (i % 19 * 13 - 120) for i in range(301)], dtype=torch.float32)
    seg = Segments.of([100, 0, 201], 301)
    f = FP8RowTensor(data.cpu(), scales, seg)
    want = ref.fp8_row_to_fp4(f)
    assert not selfcheck.compare(launchers.fp8_row_to_fp4(FP8RowTensor(data, scales.to(device), seg)), want)


@pytest.mark.parametrize("device", _codec_devices())
def test_fused_bf16_fp8_part_with_inf_and_nan_in_one_lane_parity(device):
    """BF16 -> (MXFP4, FP8 row): groups whose even (or odd) elements are all Inf or NaN beside finite ones (the
    kernel's finite maximum runs on packed 16-bit lanes, one lane per parity), groups of only Inf, only NaN, a lone
    -Inf among BF16 denormals, and a program with Inf but no NaN (the kernel's Inf/NaN switch); FP8 bytes compared
    bit for bit, NaN payloads included."""
    from fp4moe_kernels import reference as ref
    from fp4moe_kernels.formats import Segments
    from fp4moe_kernels.triton_kernels import launchers

    gen = torch.Generator().manual_seed(11)
    fin = (torch.randn(12, 128, generator=gen) * 3.0).to(torch.bfloat16).view(torch.int16)
    rows = fin.clone()
    rows[0, 0::2] = 0x7F80  # +Inf at even elements
    rows[1, 0::2] = 0x7FC0  # NaN at even elements
    rows[2, 1::2] = -128  # 0xFF80: -Inf at odd elements
    rows[3, 1::2] = -64  # 0xFFC0: NaN at odd elements
    rows[4, :] = 0x7F80
    rows[5, :] = 0x7FC0
    rows[6, :] = torch.arange(128, dtype=torch.int16) % 127 + 1  # BF16 denormals
    rows[6, 77] = -128
    x = rows.view(torch.bfloat16)
    for xs in (x, x[[0, 2, 4, 8]]):  # the second: Inf but no NaN
        got = launchers.bf16_to_fp4_and_fp8_row(xs.to(device), Segments.of(None, xs.shape[0]))
        want = ref.bf16_to_fp4_and_fp8_row(xs.cpu(), None)
        assert not selfcheck.compare(got, want)
        # NaN payloads too: Inf and NaN of either sign are E4M3 0x7F, as in the reference
        assert torch.equal(got[1].data.cpu().view(torch.uint8), want[1].data.view(torch.uint8))
