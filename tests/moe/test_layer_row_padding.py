"""Rows padded for the expert GEMMs by the dispatch (fp4moe.moe.dispatch, "Rows padded for the expert GEMMs"):
with a forced alignment (DeepGEMM's 128 on the GPU; 1 on the CPU otherwise), the standalone layer whose permutation 1
(W = 1) or permutation 2 (W = 2, two local experts, gloo) gathers the rows straight into the padded layout gives,
bit for bit, what the layer gives when ``grouped_expert_mlp`` pads the rows itself (``pad_in_dispatch = False``):
output, input gradient, probability gradient, every weight gradient, for the bf16 and fp8 recipes, fp8 with an FP8
gradient all-to-all, mxfp4 without dispatch_fp4, and the mxfp4 preset (dispatch_fp4: the MXFP4 rows that permutation
1 gathers, or that permutation 2 reorders, padded with zero codes and zero scales; the experts' MXFP4 input compared
byte for byte, which is what a wrong padding scale changes on the CPU); with the experts' recompute too. Counts
include empty experts and experts already aligned. And the gathers: two [R, H] row gathers fewer each way (forward
and backward), and the experts get aligned counts. ``FP4MOE_DISPATCH_QUANTIZE=rows`` keeps the experts' padding.
"""
from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from fp4moe.moe import MoELayer
from fp4moe.recipe import Recipe

H, F, E, K = 256, 128, 8, 2
RECIPES = {
    "bf16": Recipe.bf16(),
    "fp8": Recipe.fp8(),
    "fp8_bwd_a2a_fp8": Recipe.from_config({"name": "fp8", "backward_a2a": "fp8"}),
    "mxfp4_no_dispatch_fp4": Recipe.from_config({"name": "mxfp4", "dispatch_fp4": False}),
    "mxfp4": Recipe.mxfp4(),  # dispatch_fp4: permutation 1 gathers the MXFP4 rows padded
}
# expert-major rows of the routing: empty experts (1, 5), aligned ones (0 and 4 at align 8; 0 at align 128)
COUNTS = {8: [8, 0, 13, 3, 16, 0, 7, 1], 128: [128, 0, 37, 5, 70, 0, 1, 15]}


def routing(counts, seed: int):
    """top-2 ids ``[T, 2]`` with the given rows per expert (T = sum/2; the first half of the sorted expert list pairs
    with the second half, so each token's two experts differ) and positive probabilities."""
    ids = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    t = ids.numel() // 2
    idx = torch.stack([ids[:t], ids[t:]], 1)
    assert (idx[:, 0] != idx[:, 1]).all()
    g = torch.Generator().manual_seed(seed)
    idx = idx[torch.randperm(t, generator=g)]  # tokens in any order
    return idx, torch.rand(t, K, generator=g) + 0.05


def make(recipe, align, pad_in_dispatch, group=None, recompute=False):
    layer = MoELayer(H, F, E, K, recipe, group, shared_ffn=0, seed=11, row_align=align, expert_recompute=recompute)
    layer.pad_in_dispatch = pad_in_dispatch
    return layer


def run(layer, x, dy, idx, probs):
    xx, p = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
    y = layer.forward_routed(xx, idx, p)
    y.backward(dy)
    return dict(y=y.detach(), x=xx.grad, probs=p.grad, w1=layer.w1.grad, w2=layer.w2.grad)


def inputs(idx, seed):
    """x, dL/dy ``[T, H]`` bf16 for the routing ``idx``. dy's rows are scaled by powers of two, 2^4 for the tokens of
    expert 0 (aligned: no padding) and 2^-1 .. 2^-15 for the others, so that a non-zero gradient on a padding row (a
    copy of some token's: of the first routed row's, which is expert 0's) would raise the FP8 column scales of dy
    in the wgrad and push the small values of the expert's rows into E4M3's subnormals, changing bits (a power-of-two
    scale change alone rounds normal values the same)."""
    t = idx.shape[0]
    g = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(t, H, generator=g) for _ in range(2))
    scale = torch.exp2(-torch.randint(1, 16, (t,), generator=g).float())
    scale[(idx == 0).any(1)] = 16.0
    return x.to(torch.bfloat16), (dy * scale[:, None]).to(torch.bfloat16)


