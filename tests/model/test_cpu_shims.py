"""fp4moe.model.cpu_shims.active(): fp4moe's patches of megatron-core and torch are held only inside the scope.
Reference-counted (nested and repeated entries patch once and restore once), every patched attribute is its
original object again after the last exit (checked for every shim and, independently, for every attribute of torch,
torch.cuda, torch.Tensor and every megatron module and class), and a model builds and trains inside it on CPU.

This module enters and leaves the shims itself (``HOLDS_SHIMS_ITSELF``: the model tests' fixture holds them for
every other test)."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("megatron.core")

HOLDS_SHIMS_ITSELF = True
CONF = Path(__file__).resolve().parents[2] / "conf"
MISSING = object()


def _namespaces() -> list[object]:
    """torch, torch.cuda, torch.Tensor, every loaded megatron module and every class defined in one."""
    out: list[object] = [torch, torch.cuda, torch.Tensor]
    for name, mod in list(sys.modules.items()):
        if not name.startswith("megatron") or not isinstance(mod, types.ModuleType):
            continue
        out.append(mod)
        out += [v for v in vars(mod).values() if isinstance(v, type) and v.__module__ == name]
    return out


def _snapshot() -> dict[tuple[int, str], object]:
    """(id of namespace, attribute name) -> the object the namespace itself holds under that name."""
    return {(id(ns), k): v for ns in _namespaces() for k, v in list(vars(ns).items())}


def _changed(before: dict, after: dict) -> list[tuple[int, str]]:
    return [k for k, v in before.items() if after.get(k, MISSING) is not v]


def _own(owner, name):
    return vars(owner).get(name, MISSING)


def _applied(targets, originals) -> bool:
    """Whether every target holds another object than its original. A flag the shims set
    (multi_latent_attention.HAVE_TE = False, random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True) may hold that value
    outside already (the tracker flag once an earlier test in this process seeded megatron's tracker): the same bool
    object, applied all the same."""
    return all(_own(o, n) is not orig or isinstance(orig, bool) for (o, n), orig in zip(targets, originals))


def test_every_shim_is_undone_after_the_scope():
    from fp4moe.model import cpu_shims

    assert cpu_shims.depth() == 0 and cpu_shims.patched() == []
    with cpu_shims.active():  # once, so that every module the shims import is loaded before the snapshots
        targets = cpu_shims.patched()
    originals = [_own(owner, name) for owner, name in targets]
    before = _snapshot()

    scope = cpu_shims.active()
    with scope as cpu:
        assert cpu == (not torch.cuda.is_available())
        assert cpu_shims.patched() == targets and cpu_shims.depth() == 1
        assert _applied(targets, originals), "a shim is not applied"
        with cpu_shims.active(), scope:  # nested, and the same object again: nothing re-applied or undone
            assert cpu_shims.depth() == 3 and cpu_shims.patched() == targets
        assert cpu_shims.depth() == 1 and _applied(targets, originals)
    assert cpu_shims.depth() == 0 and cpu_shims.patched() == []
    assert [_own(o, n) for o, n in targets] == originals and all(
        _own(o, n) is orig for (o, n), orig in zip(targets, originals))
    assert _changed(before, _snapshot()) == []

    names = {f"{getattr(o, '__name__', o)}.{n}" for o, n in targets}
    from megatron.core.extensions import transformer_engine as mte

    expected = {"megatron.core.tensor_parallel.CheckpointWithoutOutput", "megatron.core.tensor_parallel.checkpoint"}
    if not mte.HAVE_TE:
        expected |= {"megatron.core.transformer.multi_latent_attention.HAVE_TE",
                     "megatron.core.optimizer.is_te_min_version",
                     "DistributedOptimizer._set_main_param_and_optimizer_states"}
    if not torch.cuda.is_available():
        expected |= {"torch.cuda.current_device", "torch.cuda.Stream", "Tensor.type",
                     "megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER",
                     "megatron.core.pipeline_parallel.schedules.torch",
                     "HybridDeviceOptimizer._get_sub_optimizer_param_groups", "FileSystemWriterAsync.preload_tensors",
                     "LanguageModule.setup_embeddings_and_output_layer"}
    assert expected <= names, expected - names


def test_a_model_trains_inside_the_scope_and_nothing_is_left_after_it():
    """The tiny model (mxfp4, recompute of layernorm / core attention / experts, whose checkpoints are the shims')
    builds and trains 3 steps on CPU inside the scope; after it every shim's attribute is its original object and
    megatron's RNG tracker is megatron's again. Building without the scope is refused."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    from fp4moe.model import cpu_shims
    from fp4moe.model.gpt_model import build_gpt_model, prepare, to_bf16_params

    m = OmegaConf.load(CONF / "model" / "tiny_cpu.yaml")
    cfg = OmegaConf.create({"model": m, "parallel": OmegaConf.load(CONF / "parallel" / "cpu.yaml"),
                            "recompute": OmegaConf.load(CONF / "recompute" / "attn_ln_experts.yaml"),
                            "precision": OmegaConf.load(CONF / "precision" / "mxfp4.yaml")})
    with cpu_shims.active():
        targets = cpu_shims.patched()
    originals = [_own(o, n) for o, n in targets]
    tracker = mrandom._CUDA_RNG_STATE_TRACKER

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="not held"):
            build_gpt_model(cfg, params_dtype=torch.bfloat16)
        with prepare() as held, torch._dynamo.config.patch(disable=True):
            assert held.cpu == (not torch.cuda.is_available()) and cpu_shims.depth() == 1
            parallel_state.initialize_model_parallel(1, 1)
            mrandom.model_parallel_cuda_manual_seed(1)
            torch.manual_seed(0)
            model = to_bf16_params(build_gpt_model(cfg, params_dtype=torch.bfloat16))
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, 512, (2, 32), generator=g)
            pos = torch.arange(32).unsqueeze(0).expand(2, -1)
            losses = []
            for _ in range(3):
                loss = model(ids, pos, None, labels=torch.roll(ids, -1, 1)).float().mean()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            assert losses[-1] < losses[0], losses
        parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    assert cpu_shims.depth() == 0
    assert all(_own(o, n) is orig for (o, n), orig in zip(targets, originals))
    assert mrandom._CUDA_RNG_STATE_TRACKER is tracker
