"""fp4moe.model.api, the recipe in a megatron-core model the user builds: examples/megatron_own_model.py trains
with it through megatron's DDP and distributed optimizer (one process and EP=2 over two gloo processes, under bf16
and mxfp4, with the whole-block recompute), the MoE dispatch sends MXFP4 rows under mxfp4, and what the recipe's
modules cannot run is a ConfigError."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "megatron_own_model.py"


def _run(args, nproc=1, port=29611):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PORT": str(port)}
    cmd = [sys.executable, str(EXAMPLE), *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(EXAMPLE), *args]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+) grad_norm \S+$", r.stdout, re.M)]
    stats = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", r.stdout.splitlines()[-1]))
    # megatron's DDP keeps the dense weights one model on every rank (each rank trains on its own tokens)
    assert "dense weights equal on every rank: True" in r.stdout, r.stdout[-2000:]
    return losses, stats


@pytest.mark.parametrize("recipe", ["bf16", "mxfp4"])
def test_example_trains_with_the_recipe(recipe):
    from fp4moe.ops.all_to_all import a2a_payload_bytes

    losses, stats = _run(["--recipe", recipe, "--steps", "3"], port=29611 + (recipe == "mxfp4"))
    assert len(losses) == 3 and all(4.0 < x < 8.0 for x in losses), losses   # ln(512) = 6.24 at the start
    rows = stats["dispatch_forward_sent_rows"]
    assert rows == 3 * 2 * 64 * 2   # 3 steps x 128 tokens x top-2, one MoE layer
    if recipe == "mxfp4":   # the recipe's dispatcher sent MXFP4 rows (256 / 2 + 256 / 32 bytes each)
        assert stats["dispatch_forward_sent_bytes"] == a2a_payload_bytes(rows, 256, "mxfp4") == rows * 136
    else:                   # megatron's own dispatcher: no recipe payload counters
        assert "dispatch_forward_sent_bytes" not in stats


def test_example_with_ep2_and_the_whole_attention_block_recomputed():
    """EP=2 over two processes, each its own tokens, with megatron's DDP overlapping the gradient reduction and the
    parameter all-gather in small buckets: the dense weights stay one model (the example's torch AdamW without DDP
    let the two copies drift apart after the first step)."""
    losses, stats = _run(["--recipe", "mxfp4", "--recompute", "attn_block_ln_experts", "--steps", "2", "--overlap"],
                         nproc=2, port=29621)
    assert len(losses) == 2 and stats["dispatch_forward_sent_remote_bytes"] > 0   # rows crossed to the other rank


def test_spec_refuses_what_the_recipe_cannot_run():
    """The recipe's modules on a config they do not support, and fp4moe's recompute modules misused: one message
    that names the setting (the config objects are plain stand-ins: the checks read attributes only)."""
    from types import SimpleNamespace

    from fp4moe.config import ConfigError
    from fp4moe.model import api
    from fp4moe.recipe import Recipe

    ok = dict(expert_tensor_parallel_size=1, tensor_model_parallel_size=1, moe_token_dispatcher_type="alltoall",
              moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
              moe_shared_expert_overlap=False, recompute_granularity=None, recompute_modules=None)
    mx = Recipe.preset("mxfp4")
    with pytest.raises(ConfigError, match="needs parallel.tensor = parallel.expert_tensor = 1"):
        api.decoder_block_spec(SimpleNamespace(**{**ok, "tensor_model_parallel_size": 2}), mx)
    with pytest.raises(ConfigError, match="needs parallel.dispatcher=alltoall"):
        api.decoder_block_spec(SimpleNamespace(**{**ok, "moe_token_dispatcher_type": "allgather"}), mx)
    with pytest.raises(ConfigError, match="layernorm is megatron's"):
        api.decoder_block_spec(SimpleNamespace(**ok), mx, recompute_modules=("layernorm",))
    nested = {**ok, "recompute_granularity": "selective", "recompute_modules": ["core_attn", "layernorm"]}
    with pytest.raises(ConfigError, match="self_attention .* and config.recompute_modules \\['core_attn'\\]"):
        api.decoder_block_spec(SimpleNamespace(**nested), mx, recompute_modules=("self_attention",))


def test_the_spec_alone_carries_the_recipe(mp):
    """A GPTModel built from ``api.decoder_block_spec`` has the whole recipe with no call after building (mxfp4 with
    FP8 attention / dense linears, MXFP4 recompute caches, the recipe's MoE layer counting its rows): the same loss,
    gradients and all-to-all counts bit for bit as fp4moe's own build (``build_gpt_model``, which calls ``finish``).
    ``finish`` with another recipe than the spec's is a ConfigError."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from omegaconf import OmegaConf

    from fp4moe.config import ConfigError
    from fp4moe.model import api
    from fp4moe.model.gpt_model import a2a_stats, build_gpt_model, to_bf16_params, transformer_config
    from fp4moe.recipe import Recipe

    conf = ROOT / "conf"
    cfg = OmegaConf.create({"model": OmegaConf.load(conf / "model" / "tiny_cpu.yaml"),
                            "parallel": OmegaConf.load(conf / "parallel" / "cpu.yaml"),
                            "recompute": OmegaConf.load(conf / "recompute" / "attn_ln_experts.yaml"),
                            "precision": {**OmegaConf.load(conf / "precision" / "mxfp4.yaml"), "scope": "all_linears"}})
    recipe = Recipe.from_config(cfg.precision)
    config = transformer_config(cfg.model, cfg.parallel, cfg.recompute, params_dtype=torch.bfloat16)
    spec = api.decoder_block_spec(config, recipe, recompute_modules=("moe_expert",))
    torch.manual_seed(0)
    own = to_bf16_params(GPTModel(config=config, transformer_layer_spec=spec, vocab_size=512, max_sequence_length=256,
                                  share_embeddings_and_output_weights=False, position_embedding_type="none"))
    torch.manual_seed(0)
    ref = to_bf16_params(build_gpt_model(cfg, params_dtype=torch.bfloat16))

    def step(model):
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 512, (2, 32), generator=g)
        loss = model(ids, torch.arange(32).unsqueeze(0).expand(2, -1), None, labels=torch.roll(ids, -1, 1))
        loss = loss.float().mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (l0, g0), (l1, g1) = step(ref), step(own)
    assert torch.equal(l0, l1) and g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)
    assert a2a_stats(own) == a2a_stats(ref) and a2a_stats(own)["dispatch_forward_sent_rows"] == 2 * 32 * 2
    with pytest.raises(ConfigError, match="not built from the spec of recipe 'fp8'"):
        api.finish(own, Recipe.preset("fp8"))
    assert api.finish(own, recipe) == ref.fp4moe_bf16_linears


