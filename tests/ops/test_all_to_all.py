"""quantized_all_to_all (fp4moe.ops.all_to_all) on two real processes, and its byte accounting.

Two ranks (torch.multiprocessing, gloo on 127.0.0.1, CPU; ``-m gpu``: NCCL on two GPUs) exchange tokens with
uneven splits, a rank sending 0 rows to its peer, and a rank with no tokens at all, for every forward codec
(mxfp4, fp8, bf16) and backward codec (bf16, fp8). Each rank saves its outputs and input gradients; the
test process recomputes them in a single process with ``fp4moe_kernels`` and the float64 reference,
exactly as the wire does, and compares bit for bit:

* forward: rank r's output = concat over senders s of ``dequantize(quantize(x_s))`` restricted to the
  rows s sends to r (quantization is per row, so quantizing all of x_s and slicing is the same);
* backward: rank s's input gradient = concat over destinations r of ``Q_bwd(g_r)`` restricted to the rows
  r received from s (``g_r`` = the upstream gradient on r, ``Q_bwd`` = BF16 cast or FP8 1x128
  quantize -> dequantize).
"""
from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fp4moe.ops.all_to_all import (
    A2AStats,
    BACKWARD_CODECS,
    FORWARD_CODECS,
    DispatchedMXFP4,
    a2a_payload_bytes,
    dispatch_quantize_mode,
    quantize_gather_rows,
    quantized_all_to_all,
)
from fp4moe_kernels import convert as kops
from fp4moe_kernels import reference as R

WORLD = 2
H = 256  # two FP8 1x128 groups, eight MXFP4 blocks per row
# rows each rank sends to (rank 0, rank 1); T on a rank = the sum of its row.
CASES = {
    "uneven": {0: [2, 3], 1: [3, 1]},
    "zero_to_peer": {0: [4, 0], 1: [1, 2]},  # rank 0 sends nothing to rank 1
    "empty_rank": {0: [3, 2], 1: [0, 0]},  # rank 1 has T = 0
}
COMBOS = [(f, b) for f in FORWARD_CODECS for b in BACKWARD_CODECS]


def _in_splits(case: str, rank: int) -> list[int]:
    return list(CASES[case][rank])


def _out_splits(case: str, rank: int) -> list[int]:
    return [CASES[case][src][rank] for src in range(WORLD)]


def _rows(seed: int, t: int) -> torch.Tensor:
    """bf16 [t, H]: normal values, each row scaled by its own power of two (so the scales differ)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=gen, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-6, 7, (t, 1), generator=gen).to(torch.float64))
    x[:, 5] = 0.0  # exact zeros survive every codec
    return x.to(torch.bfloat16)


def make_x(case: str, rank: int) -> torch.Tensor:
    return _rows(1000 * list(CASES).index(case) + rank, sum(_in_splits(case, rank)))


def make_grad(case: str, rank: int) -> torch.Tensor:
    return _rows(5000 + 1000 * list(CASES).index(case) + rank, sum(_out_splits(case, rank)))


def wire(x: torch.Tensor, codec: str) -> torch.Tensor:
    """What the receiver gets for rows x (bf16) in ``codec``, computed with the kernels' API and reference."""
    if codec == "mxfp4":
        return kops.fp4_to_bf16(kops.bf16_to_fp4_row(x))
    if codec == "fp8":
        return R.dequantize_fp8_row(kops.bf16_to_fp8_row(x)).to(torch.bfloat16)
    return x.to(torch.bfloat16)


def expected_forward(case: str, codec: str, rank: int) -> torch.Tensor:
    parts = []
    for src in range(WORLD):
        q = wire(make_x(case, src), codec)
        off = sum(_in_splits(case, src)[:rank])
        parts.append(q[off : off + _in_splits(case, src)[rank]])
    return torch.cat(parts)


def expected_grad(case: str, codec: str, rank: int) -> torch.Tensor:
    parts = []
    for dst in range(WORLD):
        q = wire(make_grad(case, dst), codec)
        off = sum(_out_splits(case, dst)[:rank])  # rows dst received from `rank` sit after lower senders'
        parts.append(q[off : off + _out_splits(case, dst)[rank]])
    return torch.cat(parts)


