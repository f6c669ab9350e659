"""Rows padded for the expert GEMMs by megatron's MoE layer as fp4moe.model builds it (``RecipeMoELayer``, the
recipe dispatcher, ``RecipeGroupedMLP``; tiny_cpu's MoE layer, 8 local experts): with a forced alignment
(``token_dispatcher.row_align``, ``experts.row_align``; DeepGEMM's 128 on the GPU), permutation 1 writes the padded
rows (EP = 1, permutation 2 skipped) or permutation 2 does (run instead of skipped), ``dispatch_postprocess`` returns
the padded counts, and the outputs and gradients equal bit for bit the standalone layer with the experts padding
on their own (``pad_in_dispatch = False``), which tests/moe/test_layer_row_padding.py shows equal to its own
dispatch padding; so do the experts' inputs (counts, MXFP4 data and scales, probabilities), and the experts pad
nothing themselves. bf16 (the adapter's modules under the bf16 recipe, as test_one_moe_path), fp8, fp8 with an FP8
gradient all-to-all, mxfp4 without dispatch_fp4, and the mxfp4 preset (permutation 1 gathers its MXFP4 rows padded,
zero codes and zero scales on the padding; permutation 2 reorders the received ones padded), with the experts'
recompute too (its 'fp4' cache: the padded MXFP4 rows).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.model.ep2_gloo import run_on_two_ranks  # noqa: E402
from tests.model.test_one_moe_path import _pair, _run_megatron, _run_standalone  # noqa: E402
from tests.moe.test_layer_row_padding import _ExpertInputs, _same_expert_inputs  # noqa: E402

ALIGN = 128
VARIANTS = ("top2", "expert_recompute", "permutation_2", "fp8_bwd_a2a", "no_dispatch_fp4")


def _recipe(precision: str, variant: str):
    from fp4moe.recipe import Recipe

    if variant == "fp8_bwd_a2a":
        return Recipe.from_config({"name": precision, "backward_a2a": "fp8"})
    if variant == "no_dispatch_fp4":
        return Recipe.from_config({"name": "mxfp4", "dispatch_fp4": False})
    return None


def _inputs(k: int, e: int, seed: int):
    """x, dL/dy ``[16, 2, 256]`` bf16 and a ragged routing of the 32 tokens with empty experts (3, 6) and an
    expert whose count is already a multiple of 8 (the 2nd test's alignment); dy spans powers of two as in
    tests/moe/test_layer_row_padding.py (a non-zero gradient on padding would change FP8 wgrad bits)."""
    g = torch.Generator().manual_seed(seed)
    x, gy = (torch.randn(16, 2, 256, generator=g) for _ in range(2))
    allowed = torch.tensor([0, 1, 2, 4, 5, 7])
    scores = torch.rand(32, allowed.numel(), generator=g)
    scores[:16, 0] += 2.0  # expert 0 takes the first 16 tokens: 16 rows
    scores[16:, 0] -= 2.0
    idx = allowed[scores.topk(k, dim=1).indices]
    scale = torch.exp2(-torch.randint(1, 16, (32,), generator=g).float())
    scale[(idx == 0).any(1)] = 16.0
    gy = gy * scale.view(16, 2, 1)
    return x.to(torch.bfloat16), gy.to(torch.bfloat16), idx, torch.rand(32, k, generator=g) + 0.05


def _aligned_pair(precision: str, variant: str, align: int, ep: int = 1):
    from fp4moe.moe.dispatch import row_padding

    base = {"fp8_bwd_a2a": "top2", "no_dispatch_fp4": "top2"}.get(variant, variant)
    moe, ref, k = _pair(precision, base, ep)
    recipe = _recipe(precision, variant)
    if recipe is not None:
        for mod in (moe, moe.token_dispatcher, moe.experts, moe.shared_experts):
            mod.recipe = recipe
        ref.recipe = recipe
    moe.token_dispatcher.row_align = moe.experts.row_align = align  # the dispatch pads (pad_in_dispatch default)
    ref.row_align, ref.pad_in_dispatch = align, False                # the experts pad
    return moe, ref, k, row_padding


@pytest.mark.parametrize("align", [ALIGN, 8])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("precision", ("bf16", "fp8", "mxfp4"))
def test_adapter_dispatch_padding_equals_experts_padding(mp, monkeypatch, precision, variant, align):
    if variant == "fp8_bwd_a2a" and precision == "bf16":
        pytest.skip("backward_a2a fp8 needs FP8 compute")
    if variant == "no_dispatch_fp4" and precision != "mxfp4":
        pytest.skip("a variant of the mxfp4 recipe")
    if align == 8 and variant not in ("top2", "permutation_2") and not (precision, variant) == ("mxfp4",
                                                                                              "expert_recompute"):
        pytest.skip("the small alignment on the plain paths (and the mxfp4 preset's recompute)")
    moe, ref, k, row_padding = _aligned_pair(precision, variant, align)
    d = moe.token_dispatcher
    seen = {}
    post = d.dispatch_postprocess

    def dispatch_postprocess(tokens, probs):  # what the experts get
        rows, counts, p = post(tokens, probs)
        seen.update(rows=rows.shape[0], counts=[int(c) for c in counts], probs=p.shape[0])
        return rows, counts, p

    monkeypatch.setattr(d, "dispatch_postprocess", dispatch_postprocess)
    experts = _ExpertInputs(monkeypatch)  # what GroupedExpertMLP gets, and the experts' own padding
    x, gy, idx, probs = _inputs(k, moe.config.num_moe_experts, seed=5)
    a = _run_megatron(moe, x, gy, idx, probs)
    got_calls, got_pads = experts.take()
    b = _run_standalone(ref, x, gy, idx, probs)
    ref_calls, expert_pads = experts.take()
    assert [n for n in a if n != "a2a" and not torch.equal(a[n], b[n])] == []
    # the experts' inputs too: counts, the MXFP4 rows' data and scales (padding included), the probabilities
    assert _same_expert_inputs(got_calls, ref_calls)
    assert all((f is not None) == moe.token_dispatcher.recipe.expert_input_fp4 for _, f, _ in got_calls)
    counts = torch.bincount(idx.reshape(-1), minlength=8).tolist()
    assert counts[3] == counts[6] == 0 and counts[0] == 16
    rp = row_padding(counts, align, torch.device("cpu"))
    want = list(rp.padded.counts)
    assert seen == dict(rows=sum(want), counts=want, probs=sum(want))
    # the (local, EP = 1) all-to-alls carry the padded rows when permutation 1 pads them (BF16 or MXFP4 rows): their
    # bytes count them
    if variant == "permutation_2":
        assert a["a2a"] == b["a2a"]
    else:
        rows_bytes = {n: v * sum(want) // (32 * k) for n, v in b["a2a"].items() if n.endswith("_bytes")}
        assert {n: a["a2a"][n] for n in rows_bytes} == rows_bytes
    # the experts pad nothing themselves; the reference's experts always do (twice under the experts' recompute:
    # forward and the backward's recomputation)
    runs = 2 if variant == "expert_recompute" else 1
    assert (len(got_pads), len(expert_pads)) == (0, runs)
    # the routed rows counted as sent / received are the real ones
    assert d.fp4moe_rows == {"sent": 32 * k, "received": 32 * k}


EP2_CASES = (("bf16", "top2"), ("fp8", "top2"), ("fp8", "expert_recompute"), ("mxfp4", "no_dispatch_fp4"),
             ("mxfp4", "top2"), ("mxfp4", "expert_recompute"))


def _ep2_case(precision: str, variant: str, rank: int) -> list[str]:
    """EP = 2 (4 local experts): permutation 2 pads (BF16 or received MXFP4 rows); what differs from the standalone
    layer whose experts pad, plus 'counts' when the experts' counts were not aligned or they padded rows themselves,
    and 'inputs' when the experts' inputs (MXFP4 data and scales included) differ from the reference's."""
    moe, ref, k, _ = _aligned_pair(precision, variant, 8, ep=2)
    d = moe.token_dispatcher
    assert not d.skip_permutation_2
    seen = []
    post = d.dispatch_postprocess

    def dispatch_postprocess(tokens, probs):
        rows, counts, p = post(tokens, probs)
        seen.append([int(c) for c in counts])
        return rows, counts, p

    d.dispatch_postprocess = dispatch_postprocess
    with pytest.MonkeyPatch.context() as mpatch:
        experts = _ExpertInputs(mpatch)
        x, gy, idx, probs = _inputs(k, moe.config.num_moe_experts, seed=5 + rank)
        a = _run_megatron(moe, x, gy, idx, probs)
        got_calls, got_pads = experts.take()
        b = _run_standalone(ref, x, gy, idx, probs)
        ref_calls, ref_pads = experts.take()
    bad = [n for n in a if not (torch.equal(a[n], b[n]) if isinstance(a[n], torch.Tensor) else a[n] == b[n])]
    if got_pads or not ref_pads or any(c % 8 for c in seen[0]):
        bad.append("counts")
    if not _same_expert_inputs(got_calls, ref_calls):
        bad.append("inputs")
    return bad


def _ep2_cases(rank: int) -> dict[str, list[str]]:
    return {f"{precision}/{variant}": _ep2_case(precision, variant, rank) for precision, variant in EP2_CASES}


def test_adapter_permutation_2_pads_at_ep2(tmp_path):
    """EP = 2 on gloo: permutation 2 writes the padded rows (the a2a bytes are the real rows': both layers agree)."""
    for rank, res in enumerate(run_on_two_ranks(_ep2_cases, tmp_path)):
        assert res == {f"{p}/{v}": [] for p, v in EP2_CASES}, (rank, res)
