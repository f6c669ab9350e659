"""fp4moe.moe.dispatch, the MoE data path's row operations: permutation 2 (source-rank-major chunks ->
local-expert-major) and its inverse as gather indices built with device ops, against the chunk-by-chunk definition
and megatron's own sort_chunks_by_idxs; permutation 1 from top-k ids equal to megatron's from a routing map; the
un-permutation's token sums made a few tokens at a time equal to all at once, bit for bit."""
from __future__ import annotations

import pytest
import torch

from fp4moe.moe.dispatch import (chunk_orders, local_expert_permutation, permutation_from_routing_map,
                                 permutation_from_topk, permute_tokens, reorder_rows, unpermute_tokens)
from fp4moe.recipe import Recipe


def _chunkwise(sizes: list[int], order: list[int]) -> torch.Tensor:
    """The definition: chunk c holds rows starts[c] .. starts[c] + sizes[c]; emit the chunks in ``order``."""
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    parts = [torch.arange(starts[c], starts[c] + sizes[c]) for c in order]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@pytest.mark.parametrize("ep,local", [(1, 4), (2, 4), (4, 2), (8, 32)])
def test_local_expert_permutation_matches_the_definition_and_megatron(ep, local):
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    g = torch.Generator().manual_seed(ep * 100 + local)
    recv = torch.randint(0, 40, (ep, local), generator=g)
    recv.view(-1)[::3] = 0                                                   # experts that got no token
    to_expert, to_source = chunk_orders(ep, local)
    ids = torch.arange(ep * local)                                           # megatron's two chunk orders
    assert torch.equal(to_expert, ids.reshape(-1, local).T.ravel())
    assert torch.equal(to_source, ids.reshape(local, -1).T.ravel())
    sizes, rows = recv.reshape(-1), int(recv.sum())
    perm = local_expert_permutation(sizes, to_expert, rows, torch.device("cpu"))
    assert perm.dtype == torch.int64 and torch.equal(perm, _chunkwise(sizes.tolist(), to_expert.tolist()))
    x = torch.randn(rows, 3, generator=g)
    want, _ = sort_chunks_by_idxs(x, sizes, to_expert)
    assert torch.equal(x[perm], want)
    back = local_expert_permutation(recv.T.reshape(-1), to_source, rows, "cpu")
    assert torch.equal(x[perm][back], x)                                     # the inverse, as megatron's restore
    assert torch.equal(sort_chunks_by_idxs(want, recv.T.ravel(), to_source)[0], x)


def test_local_expert_permutation_empty():
    perm = local_expert_permutation(torch.zeros(4, dtype=torch.int64), torch.tensor([0, 2, 1, 3]), 0, "cpu")
    assert perm.shape == (0,)


def test_reorder_rows_gradient_is_gathered_back():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(11, 5, generator=g, requires_grad=True)
    perm = torch.randperm(11, generator=g)
    dy = torch.randn(11, 5, generator=g)
    reorder_rows(x, perm).backward(dy)
    assert torch.equal(x.grad[perm], dy)


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_permutation_from_topk_is_megatrons_from_the_routing_map(k):
    g = torch.Generator().manual_seed(k)
    t, e = 37, 16
    idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    probs = torch.rand(t, k, generator=g)
    perm, row_probs = permutation_from_topk(idx, probs)
    routing = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx, True)
    dense = torch.zeros(t, e).scatter_(1, idx, probs)
    perm_m, token_m, probs_m = permutation_from_routing_map(routing, dense, k)
    assert torch.equal(perm.token, token_m) and torch.equal(perm.order, perm_m.order)
    assert torch.equal(row_probs, probs_m)
    assert (perm.tokens, perm.k) == (perm_m.tokens, perm_m.k) == (t, k)
    # rows grouped by token through ``order``: each token's k rows, experts ascending within
    assert torch.equal(perm.token[perm.order], torch.arange(t).repeat_interleave(k))
    cut = routing.clone()
    cut[0, idx[0, 0]] = False                                                # token 0 with k - 1 rows: no permutation
    assert permutation_from_routing_map(cut, dense, k)[0] is None


def _token_sums_in_chunks(k, chunk, device, t=37, h=64):
    g = torch.Generator().manual_seed(k * 10 + chunk)
    idx = torch.rand(t, 16, generator=g).topk(k, dim=1).indices.to(device)
    perm, _ = permutation_from_topk(idx, torch.rand(t, k, generator=g).to(device))
    for dtype in (torch.bfloat16, torch.float32):
        rows = (torch.randn(t * k, h, generator=g) * 10).to(device, dtype)
        tokens = torch.randn(t, h, generator=g).to(device, dtype)
        outs, grads = [], []
        for c in (None, chunk):
            r = rows.clone().requires_grad_(True)
            y = unpermute_tokens(r, perm, chunk_tokens=c)
            y.backward(tokens)
            x = tokens.clone().requires_grad_(True)
            permute_tokens(x, perm, Recipe.preset("bf16"), chunk_tokens=c).backward(rows)
            outs.append((y, r.grad))
            grads.append(x.grad)
        assert outs[0][0].dtype == dtype
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("k,chunk", [(2, 19), (3, 13), (8, 5), (8, 1)])
def test_token_sums_in_chunks_are_bit_identical(k, chunk):
    """unpermute_tokens (forward) and permute_tokens (backward) with ``chunk_tokens``: the same bits as all T tokens
    at once (each token's k rows reduced by the same float32 sum), in BF16 and float32."""
    _token_sums_in_chunks(k, chunk, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k,chunk,t", [(2, 1024, 8192), (8, 1024, 8192), (8, 3, 37), (3, 13, 37)])
def test_gpu_token_sums_in_chunks_are_bit_identical(k, chunk, t):
    """The same on CUDA, whose reduction kernels pick their launch shape from the sizes (each token's k sums stay
    within one thread for these k), at the benchmark's chunk of T/k tokens and at odd sizes."""
    _token_sums_in_chunks(k, chunk, "cuda", t=t, h=7168 if t > 1000 else 64)