def differing(a: dict, b: dict) -> list[str]:
    assert all(v is not None for v in (*a.values(), *b.values()))
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("align", [8, 128])
@pytest.mark.parametrize("name", list(RECIPES))
def test_dispatch_padding_is_the_experts_padding_bit_for_bit(name, align):
    recipe = RECIPES[name]
    idx, probs = routing(COUNTS[align], seed=align)
    x, dy = inputs(idx, seed=1)
    want = run(make(recipe, align, False), x, dy, idx, probs)
    got = run(make(recipe, align, True), x, dy, idx, probs)
    assert differing(got, want) == []
    assert not want["w1"][1].any() and not want["w1"][5].any()  # the empty experts


@pytest.mark.parametrize("name", ["fp8", "mxfp4_no_dispatch_fp4"])
def test_dispatch_padding_with_the_experts_recompute(name):
    """The experts' recompute caches the padded rows (BF16, or MXFP4 of them under the mxfp4 recipe; the mxfp4
    preset's dispatched MXFP4 rows: test_dispatched_mxfp4_rows_padded_by_permutation_1)."""
    recipe = RECIPES[name]
    idx, probs = routing(COUNTS[8], seed=2)
    x, dy = inputs(idx, seed=3)
    want = run(make(recipe, 8, False), x, dy, idx, probs)
    got = run(make(recipe, 8, True, recompute=True), x, dy, idx, probs)
    assert differing(got, want) == []


class _ExpertInputs:
    """Records what ``GroupedExpertMLP`` gets (monkeypatched): the counts, the MXFP4 input's data and scales (None for
    BF16 rows) and the probabilities, per call; and the calls of ``grouped_experts.padded_rows`` (the experts' own
    padding; the dispatch's, through ``fp4moe.moe.dispatch``'s own import, is not seen)."""

    def __init__(self, monkeypatch):
        import fp4moe.ops.grouped_experts as ge

        self.calls, self.pads = [], []
        real_mlp, real_pad = ge.GroupedExpertMLP.forward, ge.padded_rows

        def forward(ctx, x_hp, probs, x_fp4, recipe, seg, *ws):
            fp4 = None if x_fp4 is None else (x_fp4.data.clone(), x_fp4.scales.clone())
            self.calls.append((seg.counts, fp4, probs.detach().clone()))
            return real_mlp(ctx, x_hp, probs, x_fp4, recipe, seg, *ws)

        monkeypatch.setattr(ge.GroupedExpertMLP, "forward", staticmethod(forward))
        monkeypatch.setattr(ge, "padded_rows", lambda seg, *a: self.pads.append(seg.counts) or real_pad(seg, *a))

    def take(self):
        out = (list(self.calls), list(self.pads))
        self.calls.clear()
        self.pads.clear()
        return out


def _same_expert_inputs(a, b) -> bool:
    """Two runs' ``_ExpertInputs`` calls hold the same counts and bit-equal MXFP4 data, scales and probabilities."""
    return len(a) == len(b) and all(
        ca == cb and (fa is None) == (fb is None) and (fa is None or all(torch.equal(u, v) for u, v in zip(fa, fb)))
        and torch.equal(pa, pb) for (ca, fa, pa), (cb, fb, pb) in zip(a, b))


