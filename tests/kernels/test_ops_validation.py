"""The public API rejects bad input with a FormatError that names the problem and the fix."""
import pytest
import torch

from fp4moe_kernels import FormatError, FP8RowTensor, MXFP4Tensor, Segments
from fp4moe_kernels import convert as ops
from fp4moe_kernels.switches import SwitchError


def x_bf16(m=4, k=256):
    return torch.randn(m, k).to(torch.bfloat16)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ops.bf16_to_fp4_row(x_bf16(256, 256).t()), "contiguous"),
        (lambda: ops.bf16_to_fp4_row(x_bf16()[:, ::2]), "contiguous"),
        (lambda: ops.bf16_to_fp4_row(torch.randn(4, 256).half()), "dtype"),
        (lambda: ops.bf16_to_fp4_row(torch.ones(4, 256, dtype=torch.int32)), "dtype"),
        (lambda: ops.bf16_to_fp4_row(torch.randn(256).bfloat16()), "2-D"),
        (lambda: ops.bf16_to_fp4_row(x_bf16(4, 48)), "multiple of 32"),
        (lambda: ops.bf16_to_fp8_row(x_bf16(4, 192)), "multiple of 128"),
        (lambda: ops.bf16_to_fp8_col(x_bf16(), counts=[1, 2]), "counts sum to 3"),
        (lambda: ops.bf16_to_fp4_row(x_bf16(), rule="round"), "scale rule"),
        (lambda: ops.fp4_row_to_fp8_row(x_bf16()), "MXFP4Tensor"),
        (lambda: ops.fp8_row_to_fp4(x_bf16()), "FP8RowTensor"),
        (lambda: ops.fp4_row_to_fp8_col(ops.bf16_to_fp4_row(x_bf16(4, 96))), "multiple of 128"),
    ],
)
def test_bad_input_raises_format_error_naming_the_fix(call, match):
    with pytest.raises(FormatError, match=match):
        call()


def test_containers_reject_mixed_devices_and_strided_scales():
    f = ops.bf16_to_fp8_row(x_bf16(8, 256))
    with pytest.raises(FormatError, match="device"):
        FP8RowTensor(f.data, f.scales.to("meta"), f.segments)
    strided = torch.empty(2 * f.scales.numel(), dtype=torch.float32)[::2]
    with pytest.raises(FormatError, match="contiguous"):
        FP8RowTensor(f.data, strided, f.segments)
    a = ops.bf16_to_fp4_row(x_bf16(8, 256))
    with pytest.raises(FormatError, match="scales on meta|device"):
        MXFP4Tensor(a.data, a.scales.to("meta"), a.shape)
    with pytest.raises(FormatError, match="segments cover"):
        FP8RowTensor(f.data, f.scales, Segments((3, 4)))


def test_tile_overrides_from_the_environment(tmp_path):
    """FP4MOE_TILES: inline JSON or a benchmark's JSON output (its env.tiles_adopted); typos are clear errors."""
    import json

    from fp4moe_kernels.triton_kernels.launchers import tiles_from_env

    assert tiles_from_env("") == {}
    assert tiles_from_env('{"fp4_row_to_fp8_col": [32, 0, 1]}') == {"fp4_row_to_fp8_col": (32, 0, 1)}
    bench_out = tmp_path / "kernels_h200.json"
    bench_out.write_text(json.dumps({"env": {"tiles_adopted": {"bf16_to_fp8_col": [64, 0, 2]}}, "rows": []}))
    assert tiles_from_env(str(bench_out)) == {"bf16_to_fp8_col": (64, 0, 2)}
    with pytest.raises(ValueError, match="unknown kernel 'fp4_row_to_fp8_cols'"):
        tiles_from_env('{"fp4_row_to_fp8_cols": [32, 0, 1]}')
    with pytest.raises(ValueError, match=r"\[size, 0, num_warps\]"):
        tiles_from_env('{"fp4_row_to_fp8_col": [32, 1]}')
    with pytest.raises(ValueError, match="not a JSON object nor a readable JSON file"):
        tiles_from_env(str(tmp_path / "missing.json"))


