"""EP = 2 on two gloo processes (CPU): the megatron GPTModel's MoE layer (megatron's dispatcher for bf16, ours
for fp8 / mxfp4) on each rank's tokens equals EP = 1 on the concatenated tokens (fp4moe's standalone MoELayer
on a one-rank group, whose EP = 1 equality with the megatron layer tests/model/test_recipe_model.py checks)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as tmp

pytest.importorskip("megatron.core")

CONF = Path(__file__).resolve().parents[2] / "conf"


def _worker(rank: int, port: int, out_dir: str) -> None:
    from fp4moe.model import cpu_shims

    with cpu_shims.active():  # a spawned process: the model tests' fixture holds them in the parent only
        _train(rank, port, out_dir)


def _train(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from omegaconf import OmegaConf

    from fp4moe.model.gpt_model import build_gpt_model
    from fp4moe.moe.layer import MoELayer as Standalone
    from fp4moe.recipe import Recipe

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    torch._dynamo.config.disable = True
    solo = [dist.new_group([0]), dist.new_group([1])][rank]
    results = {}
    for precision in ("bf16", "fp8", "mxfp4"):
        m = OmegaConf.load(CONF / "model" / "tiny_cpu.yaml")
        m.moe.aux_loss_coeff = 0.0
        par = OmegaConf.load(CONF / "parallel" / "cpu.yaml")
        par.world_size, par.expert = 2, 2
        cfg = OmegaConf.create({"model": m, "parallel": par, "recompute": OmegaConf.load(CONF / "recompute/none.yaml"),
                                "precision": OmegaConf.load(CONF / "precision" / f"{precision}.yaml")})
        recipe = Recipe.from_config(cfg.precision)
        torch.manual_seed(0)
        model = build_gpt_model(cfg, params_dtype=torch.bfloat16).bfloat16()
        moe = model.decoder.layers[1].mlp
        assert len(moe.experts.local_experts) == 4
        # EP = 1 reference with all 8 experts; the megatron layer takes its weights (rank r: experts 4r..4r+3)
        ref = Standalone(256, 128, 8, 2, recipe, group=solo, shared_ffn=128, score="sigmoid", seed=7)
        with torch.no_grad():
            moe.router.weight.copy_(ref.router)
            ref.router.copy_(moe.router.weight.float())  # the megatron router holds bf16 weights here
            for e, ex in enumerate(moe.experts.local_experts):
                ex.linear_fc1.weight.copy_(ref.w1[4 * rank + e])
                ex.linear_fc2.weight.copy_(ref.w2[4 * rank + e])
            moe.shared_experts.linear_fc1.weight.copy_(ref.shared_w1)
            moe.shared_experts.linear_fc2.weight.copy_(ref.shared_w2)
        g = torch.Generator().manual_seed(11)
        x_all = torch.randn(2, 8, 2, 256, generator=g).to(torch.bfloat16)  # [rank, s, b, H]
        gy_all = torch.randn(2, 8, 2, 256, generator=g).to(torch.bfloat16)
        x = x_all[rank].clone().requires_grad_(True)
        y, _ = moe(x)
        y.backward(gy_all[rank])
        # concatenated along s: flattened, rank 0's tokens then rank 1's (the order each expert sees at EP = 2)
        xr2 = torch.cat([x_all[0], x_all[1]], dim=0).clone().requires_grad_(True)  # [2s, b, H]
        yr = ref(xr2)
        yr.backward(torch.cat([gy_all[0], gy_all[1]], dim=0))
        sl = slice(8 * rank, 8 * rank + 8)
        dw1 = torch.stack([ex.linear_fc1.weight.grad for ex in moe.experts.local_experts])

        def rel(a, b):
            a, b = a.double(), b.double()
            return ((a - b).norm() / b.norm()).item()

        results[precision] = {"y": rel(y, yr[sl]), "dx": rel(x.grad, xr2.grad[sl]),
                              "dw1": rel(dw1, ref.w1.grad[4 * rank: 4 * rank + 4])}
        if precision != "bf16":
            st = moe.a2a_stats()
            results[precision]["remote"] = st["dispatch_forward_sent_remote_bytes"]
        rows = moe.token_dispatcher.fp4moe_rows   # every recipe: routed rows sent by this rank, received by its experts
        results[precision]["rows"] = (rows["sent"], rows["received"])
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_ep2_equals_ep1_on_concatenated_tokens(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        # bf16: megatron's SequentialMLP vs the standalone's float32 SwiGLU (see test_recipe_model TOL)
        assert max(r["bf16"][k] for k in ("y", "dx", "dw1")) < 1e-2, r["bf16"]
        for p in ("fp8", "mxfp4"):
            # expert path bit-exact; dx also carries megatron's router backward (float32 op order)
            assert r[p]["y"] == 0.0 and r[p]["dw1"] == 0.0, (p, r[p])
            assert r[p]["dx"] < 1e-2, (p, r[p])
            assert r[p]["remote"] > 0  # tokens really crossed ranks
    # routed rows: each rank sends its 16 tokens x top-2; what the two ranks' experts receive adds up to that, and the
    # routing is the same under every recipe (the same router weights and inputs)
    rows = {p: [torch.load(tmp_path / f"rank{k}.pt")[p]["rows"] for k in (0, 1)] for p in ("bf16", "fp8", "mxfp4")}
    for p, (r0, r1) in rows.items():
        assert r0[0] == r1[0] == 16 * 2 and r0[1] + r1[1] == 2 * 16 * 2, (p, r0, r1)
    assert rows["bf16"] == rows["fp8"] == rows["mxfp4"], rows