def _mxfp4_case(monkeypatch, align: int, recompute: bool, recipe=None):
    """The mxfp4 preset (dispatch_fp4: permutation 1 gathers the MXFP4 rows) at W = 1: (what differs between the
    experts padding and the dispatch padding, the reference's and the dispatch's ``_ExpertInputs``)."""
    recipe = recipe or RECIPES["mxfp4"]
    seen = _ExpertInputs(monkeypatch)
    idx, probs = routing(COUNTS[align], seed=40 + align)
    x, dy = inputs(idx, seed=41)
    want = run(make(recipe, align, False, recompute=recompute), x, dy, idx, probs)
    ref = seen.take()
    got = run(make(recipe, align, True, recompute=recompute), x, dy, idx, probs)
    return differing(got, want), ref, seen.take()


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("align", [8, 128])
def test_dispatched_mxfp4_rows_padded_by_permutation_1(monkeypatch, align, recompute):
    """The mxfp4 preset at W = 1: permutation 1 gathers each token's MXFP4 rows straight into the padded layout
    (zero codes, zero scales on the padding), the experts get aligned counts and pad nothing, and the output and
    every gradient equal the experts' own padding bit for bit; the experts' MXFP4 input too (data and scales: on
    the CPU a padding row's scale changes no value, so only this comparison sees it), with the experts' recompute
    ('fp4' cache: the padded MXFP4 rows) or without."""
    diff, (ref_calls, ref_pads), (calls, pads) = _mxfp4_case(monkeypatch, align, recompute)
    assert diff == []
    runs = 2 if recompute else 1  # the recompute runs the experts again in the backward
    assert len(ref_pads) == runs and pads == []  # the reference's experts padded; the dispatch's did not
    padded = tuple(-(-c // align) * align for c in COUNTS[align])
    assert [c for c, _, _ in calls] == [padded] * runs and all(f is not None for _, f, _ in calls)
    assert _same_expert_inputs(calls, ref_calls)


def test_a_wrong_padding_scale_is_seen(monkeypatch):
    """The comparison above fails when permutation 1 writes another scale byte on the padding (a mutation of
    ``all_to_all._zero_rows``): the experts' MXFP4 inputs differ, though on the CPU no value does (zero codes), so
    the output and gradients still agree; with large non-zero padding rows the weight gradient differs too."""
    import fp4moe.ops.all_to_all as a2a

    real = a2a._zero_rows

    def mutant(code: int, scale: int):
        return lambda t, pad: real(t, pad) if pad is None else t.index_fill_(0, pad, scale if t.shape[1] == H // 32
                                                                              else code)

    monkeypatch.setattr(a2a, "_zero_rows", mutant(0, 127))  # scale 2^0 on the padding
    diff, (ref_calls, _), (calls, _) = _mxfp4_case(monkeypatch, 8, False)
    assert not _same_expert_inputs(calls, ref_calls)
    # padding rows of 6 * 2^73 (scale byte 200): they raise the FP8 column scales of x in fc1's wgrad past the
    # exponent range of the real rows (FP4RowToFP8Col is lossless over 14 binades only), and fc2's
    monkeypatch.setattr(a2a, "_zero_rows", mutant(0x77, 200))
    diff, (ref_calls, _), (calls, _) = _mxfp4_case(monkeypatch, 8, False)
    assert not _same_expert_inputs(calls, ref_calls) and "w1" in diff


def test_dispatch_fp4_rows_mode_keeps_the_experts_padding(monkeypatch):
    """FP4MOE_DISPATCH_QUANTIZE=rows (the BF16 rows permuted, then quantized by the dispatch): permutation 1 does not
    pad (the experts pad the MXFP4 rows, as before); the same bits."""
    monkeypatch.setenv("FP4MOE_DISPATCH_QUANTIZE", "rows")
    layer = make(RECIPES["mxfp4"], 8, True)
    assert not layer.quantize_tokens
    diff, (ref_calls, ref_pads), (calls, pads) = _mxfp4_case(monkeypatch, 8, False)
    assert diff == [] and len(ref_pads) == len(pads) == 1 and _same_expert_inputs(calls, ref_calls)


def test_padded_mxfp4_gathers_are_the_experts_padding():
    """quantize_gather_rows with a padded permutation 1 and reorder_rows(pad=) of a DispatchedMXFP4 (permutation 2)
    hold the bits of the unpadded gather followed by the experts' own padding (``_pad_mxfp4``: zero codes, zero
    scales), and their gradient anchors give the same gradients (the padding rows' not read)."""
    from fp4moe.moe.dispatch import local_expert_permutation, permutation_from_topk, permute_tokens, reorder_rows, \
        row_padding
    from fp4moe.ops.grouped_experts import _pad_mxfp4, _PadAnchor

    counts = COUNTS[8]
    idx, probs = routing(counts, seed=9)
    rp = row_padding(counts, 8, torch.device("cpu"))
    perm, _ = permutation_from_topk(idx, probs)
    x = (torch.randn(idx.shape[0], H) * 4).to(torch.bfloat16).requires_grad_(True)
    recipe = RECIPES["mxfp4"]
    got, plain = permute_tokens(x, perm.padded(rp), recipe), permute_tokens(x, perm, recipe)
    want = _pad_mxfp4(plain.mxfp4(), rp)
    assert got.shape == want.shape and torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales)
    assert not got.data[rp.pad].any() and not got.scales[rp.pad].any() and got.scales[rp.dst].all()
    g = torch.randn(rp.padded.total, H).to(torch.bfloat16)
    g[rp.pad] = float("nan")  # never read
    d_got = torch.autograd.grad(got.dequantize_ste(), x, g)[0]
    d_want = torch.autograd.grad(_PadAnchor.apply(plain.grad_anchor, rp), x, g)[0]
    assert torch.equal(d_got, d_want) and not d_got.isnan().any()
    # permutation 2 of received MXFP4 rows (two source ranks of 4 local experts each)
    recv = torch.tensor(counts).view(2, 4)
    n = int(recv.sum())
    p2 = local_expert_permutation(recv.reshape(-1), torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]), n, "cpu")
    rp2 = row_padding(recv.sum(0), 8, torch.device("cpu"))
    got, plain = (reorder_rows(permute_tokens(x, perm, recipe), p2, pad=pad) for pad in (rp2, None))
    want = _pad_mxfp4(plain.mxfp4(), rp2)
    assert torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales)
    g2 = torch.randn(rp2.padded.total, H).to(torch.bfloat16)
    g2[rp2.pad] = float("nan")
    d_got = torch.autograd.grad(got.dequantize_ste(), x, g2)[0]
    d_want = torch.autograd.grad(_PadAnchor.apply(plain.grad_anchor, rp2), x, g2)[0]
    assert torch.equal(d_got, d_want) and not d_got.isnan().any()
    with pytest.raises(ValueError, match="not both"):
        reorder_rows(got, p2, unpad=rp2)