# ------------------------------------------------------------------------------------------- the ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str, backend: str) -> None:
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )
    res: dict = {}
    try:
        for case in CASES:
            ins, outs = _in_splits(case, rank), _out_splits(case, rank)
            g = make_grad(case, rank).to(device)
            for fc, bc in COMBOS:
                x = make_x(case, rank).to(device).requires_grad_(True)
                stats = A2AStats()
                y = quantized_all_to_all(x, ins, outs, None, fc, bc, stats=stats, check_splits=True)
                y.backward(g)
                res[(case, fc, bc)] = dict(y=y.detach().cpu(), grad=x.grad.cpu(), stats=stats.as_dict())
            for bc in BACKWARD_CODECS:
                x = make_x(case, rank).to(device).requires_grad_(True)
                stats = A2AStats()
                d = quantized_all_to_all(x, ins, outs, None, "mxfp4", bc, keep_fp4=True, stats=stats)
                z = d.dequantize_ste()
                z.backward(g)
                res[(case, "keep_fp4", bc)] = dict(
                    type=type(d).__name__, data=d.data.cpu(), scales=d.scales.cpu(), shape=d.shape,
                    z=z.detach().cpu(), grad=x.grad.cpu(), stats=stats.as_dict(),
                    anchor_bytes=d.grad_anchor.untyped_storage().nbytes(),
                )
            # MXFP4 rows quantized per token before the gather (quantize_gather_rows) against the gathered BF16 rows
            # quantized inside the all-to-all: tokens u [ceil(t/2), H], rows u[i // 2] (each token sent twice)
            t = sum(ins)
            for keep in (False, True):
                for bc in BACKWARD_CODECS:
                    both = {}
                    for mode in ("rows", "tokens"):
                        u = make_x(case, rank)[: (t + 1) // 2].clone().to(device).requires_grad_(True)
                        index = (torch.arange(t) // 2).to(device)
                        x = quantize_gather_rows(u, index) if mode == "tokens" else u[index]
                        stats = A2AStats()
                        d = quantized_all_to_all(x, ins, outs, None, "mxfp4", bc, keep_fp4=keep, stats=stats)
                        z = d.dequantize_ste() if keep else d
                        z.backward(g)
                        both[mode] = dict(z=z.detach().cpu(), grad=u.grad.cpu(), stats=stats.as_dict(),
                                          data=d.data.cpu() if keep else None, scales=d.scales.cpu() if keep else None)
                    res[(case, "prequantized", keep, bc)] = both
        # errors: both ranks make the same mistake, so neither waits in a collective
        x = make_x("uneven", rank).to(device)
        try:
            quantized_all_to_all(x, [1, 1], _out_splits("uneven", rank), None, "mxfp4", "bf16")
        except ValueError as e:
            res["err_sum"] = str(e)
        bad_outs = _out_splits("uneven", rank)
        if rank == 0:
            bad_outs = [bad_outs[0], bad_outs[1] + 1]  # one rank believes it receives one more row
        try:
            quantized_all_to_all(x, _in_splits("uneven", rank), bad_outs, None, "mxfp4", "bf16", check_splits=True)
        except ValueError as e:
            res["err_check"] = str(e)
    finally:
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()


def _run_ranks(out_dir: str, backend: str) -> list[dict]:
    mp.spawn(_worker, args=(_free_port(), out_dir, backend), nprocs=WORLD, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return _run_ranks(str(tmp_path_factory.mktemp("a2a_gloo")), "gloo")


def _check_against_single_process(results: list[dict]) -> None:
    for rank in range(WORLD):
        for case in CASES:
            t = sum(_in_splits(case, rank))
            t_out = sum(_out_splits(case, rank))
            for fc, bc in COMBOS:
                r = results[rank][(case, fc, bc)]
                where = f"rank {rank} case {case} fwd {fc} bwd {bc}"
                assert r["y"].dtype == torch.bfloat16 and r["y"].shape == (t_out, H), where
                assert torch.equal(r["y"], expected_forward(case, fc, rank)), f"forward differs: {where}"
                assert torch.equal(r["grad"], expected_grad(case, bc, rank)), f"input gradient differs: {where}"
                st = r["stats"]
                assert st["forward_sent_bytes"] == a2a_payload_bytes(t, H, fc), where
                assert st["forward_received_bytes"] == a2a_payload_bytes(t_out, H, fc), where
                assert st["backward_sent_bytes"] == a2a_payload_bytes(t_out, H, bc), where
                assert st["backward_received_bytes"] == a2a_payload_bytes(t, H, bc), where
            for bc in BACKWARD_CODECS:
                r = results[rank][(case, "keep_fp4", bc)]
                where = f"rank {rank} case {case} keep_fp4 bwd {bc}"
                assert r["type"] == "DispatchedMXFP4" and r["shape"] == (t_out, H), where
                parts = []
                for src in range(WORLD):
                    q = kops.bf16_to_fp4_row(make_x(case, src))
                    off = sum(_in_splits(case, src)[:rank])
                    parts.append((q.data[off : off + _in_splits(case, src)[rank]],
                                  q.scales[off : off + _in_splits(case, src)[rank]]))
                assert torch.equal(r["data"], torch.cat([p[0] for p in parts])), where
                assert torch.equal(r["scales"], torch.cat([p[1] for p in parts])), where
                assert torch.equal(r["z"], expected_forward(case, "mxfp4", rank)), where
                # straight-through: the same gradient as the decoding path
                assert torch.equal(r["grad"], expected_grad(case, bc, rank)), where
                assert r["anchor_bytes"] == 2, where  # the anchor is a stride-0 view, not a [T_out, H] buffer


def test_ep2_gloo_matches_single_process(gloo_results):
    _check_against_single_process(gloo_results)


def test_ep2_gloo_prequantized_rows_equal_quantizing_the_rows(gloo_results):
    _check_prequantized(gloo_results)


def _check_prequantized(results: list[dict]) -> None:
    """Tokens quantized once and their MXFP4 rows gathered (quantize_gather_rows) go through the all-to-all exactly as
    the gathered BF16 rows quantized inside it: the same received rows (decoded or kept), the same token gradients
    and the same bytes, on both ranks, for every case and backward codec."""
    for rank in range(WORLD):
        for case in CASES:
            for keep in (False, True):
                for bc in BACKWARD_CODECS:
                    both = results[rank][(case, "prequantized", keep, bc)]
                    a, b = both["rows"], both["tokens"]
                    where = f"rank {rank} case {case} keep_fp4 {keep} bwd {bc}"
                    assert torch.equal(a["z"], b["z"]) and torch.equal(a["grad"], b["grad"]), where
                    assert a["stats"] == b["stats"] and a["stats"]["forward_calls"] == 1, where
                    if keep:
                        assert torch.equal(a["data"], b["data"]) and torch.equal(a["scales"], b["scales"]), where
                    t = sum(_in_splits(case, rank))
                    if t:
                        assert b["grad"].abs().sum() > 0, where  # the gradient did reach the tokens


def test_ep2_bytes_sent_by_hand(gloo_results):
    """case 'uneven', H = 256: rank 0 has 5 rows (2 stay, 3 go to rank 1), rank 1 has 4 rows (3 to rank 0,
    1 stays). MXFP4 row = 128 + 8 = 136 bytes; FP8 row = 256 + 4*2 = 264; BF16 row = 512."""
    st0 = gloo_results[0][("uneven", "mxfp4", "bf16")]["stats"]
    st1 = gloo_results[1][("uneven", "mxfp4", "bf16")]["stats"]
    assert st0 == dict(
        forward_calls=1, forward_sent_bytes=5 * 136, forward_sent_remote_bytes=3 * 136, forward_received_bytes=5 * 136,
        backward_calls=1, backward_sent_bytes=5 * 512, backward_sent_remote_bytes=3 * 512,
        backward_received_bytes=5 * 512,
    )
    assert st1 == dict(
        forward_calls=1, forward_sent_bytes=4 * 136, forward_sent_remote_bytes=3 * 136, forward_received_bytes=4 * 136,
        backward_calls=1, backward_sent_bytes=4 * 512, backward_sent_remote_bytes=3 * 512,
        backward_received_bytes=4 * 512,
    )
    fp8 = gloo_results[0][("uneven", "fp8", "fp8")]["stats"]
    assert fp8["forward_sent_bytes"] == 5 * 264 and fp8["backward_sent_bytes"] == 5 * 264
    bf16 = gloo_results[0][("uneven", "bf16", "bf16")]["stats"]
    # measured payload ratio MXFP4 / BF16 = (H/2 + H/32) / (2H)
    assert st0["forward_sent_bytes"] * (2 * H) == bf16["forward_sent_bytes"] * (H // 2 + H // 32)
    # a rank with no tokens sends nothing but still receives its share of the gradient exchange
    empty = gloo_results[1][("empty_rank", "mxfp4", "bf16")]["stats"]
    assert empty["forward_sent_bytes"] == 0 and empty["forward_received_bytes"] == 2 * 136
    assert empty["backward_sent_bytes"] == 2 * 512 and empty["backward_received_bytes"] == 0


def test_ep2_errors(gloo_results):
    for rank in range(WORLD):
        msg = gloo_results[rank]["err_sum"]
        assert "sum to 2 but x has" in msg and "summing to x.shape[0]" in msg, msg
        msg = gloo_results[rank]["err_check"]
        assert "output_splits do not match" in msg, msg


# --------------------------------------------------------------------------------- single process


def test_payload_bytes_by_hand():
    assert a2a_payload_bytes(1, 7168, "mxfp4") == 3808  # 3584 data + 224 scales
    assert a2a_payload_bytes(1, 7168, "bf16") == 14336
    assert a2a_payload_bytes(1, 7168, "fp8") == 7168 + 4 * 56  # 7392
    assert a2a_payload_bytes(3, 256, "mxfp4") == 3 * 136
    assert a2a_payload_bytes(0, 256, "fp8") == 0
    for h in (32, 256, 2048, 7168):
        rows = 37
        assert a2a_payload_bytes(rows, h, "mxfp4") * 2 * h == a2a_payload_bytes(rows, h, "bf16") * (h // 2 + h // 32)
    assert a2a_payload_bytes(4096, 7168, "mxfp4") / a2a_payload_bytes(4096, 7168, "bf16") == 3808 / 14336
    with pytest.raises(ValueError, match="multiple of 128"):
        a2a_payload_bytes(1, 96, "fp8")
    with pytest.raises(ValueError, match="not one of"):
        a2a_payload_bytes(1, 256, "fp4")


def test_world_size_one_is_local_quantization():
    """Without torch.distributed: the exchange is the identity, quantization and gradient codec included."""
    x = _rows(7, 6).requires_grad_(True)
    g = _rows(8, 6)
    for fc, bc in COMBOS:
        x.grad = None
        stats = A2AStats()
        y = quantized_all_to_all(x, [6], [6], None, fc, bc, stats=stats)
        y.backward(g)
        assert torch.equal(y, wire(x.detach(), fc)), (fc, bc)
        assert torch.equal(x.grad, wire(g, bc)), (fc, bc)
        assert stats.forward_sent_bytes == a2a_payload_bytes(6, H, fc) and stats.forward_sent_remote_bytes == 0
    y = quantized_all_to_all(x, [6], [6], forward_codec="bf16")
    assert y.data_ptr() == x.data_ptr() and torch.equal(y, x)  # BF16 rows at world size 1: a view, no copy
    assert y._version == x._version  # one version counter: a saved tensor changed in place through either is caught


def test_keep_fp4_is_an_mxfp4_tensor():
    x = _rows(9, 4)
    d = quantized_all_to_all(x, [4], [4], keep_fp4=True)
    assert isinstance(d, DispatchedMXFP4)
    q = kops.bf16_to_fp4_row(x)
    assert torch.equal(d.data, q.data) and torch.equal(d.scales, q.scales)
    f = kops.fp4_row_to_fp8_row(d)  # the kernels take it as an MXFP4Tensor
    assert f.shape == (4, H)


def test_errors_name_the_fix():
    x = _rows(1, 4)
    with pytest.raises(ValueError, match=r"sum to 3 but x has 4 rows.*summing to x.shape\[0\]"):
        quantized_all_to_all(x, [3], [3])
    with pytest.raises(ValueError, match="one row count per rank"):
        quantized_all_to_all(x, [2, 2], [2, 2])
    with pytest.raises(ValueError, match="is not an int"):
        quantized_all_to_all(x, [4.0], [4])
    with pytest.raises(ValueError, match="negative"):
        quantized_all_to_all(x, [-1], [4])
    with pytest.raises(ValueError, match="keep_fp4=True needs forward_codec='mxfp4'"):
        quantized_all_to_all(x, [4], [4], forward_codec="fp8", keep_fp4=True)
    with pytest.raises(ValueError, match="never sent in FP4"):
        quantized_all_to_all(x, [4], [4], backward_codec="mxfp4")
    with pytest.raises(ValueError, match="multiple of 128"):
        quantized_all_to_all(_rows(1, 4)[:, :96].contiguous(), [4], [4], forward_codec="mxfp4", backward_codec="fp8")
    with pytest.raises(ValueError, match="2-D"):
        quantized_all_to_all(x.view(2, 2, H), [2], [2])
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        quantized_all_to_all(x.to(torch.float16), [4], [4])


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA GPUs (NCCL)")
def test_ep2_nccl_matches_single_process(tmp_path):
    results = _run_ranks(str(tmp_path), "nccl")
    _check_against_single_process(results)
    _check_prequantized(results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k", [1, 8])
def test_gpu_quantize_gather_rows_is_the_quantized_gather(k):
    """On the GPU kernels: quantize_gather_rows of DeepSeek-V3-sized tokens (H 7168, top-8) holds the bits of
    bf16_to_fp4_row of the gathered rows, and the pre-quantized dispatch (world size 1) returns them with the same
    token gradient as quantizing the gathered BF16 rows inside the all-to-all."""
    g = torch.Generator(device="cuda").manual_seed(3)
    t, h = 1024, 7168
    x = (torch.randn(t, h, generator=g, device="cuda") * 4).to(torch.bfloat16)
    index = torch.arange(t, device="cuda").repeat_interleave(k)[torch.randperm(t * k, generator=g, device="cuda")]
    order = torch.argsort(index, stable=True)
    up = torch.randn(t * k, h, generator=g, device="cuda").to(torch.bfloat16)
    xa = x.clone().requires_grad_(True)
    d = quantize_gather_rows(xa, index, order=order, k=k)
    ref = kops.bf16_to_fp4_row(x[index])
    assert d.data.is_cuda and torch.equal(d.data, ref.data) and torch.equal(d.scales, ref.scales)
    got = quantized_all_to_all(d, [t * k], [t * k], None, "mxfp4", "bf16", keep_fp4=True)
    got.dequantize_ste().backward(up)
    xb = x.clone().requires_grad_(True)
    rows = quantized_all_to_all(xb[index], [t * k], [t * k], None, "mxfp4", "bf16", keep_fp4=True)
    assert torch.equal(rows.data, got.data) and torch.equal(rows.scales, got.scales)
    rows.dequantize_ste().backward(up)
    want = up.index_select(0, order).view(t, k, h).sum(1, dtype=torch.float32).to(torch.bfloat16)
    assert torch.equal(xa.grad, want)
    # the old order's gradient is autograd's index_put_ with accumulate: k bf16 atomic adds, each rounding the partial
    # sum (at most 2^-9 of the sum of magnitudes so far), in any order; bounded by k * 2^-9 * sum_j |up_j| per element
    exact = up.double().index_select(0, order).view(t, k, h).sum(1)
    bound = k * 2.0 ** -9 * up.double().abs().index_select(0, order).view(t, k, h).sum(1)
    assert bool(((xb.grad.double() - exact).abs() <= bound).all())


def test_permute_rows_of_dispatched_mxfp4_routes_the_gradient_back():
    """permute_rows on a DispatchedMXFP4: data and scales are gathered rows, and the gradient that reaches the new
    anchor (dL/d dequantized permuted rows) arrives at the old anchor in the old row order, bit for bit."""
    from fp4moe.ops.all_to_all import permute_rows

    g = torch.Generator().manual_seed(7)
    x = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    q = kops.bf16_to_fp4_row(x)
    anchor = torch.zeros((), dtype=torch.bfloat16).expand(37, 64).requires_grad_(True)
    d = DispatchedMXFP4(q.data, q.scales, (37, 64), anchor)
    perm = torch.randperm(37, generator=g)
    p = permute_rows(d, perm)
    assert torch.equal(p.data, q.data[perm]) and torch.equal(p.scales, q.scales[perm]) and p.shape == (37, 64)
    y = p.dequantize_ste()
    assert torch.equal(y, kops.fp4_to_bf16(q)[perm])
    w = torch.randn(37, 64, generator=g).to(torch.bfloat16)
    (y.float() * w.float()).sum().backward()
    expect = torch.empty_like(w)
    expect[perm] = w                      # row i of the permuted tensor came from row perm[i]
    assert torch.equal(anchor.grad, expect)


@pytest.mark.parametrize("rule", ["ceil", "floor"])
def test_quantize_gather_rows_is_the_quantized_gather(rule):
    """quantize_gather_rows(x, index) holds bit for bit bf16_to_fp4_row(x[index]) (MXFP4 is per row), and its
    gradient reaches x as autograd's gradient of x[index] does (accumulated per row), with values that need
    both scale rules' edge cases (zeros, a tiny row, a huge row)."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 64, generator=g) * 3).to(torch.bfloat16)
    x[2] = 0
    x[3] *= 1e-30
    x[4] *= 1e30
    index = torch.tensor([5, 0, 0, 3, 2, 4, 1, 0, 5])
    d = quantize_gather_rows(x, index, rule)
    ref = kops.bf16_to_fp4_row(x[index], rule)
    assert isinstance(d, DispatchedMXFP4) and d.shape == (9, 64) and d.grad_anchor is None  # x needs no grad
    assert torch.equal(d.data, ref.data) and torch.equal(d.scales, ref.scales)
    up = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    xa = x.clone().requires_grad_(True)
    quantize_gather_rows(xa, index, rule).dequantize_ste().backward(up)
    xb = x.clone().requires_grad_(True)
    xb[index].backward(up)
    assert torch.equal(xa.grad, xb.grad)


def test_quantize_gather_rows_with_order_sums_each_token_in_float32():
    """With order/k (every token gathered exactly k times) the k row gradients of a token are summed in float32 and
    rounded once, without atomics: against a float64 sum rounded to BF16 (exact for these k = 4 small sums)."""
    g = torch.Generator().manual_seed(8)
    t, k, h = 5, 4, 64
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).requires_grad_(True)
    index = torch.arange(t).repeat_interleave(k)[torch.randperm(t * k, generator=g)]
    order = torch.argsort(index, stable=True)
    d = quantize_gather_rows(x, index, order=order, k=k)
    assert torch.equal(d.data, kops.bf16_to_fp4_row(x.detach()[index]).data)
    up = torch.randn(t * k, h, generator=g).to(torch.bfloat16)
    d.dequantize_ste().backward(up)
    want = torch.zeros(t, h, dtype=torch.float64).index_add_(0, index, up.double()).to(torch.bfloat16)
    assert torch.equal(x.grad, want)
    with pytest.raises(ValueError, match="order needs k"):
        quantize_gather_rows(x, index, order=order)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        quantize_gather_rows(x.detach().half(), index)
    with pytest.raises(ValueError, match="fp8"):
        quantized_all_to_all(d, [t * k], [t * k], None, "fp8", "bf16")


def test_dispatch_quantize_mode(monkeypatch):
    """FP4MOE_DISPATCH_QUANTIZE: unset / tokens (default), rows; anything else names the variable and its values."""
    monkeypatch.delenv("FP4MOE_DISPATCH_QUANTIZE", raising=False)
    assert dispatch_quantize_mode() == "tokens"
    for v, want in (("rows", "rows"), (" Tokens ", "tokens"), ("", "tokens")):
        monkeypatch.setenv("FP4MOE_DISPATCH_QUANTIZE", v)
        assert dispatch_quantize_mode() == want
    monkeypatch.setenv("FP4MOE_DISPATCH_QUANTIZE", "token")
    with pytest.raises(ValueError, match="FP4MOE_DISPATCH_QUANTIZE='token': use tokens"):
        dispatch_quantize_mode()


def _gather_sum_on_cpu(monkeypatch):
    """Route sum_rows_by_token through the Triton kernel on CPU tensors (run by the interpreter), as on CUDA."""
    import fp4moe.ops.all_to_all as a2a
    from fp4moe_kernels import switches

    monkeypatch.setattr(a2a, "gather_sum_fused",
                        lambda g: g.dtype == torch.bfloat16 and switches.current().gather_sum == "triton")
    import fp4moe.moe.dispatch as dispatch
    monkeypatch.setattr(dispatch, "gather_sum_fused", a2a.gather_sum_fused)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), reason="runs the kernel under TRITON_INTERPRET=1")
def test_gather_sum_kernel_equals_the_gather_and_sum(monkeypatch):
    """gather_sum=triton: sum_rows_by_token's k rows per token summed in row order by one kernel, the bits of the
    gather + float32 sum + cast (torch's CPU order is the row order), NaN and Inf included, through a padded layout
    (order indexing more rows than T*k) and through the MoE layer's inverse permutation and its gradient, chunked or
    not; against float64 within a BF16 rounding."""
    from fp4moe.moe.dispatch import permutation_from_topk, unpermute_tokens
    from fp4moe.ops.all_to_all import sum_rows_by_token
    from fp4moe_kernels import switches
    from fp4moe_kernels.triton_kernels.permute import gather_sum_rows

    _gather_sum_on_cpu(monkeypatch)
    g = torch.Generator().manual_seed(4)
    t, k, h = 45, 6, 160
    rows = (torch.randn(t * k + 10, h, generator=g) * torch.logspace(-30, 30, h)).to(torch.bfloat16)
    rows[2, 3], rows[5, 7], rows[9, 7] = float("nan"), float("inf"), -float("inf")
    order = torch.randperm(t * k + 10, generator=g)[: t * k]   # 10 rows never read (a padded layout's padding)
    want = rows.index_select(0, order).view(t, k, h).sum(1, dtype=torch.float32).to(torch.bfloat16)
    got = {}
    for value in ("torch", "triton"):
        with switches.use(switches.Switches(gather_sum=value)):
            got[value] = sum_rows_by_token(rows, order, t, k)
    nan = torch.isnan(want.float())
    for v in got.values():
        assert torch.equal(torch.isnan(v.float()), nan) and torch.equal(v.view(torch.int16)[~nan], want.view(torch.int16)[~nan])
    exact = rows.double().index_select(0, order).view(t, k, h).sum(1)
    fin = torch.isfinite(exact)
    assert torch.equal(got["triton"][fin], exact[fin].to(torch.bfloat16)) or (
        (got["triton"][fin].double() - exact[fin]).abs() <= exact[fin].abs() * 2.0 ** -8 + 1e-300).all()
    # the layer's inverse permutation (chunked: the kernel takes every token at once) and its gradient
    idx = torch.stack([torch.randperm(8, generator=g)[:k] for _ in range(t)])
    perm, _ = permutation_from_topk(idx, torch.rand(t, k, generator=g))
    y = torch.randn(t * k, h, generator=g).to(torch.bfloat16)
    dy = torch.randn(t, h, generator=g).to(torch.bfloat16)
    outs = []
    for value, chunk in (("torch", None), ("triton", None), ("triton", 7)):
        yy = y.clone().requires_grad_()
        with switches.use(switches.Switches(gather_sum=value)):
            out = unpermute_tokens(yy, perm, chunk_tokens=chunk)
            out.backward(dy)
        outs.append((out.detach(), yy.grad))
    for out, grad in outs[1:]:
        assert torch.equal(out.view(torch.int16), outs[0][0].view(torch.int16)) and torch.equal(grad, outs[0][1])
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        gather_sum_rows(rows.float(), order, t, k)
    with pytest.raises(ValueError, match="t \\* k = 270"):
        gather_sum_rows(rows, order[:-1], t, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gather_sum_kernel_on_the_gpu():
    """On CUDA, at the proxy's shape (131072 tokens x 8 rows x 2048): the kernel's sums bit for bit equal to float32
    additions in row order rounded once to BF16 (element-wise CUDA adds are correctly rounded, so this reference is
    exact); torch's gather + sum, whose CUDA reduction may add the k terms in another order, differs in few
    elements. (A bound relative to the sum fails where the terms cancel: two orders of float32 additions then
    differ by several BF16 units of the small result, as the H100 showed on 2026-12-06.)"""
    from fp4moe.ops.all_to_all import sum_rows_by_token
    from fp4moe_kernels import switches

    g = torch.Generator(device="cuda").manual_seed(5)
    t, k, h = 131072, 8, 2048
    rows = torch.randn(t * k, h, device="cuda", generator=g).to(torch.bfloat16)
    order = torch.randperm(t * k, device="cuda", generator=g)
    with switches.use(switches.Switches(gather_sum="triton")):
        got = sum_rows_by_token(rows, order, t, k)
    by_token = order.view(t, k)
    acc = rows.index_select(0, by_token[:, 0]).float()
    for j in range(1, k):
        acc += rows.index_select(0, by_token[:, j]).float()
    assert torch.equal(got.view(torch.int16), acc.to(torch.bfloat16).view(torch.int16))
    del acc
    with switches.use(switches.Switches(gather_sum="torch")):
        want = sum_rows_by_token(rows, order, t, k)
    assert float((got != want).float().mean()) < 1e-3
