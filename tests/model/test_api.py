"""fp4moe.model.api, the recipe in a megatron-core model the user builds: examples/megatron_own_model.py trains
with it (one process and EP=2 over two gloo processes, under bf16 and mxfp4, with the whole-block recompute), the
MoE dispatch sends MXFP4 rows under mxfp4, and what the recipe's modules cannot run is a ConfigError."""
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
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", r.stdout, re.M)]
    stats = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", r.stdout.splitlines()[-1]))
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
    losses, stats = _run(["--recipe", "mxfp4", "--recompute", "attn_block_ln_experts", "--steps", "2"], nproc=2,
                         port=29621)
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
