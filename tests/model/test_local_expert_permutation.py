"""fp4moe.model.recipe_moe.local_expert_permutation: megatron's permutation 2 (source-rank-major chunks ->
local-expert-major) as one gather index built with device ops, against the chunk-by-chunk definition and against
megatron's own sort_chunks_by_idxs."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")


def _chunkwise(sizes: list[int], order: list[int]) -> torch.Tensor:
    """The definition: chunk c holds rows starts[c] .. starts[c] + sizes[c]; emit the chunks in ``order``."""
    starts = [sum(sizes[:c]) for c in range(len(sizes))]
    parts = [torch.arange(starts[c], starts[c] + sizes[c]) for c in order]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@pytest.mark.parametrize("ep,local", [(1, 4), (2, 4), (4, 2), (8, 32)])
def test_matches_the_chunkwise_definition_and_megatron(ep, local):
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    from fp4moe.model.recipe_moe import local_expert_permutation

    g = torch.Generator().manual_seed(ep * 100 + local)
    sizes = torch.randint(0, 40, (ep * local,), generator=g)
    sizes[::3] = 0                                                           # experts that got no token
    order = torch.arange(ep * local).reshape(-1, local).T.ravel()            # megatron's sort_input_by_local_experts
    rows = int(sizes.sum())
    perm = local_expert_permutation(sizes, order, rows, torch.device("cpu"))
    assert perm.dtype == torch.int64 and torch.equal(perm, _chunkwise(sizes.tolist(), order.tolist()))
    x = torch.randn(rows, 3, generator=g)
    want, _ = sort_chunks_by_idxs(x, sizes, order)
    assert torch.equal(x[perm], want)


def test_empty():
    from fp4moe.model.recipe_moe import local_expert_permutation

    perm = local_expert_permutation(torch.zeros(4, dtype=torch.int64), torch.tensor([0, 2, 1, 3]), 0, "cpu")
    assert perm.shape == (0,)