def test_padded_gathers_are_the_composed_maps():
    """permute_tokens / unpermute_tokens with a padded permutation 1, and reorder_rows with pad= / unpad=, equal the
    plain gather followed (preceded) by the padding, forward and backward, with zero rows / gradients on the padding."""
    from fp4moe.moe.dispatch import (local_expert_permutation, permutation_from_topk, permute_tokens, reorder_rows,
                                     row_padding, unpermute_tokens)
    from fp4moe.ops.grouped_experts import map_rows

    counts = COUNTS[8]
    idx, probs = routing(counts, seed=9)
    assert row_padding([8, 0, 16], 8, "cpu") is None and row_padding(counts, 1, "cpu") is None
    rp = row_padding(counts, 8, torch.device("cpu"))
    perm, _ = permutation_from_topk(idx, probs)
    x = torch.randn(idx.shape[0], 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(rp.padded.total, 16, dtype=torch.float64)
    rows = permute_tokens(x, perm.padded(rp), Recipe.bf16())
    want = map_rows(permute_tokens(x, perm, Recipe.bf16()), rp.rows, rp.unpad)
    assert torch.equal(rows, want) and not rows[rp.pad].any()
    assert torch.equal(*(torch.autograd.grad(v, x, g)[0] for v in (rows, want)))
    y = torch.randn(rp.padded.total, 16, dtype=torch.float64, requires_grad=True)
    gt = torch.randn(idx.shape[0], 16, dtype=torch.float64)
    out, ref = unpermute_tokens(y, perm.padded(rp)), unpermute_tokens(map_rows(y, rp.unpad, rp.rows), perm)
    assert torch.equal(out, ref)
    dy = torch.autograd.grad(out, y, gt)[0]
    assert torch.equal(dy, torch.autograd.grad(ref, y, gt)[0]) and not dy[rp.pad].any()
    # permutation 2 (two source ranks of 4 local experts each, as chunks [2, 4]) and its inverse
    recv = torch.tensor(counts).view(2, 4)
    n = int(recv.sum())
    p2 = local_expert_permutation(recv.reshape(-1), torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]), n, "cpu")
    back = local_expert_permutation(recv.T.reshape(-1), torch.tensor([0, 2, 4, 6, 1, 3, 5, 7]), n, "cpu")
    rp2 = row_padding(recv.sum(0), 8, torch.device("cpu"))
    r = torch.randn(n, 16, dtype=torch.float64, requires_grad=True)
    got, want = reorder_rows(r, p2, pad=rp2), map_rows(reorder_rows(r, p2), rp2.rows, rp2.unpad)
    g2 = torch.randn(rp2.padded.total, 16, dtype=torch.float64)
    assert torch.equal(got, want) and torch.equal(*(torch.autograd.grad(v, r, g2)[0] for v in (got, want)))
    yp = torch.randn(rp2.padded.total, 16, dtype=torch.float64, requires_grad=True)
    got, want = reorder_rows(yp, back, unpad=rp2), reorder_rows(map_rows(yp, rp2.unpad, rp2.rows), back)
    assert torch.equal(got, want) and torch.equal(reorder_rows(got, p2), map_rows(yp, rp2.unpad, rp2.rows))
    d_got, d_want = (torch.autograd.grad(v, yp, r.detach())[0] for v in (got, want))
    assert torch.equal(d_got, d_want) and not d_got[rp2.pad].any()