def test_apply_tiles_sets_both_tables_from_the_switches_or_neither():
    """launchers.apply_tiles (the trainer's kernels.tiles / kernels.gemm_tiles): the defaults with the switches' specs
    over them; a bad spec is refused naming its variable and leaves both tables as they were."""
    from fp4moe_kernels.switches import Switches
    from fp4moe_kernels.triton_kernels import launchers

    saved = (dict(launchers.TILES), dict(launchers.GEMM_TILES))  # the environment's, as the import set them
    try:
        launchers.apply_tiles(Switches(tiles='{"fp4_to_bf16": [32, 0, 4]}', gemm_tiles='{"wgrad": [128, 64, 8, 3]}'))
        assert launchers.TILES == {**launchers.DEFAULT_TILES, "fp4_to_bf16": (32, 0, 4)}
        assert launchers.GEMM_TILES == {**launchers.DEFAULT_GEMM_TILES, "wgrad": (128, 64, 8, 3)}
        before = (dict(launchers.TILES), dict(launchers.GEMM_TILES))
        with pytest.raises(ValueError, match=r"FP4MOE_GEMM_TILES='\{\"rows\": \[1, 2\]\}' is not valid"):
            launchers.apply_tiles(Switches(gemm_tiles='{"rows": [1, 2]}'))
        assert (launchers.TILES, launchers.GEMM_TILES) == before
        launchers.apply_tiles(Switches())
        assert (launchers.TILES, launchers.GEMM_TILES) == (launchers.DEFAULT_TILES, launchers.DEFAULT_GEMM_TILES)
    finally:
        for table, old in zip((launchers.TILES, launchers.GEMM_TILES), saved):
            table.clear()
            table.update(old)


@pytest.mark.parametrize("value, mode", [(None, "auto"), ("", "auto"), ("AUTO", "auto"), ("1", "1"), (" 0 ", "0")])
def test_cuda_col_switch_values(monkeypatch, value, mode):
    """FP4MOE_CUDA_COL: unset / auto (CUDA C++ where it builds), 1, 0; anything else names the variable and values."""
    if value is None:
        monkeypatch.delenv(ops.CUDA_COL_ENV, raising=False)
    else:
        monkeypatch.setenv(ops.CUDA_COL_ENV, value)
    assert ops.cuda_col_mode() == mode
    monkeypatch.setenv(ops.CUDA_COL_ENV, "on")
    with pytest.raises(SwitchError, match="FP4MOE_CUDA_COL='on': use auto"):
        ops.cuda_col_mode()


def _tile_tables_by_definition(seg, bm):
    """The grouped GEMM's and the column kernels' tile tables written out as loops (the definitions)."""
    from fp4moe_kernels.triton_kernels import col

    rows = [(e, r0 + t0, min(bm, c - t0)) for e, (r0, c) in enumerate(zip(seg.offsets[:-1], seg.counts))
            for t0 in range(0, c, bm)]
    cols = [(r0 + t0, min(col.TILE_T, c - t0), p, mp, t0)
            for r0, c, p, mp in zip(seg.offsets[:-1], seg.counts, seg.padded_offsets[:-1], seg.padded_counts)
            for t0 in range(0, mp, col.TILE_T)]
    return (torch.tensor(rows, dtype=torch.int32).reshape(-1, 3),
            torch.tensor(cols, dtype=torch.int32).reshape(-1, col.TILE_FIELDS))


@pytest.mark.parametrize("counts", [(0,), (1,), (128,), (129, 0, 0, 64), (0, 0, 300), (5, 127, 128, 129, 1000, 0, 2),
                                    tuple(range(0, 3300, 100))])
@pytest.mark.parametrize("bm", [64, 128])
def test_tile_tables_match_their_definition(counts, bm):
    """The vectorized tile tables (launchers._row_tiles, launchers._col_tiles) equal the loops that define them, on empty
    experts, partial and exact tiles, one row, one segment."""
    from fp4moe_kernels.formats import Segments
    from fp4moe_kernels.triton_kernels import launchers

    seg = Segments(counts)
    rows, cols = _tile_tables_by_definition(seg, bm)
    got_rows, got_off = launchers._row_tiles(seg, bm, "cpu")
    assert got_rows.dtype == torch.int32 and torch.equal(got_rows, rows)
    assert torch.equal(got_off, torch.tensor(seg.offsets, dtype=torch.int32))
    got_cols = launchers._col_tiles(seg, "cpu")
    assert got_cols.dtype == torch.int32 and torch.equal(got_cols, cols)
