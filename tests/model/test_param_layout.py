"""megatron-core's parameters and DDP buffers as fp4moe.scale.optimizer_state predicts them, on the real model.

- ``stage_parameters`` lists the names and sizes ``GPTModel.named_parameters()`` yields, in its order, for the bf16
  recipe (megatron's SequentialMLP) and the recipes' grouped experts, with and without MTP, tied and untied.
- megatron's DDP with the distributed optimizer lays each buffer as ``buffer_layout`` says, element for element;
  the grouped experts then compute from the weights where DDP put them, and their gradients reach DDP's buffer.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fp4moe.config import OptimizerSetting
from fp4moe.scale.optimizer_state import buffer_layout, stage_parameters

pytest.importorskip("megatron.core")

CONF = Path(__file__).resolve().parents[2] / "conf"


def _cfg(precision: str, optimizer: str = "gpu_fp32", **model):
    m = OmegaConf.load(CONF / "model" / "tiny_cpu.yaml")
    for k, v in model.items():
        OmegaConf.update(m, k, v)
    opt = OmegaConf.merge(OmegaConf.load(CONF / "optimizer" / "gpu_fp32.yaml"),
                          OmegaConf.load(CONF / "optimizer" / f"{optimizer}.yaml"))
    opt.pop("defaults", None)
    return OmegaConf.create({"model": m, "parallel": OmegaConf.load(CONF / "parallel" / "cpu.yaml"),
                             "recompute": OmegaConf.load(CONF / "recompute" / "none.yaml"),
                             "precision": OmegaConf.load(CONF / "precision" / f"{precision}.yaml"),
                             "optimizer": opt})


def _build(cfg):
    from fp4moe.model.gpt_model import build_gpt_model, to_bf16_params

    torch.manual_seed(0)
    return to_bf16_params(build_gpt_model(cfg, params_dtype=torch.bfloat16))


@pytest.mark.parametrize("precision, model", [
    ("bf16", {}), ("mxfp4", {}), ("fp8", {"mtp_num_layers": 1}), ("bf16", {"mtp_num_layers": 1, "tie_embeddings": True}),
    ("mxfp4", {"tie_embeddings": True}),
])
def test_stage_parameters_are_megatrons(mp, precision, model):
    cfg = _cfg(precision, **model)
    got = [(n, p.numel()) for n, p in _build(cfg).named_parameters() if p.requires_grad]
    assert [(x.name, x.numel) for x in stage_parameters(cfg, 0)] == got


def test_ddp_buffers_and_expert_gradients(mp):
    """Distributed optimizer, one rank: DDP's parameter and gradient buffers as ``buffer_layout`` lays them; a MoE
    layer's grouped experts read their weights from DDP's parameter buffer (the expert parameters are views of it)
    and backward puts each expert's gradient into its slice of DDP's gradient buffer (``main_grad``), as one
    expert at a time through the same function would."""
    from fp4moe.model.recipe_moe import RecipeGroupedMLP
    from fp4moe.ops.grouped_experts import grouped_expert_mlp
    from fp4moe.recipe import Recipe
    from fp4moe.train.optim import wrap_model

    cfg = _cfg("mxfp4", "distributed")
    model = _build(cfg)
    ddp = wrap_model(model, OptimizerSetting.from_config(cfg))
    (buf,) = ddp.buffers
    layout = buffer_layout(stage_parameters(cfg, 0), shards=1, distributed=True, bucket_size=None)
    names = {p: n for n, p in model.named_parameters()}
    assert buf.numel == layout.numel and buf.grad_data.numel() == layout.numel
    placed = {names[p]: (s, e) for p, (s, e, _) in buf.param_index_map.items()}
    assert placed == {x.name: r for x, r in zip(layout.params, layout.ranges)}
    (mlp,) = [m for m in model.modules() if isinstance(m, RecipeGroupedMLP)]
    w1, w2 = mlp.grouped_weights()
    base = buf.param_data.untyped_storage().data_ptr()
    assert all(w.untyped_storage().data_ptr() == base for w in w1 + w2)
    g = torch.Generator().manual_seed(1)
    counts = [5, 0, 9, 2, 0, 7, 1, 4]
    x = torch.randn(sum(counts), w1[0].shape[1], generator=g).bfloat16()
    probs = torch.rand(sum(counts), generator=g)
    recipe = Recipe.preset("mxfp4")
    ddp.zero_grad_buffer()
    grouped_expert_mlp(x, counts, w1, w2, probs, recipe).float().sum().backward()
    got = [w.main_grad.clone() for w in w1 + w2]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    for e in range(len(counts)):  # each expert alone, its own rows: the same gradients
        a, b = (w1[e].detach().clone().requires_grad_(), w2[e].detach().clone().requires_grad_())
        rows = slice(offsets[e], offsets[e + 1])
        grouped_expert_mlp(x[rows], [counts[e]], [a], [b], probs[rows], recipe).float().sum().backward()
        for want, have in ((a.grad, got[e]), (b.grad, got[len(counts) + e])):
            assert torch.equal(want.float(), have), e