class _RowGathers(TorchDispatchMode):
    """Counts ``index_select`` calls that gather [*, H] rows (the routed rows and the experts' output rows)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index_select.default and out.dim() == 2 and out.shape[1] == H:
            self.n += 1
        return out


def test_dispatch_padding_saves_two_row_gathers_each_way(monkeypatch):
    """fp8, W = 1, align 8: permutation 1 and its inverse read / write the padded rows; grouped_expert_mlp gets
    aligned counts and pads nothing (its padded_rows is not called), so the forward and the backward each gather
    [R, H] rows twice less."""
    import fp4moe.ops.grouped_experts as ge

    calls = []
    real = ge.padded_rows
    monkeypatch.setattr(ge, "padded_rows", lambda seg, *a: calls.append(seg.counts) or real(seg, *a))
    seen = []
    real_mlp = ge.GroupedExpertMLP.forward
    monkeypatch.setattr(ge.GroupedExpertMLP, "forward",
                        staticmethod(lambda ctx, *a: seen.append(a[4].counts) or real_mlp(ctx, *a)))
    idx, probs = routing(COUNTS[8], seed=4)
    x, dy = inputs(idx, seed=5)
    gathers = {}
    for pad_in_dispatch in (False, True):
        layer = make(RECIPES["fp8"], 8, pad_in_dispatch)
        xx, p = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        with _RowGathers() as fwd:
            y = layer.forward_routed(xx, idx, p)
        with _RowGathers() as bwd:
            y.backward(dy)
        gathers[pad_in_dispatch] = (fwd.n, bwd.n)
    padded = (8, 0, 16, 8, 16, 0, 8, 8)
    # the experts' own padding ran once (first layer), the dispatch's once (second layer; padded_rows is called
    # through fp4moe.moe.dispatch.row_padding, which imports it by name: not seen here)
    assert calls == [tuple(COUNTS[8])]
    assert seen == [padded, padded]  # the experts ran on the padded counts both times
    (f0, b0), (f1, b1) = gathers[False], gathers[True]
    assert (f0 - f1, b0 - b1) == (2, 2), gathers


# ----------------------------------------------------------------------------------------------- EP = 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# (recipe, the experts' recompute): the mxfp4 preset's received MXFP4 rows padded by permutation 2 too
EP2_CASES = (("bf16", False), ("fp8", False), ("mxfp4_no_dispatch_fp4", False), ("mxfp4", False), ("mxfp4", True))


def _ep2_inputs(rank: int):
    """Rank r's tokens and routing: 12 + 8r tokens, ragged counts with an empty expert on each rank's side."""
    counts = [[5, 0, 3, 8, 1, 0, 6, 1], [9, 2, 0, 8, 3, 0, 1, 17]][rank]
    idx, probs = routing(counts, seed=20 + rank)
    x, dy = inputs(idx, seed=30 + rank)
    return x, dy, idx, probs


def _ep2_worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    res = {}
    try:
        x, dy, idx, probs = _ep2_inputs(rank)
        with pytest.MonkeyPatch.context() as mpatch:
            seen = _ExpertInputs(mpatch)
            for name, recompute in EP2_CASES:
                want = run(make(RECIPES[name], 8, False, dist.group.WORLD, recompute), x, dy, idx, probs)
                ref_calls, ref_pads = seen.take()
                got = run(make(RECIPES[name], 8, True, dist.group.WORLD, recompute), x, dy, idx, probs)
                calls, pads = seen.take()
                key = f"{name}{' recompute' if recompute else ''}"
                # the experts' own padding: the reference's (once, twice under the recompute) and the dispatch's
                res[f"{key} experts padded"] = (len(ref_pads), len(pads))
                res[key] = differing(got, want) + ([] if _same_expert_inputs(calls, ref_calls) else ["inputs"])
    finally:
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()


def test_ep2_permutation_2_pads_bit_for_bit(tmp_path):
    """W = 2 (four local experts each, gloo): permutation 2 writes the padded rows (BF16, or the received MXFP4 rows
    of the mxfp4 preset, with or without the experts' recompute) and its inverse reads them; the experts' inputs
    (counts, MXFP4 data and scales, probabilities) are those of the experts' own padding."""
    mp.spawn(_ep2_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    want = {}
    for name, recompute in EP2_CASES:
        key = f"{name}{' recompute' if recompute else ''}"
        want[key], want[f"{key} experts padded"] = [], (2 if recompute else 1, 0)
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        # the reference's experts padded their rows, the dispatch's padding left them nothing to pad
        assert res == want, (rank, res)
