"""fp4moe.ops.weight_cache: with the cache on, FP8 linears and grouped experts give bit for bit the outputs and
gradients of the uncached path over micro-batches and optimizer steps, while each weight is quantized once per
step; an optimizer step, an in-place change or a tensor outside the registered parameters is never served stale."""
from __future__ import annotations

import pytest
import torch

from fp4moe.moe.experts import routed_experts
from fp4moe.ops.fp8_linear import fp8_linear
from fp4moe.ops.grouped_experts import grouped_expert_mlp
from fp4moe.ops.weight_cache import CACHE, enabled_for
from fp4moe.recipe import Recipe

H, F = 256, 128
COUNTS = [40, 0, 90, 7]


@pytest.fixture(autouse=True)
def _off():
    CACHE.disable()
    yield
    CACHE.disable()


def _dense(seed=0, dev="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter((torch.randn(F, H, generator=g) * H**-0.5).to(torch.bfloat16).to(dev))
    xs = [torch.randn(64, H, generator=g).to(torch.bfloat16).to(dev) for _ in range(3)]
    return w, xs


def _train_dense(recipe, cache: bool, steps=2, dev="cpu"):
    """``steps`` optimizer steps of 3 micro-batches each (gradient accumulation); every output and gradient."""
    w, xs = _dense(dev=dev)
    opt = torch.optim.SGD([w], lr=0.5)
    out = []
    with enabled_for([w] if cache else None):
        for _ in range(steps):
            for x in xs:
                x = x.clone().requires_grad_()
                y = fp8_linear(x, w, recipe)
                y.float().square().sum().backward()
                out += [y.detach(), x.grad]
            out.append(w.grad.clone())
            opt.step()
            opt.zero_grad()
        stats = (CACHE.stats.misses, CACHE.stats.hits)
    return out, stats


@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_dense_linear_is_bit_exact_and_quantizes_once_per_step(name):
    recipe = Recipe.preset(name)
    ref, _ = _train_dense(recipe, cache=False)
    got, (misses, hits) = _train_dense(recipe, cache=True)
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    # per step: one pass (both copies) at the first forward; the other 2 forwards and 3 dgrads reuse it
    assert (misses, hits) == (2, 2 * 5)


def test_a_step_without_the_hook_is_served_stale_and_new_step_fixes_it():
    """Guards the guard: an update through ``.data`` is invisible to the version counter, so only ``new_step`` (or
    a torch optimizer's step hook) makes the next forward see the new weight."""
    recipe = Recipe.fp8()
    w, xs = _dense()
    with enabled_for([w]):
        y0 = fp8_linear(xs[0], w, recipe)
        w.data.mul_(3)
        stale = fp8_linear(xs[0], w, recipe)
        assert torch.equal(stale, y0)
        CACHE.new_step()
        fresh = fp8_linear(xs[0], w, recipe)
    assert torch.equal(fresh, fp8_linear(xs[0], w, recipe)) and not torch.equal(fresh, y0)


def test_in_place_change_and_unregistered_tensors_are_quantized_again():
    recipe = Recipe.fp8()
    w, xs = _dense()
    w.requires_grad_(False)  # forward copies only
    with enabled_for([w]):
        fp8_linear(xs[0], w, recipe)
        w.mul_(2)  # through autograd's view: the version counter moves
        y = fp8_linear(xs[0], w, recipe)
        assert CACHE.stats.misses == 2
        other = w.detach().clone()  # same values, another storage: never cached
        fp8_linear(xs[0], other, recipe)
        assert CACHE.stats.misses == 2 and CACHE.bytes() == F * H + 4 * (F // 128) * (H // 128)
    CACHE.disable()
    assert torch.equal(y, fp8_linear(xs[0], w, recipe))


def _experts(seed=1, dev="cpu"):
    g = torch.Generator().manual_seed(seed)
    e, t = len(COUNTS), sum(COUNTS)
    w1 = [torch.nn.Parameter((torch.randn(2 * F, H, generator=g) * H**-0.5).to(torch.bfloat16).to(dev))
          for _ in range(e)]
    w2 = [torch.nn.Parameter((torch.randn(H, F, generator=g) * F**-0.5).to(torch.bfloat16).to(dev)) for _ in range(e)]
    xs = [torch.randn(t, H, generator=g).to(torch.bfloat16).to(dev) for _ in range(2)]
    p = (torch.rand(t, generator=g) * 0.9 + 0.1).to(dev)
    return w1, w2, xs, p


def _train_experts(recipe, cache: bool, recompute: bool, dev="cpu", stacked=False):
    """``stacked``: the experts as one [E, N, K] parameter per weight set (the standalone MoELayer), the same values;
    the gradients are compared per expert either way."""
    w1, w2, xs, p = _experts(dev=dev)
    if stacked:
        w1, w2 = ([torch.nn.Parameter(torch.stack([w.detach() for w in ws]))] for ws in (w1, w2))
    ws1, ws2 = (w[0] if stacked else w for w in (w1, w2))
    opt = torch.optim.SGD(w1 + w2, lr=0.5)
    out = []
    with enabled_for(w1 + w2 if cache else None):
        for _ in range(2):
            for x in xs:
                x = x.clone().requires_grad_()
                y = routed_experts(x, COUNTS, ws1, ws2, p, recipe, recompute=recompute)
                y.float().square().sum().backward()
                out += [y.detach(), x.grad]
            grads = [w.grad for w in w1 + w2 if w.grad is not None]
            out += [g.clone() for g in (grads if not stacked else [e for g in grads for e in g.unbind(0)])]
            opt.step()
            opt.zero_grad()
        stats = (CACHE.stats.misses, CACHE.stats.hits)
    return out, stats


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_grouped_experts_are_bit_exact_and_quantized_once_per_step(name, recompute, stacked):
    """Per-expert parameters (megatron's SequentialMLP) or one [E, N, K] parameter per weight set (the standalone
    layer; the cache keys it by the 3-D tensor, which enters the experts' autograd Functions whole): the same
    outputs and gradients, the same quantizer passes and reuses."""
    recipe = Recipe.preset(name)
    ref, _ = _train_experts(recipe, cache=False, recompute=recompute)
    got, (misses, hits) = _train_experts(recipe, cache=True, recompute=recompute, stacked=stacked)
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    # per step (2 micro-batches, fc1 and fc2, 4 requests each): the first forward makes both copies of each weight
    # set (2 passes: the weights require grad) and the other 6 requests reuse them; under recompute the detached
    # weights of the backward's re-run are found by their place in storage (4 more reuses)
    assert (misses, hits) == ((4, 20) if recompute else (4, 12))


def test_grouped_experts_stacked_weights_are_views_of_one_parameter():
    """Experts stored as one [E, N, K] parameter: one entry per weight set, keyed by the 3-D tensor."""
    recipe = Recipe.fp8()
    w1l, w2l, xs, p = _experts()
    w1 = torch.nn.Parameter(torch.stack([w.detach() for w in w1l]))
    w2 = torch.nn.Parameter(torch.stack([w.detach() for w in w2l]))
    ref = grouped_expert_mlp(xs[0], COUNTS, w1, w2, p, recipe)
    with enabled_for([w1, w2]):
        for _ in range(3):
            got = grouped_expert_mlp(xs[0], COUNTS, w1, w2, p, recipe)
            assert torch.equal(got, ref)
        assert (CACHE.stats.misses, CACHE.stats.hits) == (2, 4)


CUDA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU with blockwise FP8 GEMMs (sm_90)")
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_gpu_cache_is_bit_exact(name):
    """The CUDA path (the Triton weight quantizer writing both layouts in one launch, grouped Triton GEMMs,
    F.scaled_mm): bit for bit the uncached path, one pass per weight and step, with and without expert recompute."""
    recipe = Recipe.preset(name)
    ref, _ = _train_dense(recipe, cache=False, dev="cuda")
    got, stats = _train_dense(recipe, cache=True, dev="cuda")
    assert stats == (2, 10) and all(torch.equal(a, b) for a, b in zip(got, ref))
    for recompute in (False, True):
        ref, _ = _train_experts(recipe, cache=False, recompute=recompute, dev="cuda")
        got, stats = _train_experts(recipe, cache=True, recompute=recompute, dev="cuda")
        assert stats == ((4, 20) if recompute else (4, 12))
        assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))