@pytest.mark.parametrize("main_dtype", ["float32", "bfloat16"])
def test_megatron_gradient_accumulation_fusion_without_apex(mp, main_dtype):
    """Under fp4moe's patches (``api.prepare()``'s), a megatron linear built with ``gradient_accumulation_fusion``,
    which megatron refuses without apex, builds, and its backward adds the weight gradient into the weight's
    ``main_grad`` (DDP's buffer) through fp4moe's stand-in for apex's extension: earlier values plus the unfused
    linear's gradient (rounded once into BF16), ``grad_added_to_main_grad`` set; input gradients the same bits."""
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    def linear(fusion):
        cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                                gradient_accumulation_fusion=fusion, params_dtype=torch.bfloat16, bf16=True)
        torch.manual_seed(0)
        return ColumnParallelLinear(64, 96, config=cfg, init_method=torch.nn.init.xavier_normal_, bias=False,
                                    gather_output=False)

    fused, plain = linear(True), linear(False)
    assert torch.equal(fused.weight, plain.weight)
    dtype = getattr(torch, main_dtype)
    g = torch.Generator().manual_seed(1)
    earlier = torch.randn(96, 64, generator=g).to(dtype)
    fused.weight.main_grad, fused.weight.grad_added_to_main_grad = earlier.clone(), False
    x = torch.randn(16, 2, 64, generator=g).bfloat16()   # [sequence, batch, hidden]
    dy = torch.randn(16, 2, 96, generator=g).bfloat16()
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    for lin, xx in zip((fused, plain), xs):
        lin(xx)[0].backward(dy)
    assert fused.weight.grad_added_to_main_grad
    assert torch.equal(fused.weight.main_grad, (earlier.float() + plain.weight.grad.float()).to(dtype))
    assert torch.equal(xs[0].grad, xs[1].grad)


def test_fused_megatron_linear_behind_saved_tensor_hooks_still_gives_ddp_a_gradient(mp):
    """Behind ``saved_tensors_hooks`` (fp4moe's saved-bytes accounting, the MXFP4 store) autograd hands megatron's
    backward a new weight object without the Parameter's attributes; megatron's fused path then adds into main_grad
    but returns no weight gradient, which DDP's hook refuses under overlap_grad_reduce. Under fp4moe's patches the
    Parameter gets its stand-in gradient (zeros under zero_out_wgrad) and grad_added_to_main_grad, and main_grad the
    same sum as without the hooks."""
    from contextlib import nullcontext

    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            gradient_accumulation_fusion=True, params_dtype=torch.bfloat16, bf16=True)
    lin = ColumnParallelLinear(64, 96, config=cfg, init_method=torch.nn.init.xavier_normal_, bias=False,
                               gather_output=False)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 2, 64, generator=g).bfloat16()
    dy = torch.randn(16, 2, 96, generator=g).bfloat16()
    sums = []
    for hooks in (False, True):
        lin.weight.grad = None
        lin.weight.main_grad, lin.weight.grad_added_to_main_grad = torch.zeros(96, 64), False
        lin.weight.zero_out_wgrad = True
        scope = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if hooks else nullcontext()
        with scope:
            y = lin(x.clone().requires_grad_())[0]
        y.backward(dy)
        assert lin.weight.grad is not None and not lin.weight.grad.any(), hooks   # the stand-in: zeros
        assert lin.weight.grad_added_to_main_grad, hooks
        sums.append(lin.weight.main_grad.clone())
    assert torch.equal(sums[0], sums[1]) and sums[0].any()
