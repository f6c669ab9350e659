"""The fp4moe recipe in a megatron-core model you build yourself (fp4moe.model.api), trained for a few steps.

    python examples/megatron_own_model.py --recipe mxfp4                       # one process (CPU or one GPU)
    torchrun --nproc-per-node 2 examples/megatron_own_model.py --recipe mxfp4  # EP=2 over the processes

Your own ``MLATransformerConfig`` (here a small DeepSeek-V3-shaped one: MLA, 8 experts top-2, a shared expert, the
first layer dense), megatron-core's ``GPTModel``, and fp4moe in three calls: ``with api.prepare():`` around building
and training, ``api.decoder_block_spec(config, recipe, ...)`` as the layer spec (the whole recipe is in it),
``api.finish(model, recipe)`` after building (a check and instrumentation of megatron's own MoE layers). Trained with
megatron-core's ``DistributedDataParallel``, ``finalize_model_grads`` and distributed optimizer (at EP=2 every rank
holds a replica of the dense weights, which DDP keeps one model). Prints the loss and gradient norm per step, whether
the dense weights are equal on every rank, and the all-to-all payload the MoE layers sent (MXFP4 rows under mxfp4).
Needs megatron-core 0.16.1 and torch; no Transformer Engine.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=("bf16", "fp8", "mxfp4"), default="mxfp4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--recompute", choices=("none", "attn_ln_experts", "attn_block_ln_experts"), default="none",
                    help="none; core attention + layernorms + routed experts; the whole attention block instead")
    ap.add_argument("--overlap", action="store_true",
                    help="megatron DDP's overlapped gradient reduction and parameter all-gather (small buckets)")
    args = ap.parse_args()

    from megatron.core import parallel_state

    from fp4moe.model import api

    # 1. processes: every rank is one expert-parallel rank (torchrun sets RANK / WORLD_SIZE; alone: a group of one)
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("PORT", "29511"))
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # fp4moe's patches of megatron and torch (no TE; CPU shims without CUDA), held while the model is built and trained
    with api.prepare():
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
        _build_and_train(args, world, rank, cuda)
    dist.destroy_process_group()


def _build_and_train(args, world: int, rank: int, cuda: bool) -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from fp4moe.model import api
    from fp4moe.model.gpt_model import a2a_stats, to_bf16_params
    from fp4moe.recipe import Recipe

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)

    # 2. your config (megatron-core settings without Transformer Engine)
    selective = dict(recompute_granularity="selective")
    recompute = {"none": {}, "attn_ln_experts": dict(selective, recompute_modules=["core_attn", "layernorm"]),
                 "attn_block_ln_experts": dict(selective, recompute_modules=["layernorm"])}
    own = {"none": (), "attn_ln_experts": ("moe_expert",), "attn_block_ln_experts": ("self_attention", "moe_expert")}
    config = MLATransformerConfig(
        num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, multi_latent_attention=True, q_lora_rank=128, kv_lora_rank=128, qk_head_dim=32,
        qk_pos_emb_head_dim=32, v_head_dim=32, qk_layernorm=True, rope_type="rope",
        num_moe_experts=8, moe_layer_freq=[0, 1], moe_ffn_hidden_size=128, moe_shared_expert_intermediate_size=128,
        moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4, moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall", expert_model_parallel_size=world,
        params_dtype=torch.bfloat16, bf16=True, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda, use_cpu_initialization=not cuda, **recompute[args.recompute])

    # 3. the recipe in megatron's model: spec before, finish after
    recipe = Recipe.preset(args.recipe)
    spec = api.decoder_block_spec(config, recipe, recompute_modules=own[args.recompute])
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=512, max_sequence_length=256,
                     position_embedding_type="none")   # MLA applies its own RoPE
    to_bf16_params(model)   # as megatron's Float16Module (the router's expert bias stays fp32)
    api.finish(model, recipe)   # checks the model is the recipe's; counters of megatron's own MoE layers (bf16)
    device = torch.device("cuda" if cuda else "cpu")
    model.to(device)

    # 4. megatron's DDP and distributed optimizer: every rank holds all dense weights (data-parallel replicas, their
    #    gradients averaged over the ranks) and its own experts; FP32 main params and AdamW moments sharded over the
    #    replicas. With --overlap the gradients reduce during the backward and the updated weights are all-gathered
    #    during the next forward (the recipe's experts wait for theirs: fp4moe.model.recipe_moe.await_parameters)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                               overlap_grad_reduce=args.overlap, overlap_param_gather=args.overlap,
                                               bucket_size=20000 if args.overlap else None)
    ddp = DistributedDataParallel(config, ddp_config, model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, use_distributed_optimizer=True,
                                                 clip_grad=1.0), [ddp])

    # 5. train: each rank its own tokens (batch 2 x 64)
    g = torch.Generator().manual_seed(rank)
    pos = torch.arange(64, device=device).unsqueeze(0).expand(2, -1)
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, 512, (2, 64), generator=g).to(device)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(ids, pos, None, labels=torch.roll(ids, -1, 1)).float().mean()
        loss.backward()
        finalize_model_grads([ddp])   # the gradients' reduction over the replicas, the router's expert-bias update
        updated, grad_norm, _ = opt.step()   # the global gradient norm, clipping, AdamW
        if not updated:
            raise FloatingPointError(f"step {step}: megatron's optimizer skipped the update (non-finite gradients)")
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f} grad_norm {grad_norm:.4f}", flush=True)
    if args.overlap:   # the last update's all-gather would wait for the next forward: now, before reading weights
        ddp.start_param_sync(force_sync=True)
    stats = a2a_stats(model)
    # the dense weights are one model on every rank (the experts' are each rank's own): fp64 sums, gathered
    dense = torch.stack([p.detach().double().sum() for p in model.parameters() if getattr(p, "allreduce", True)])
    sums = [torch.zeros_like(dense) for _ in range(world)]
    dist.all_gather(sums, dense)
    if rank == 0:
        same = all(torch.equal(s, sums[0]) for s in sums)
        print(f"recipe {recipe.name}, EP={world}: dense weights equal on every rank: {same}", flush=True)
        print(f"recipe {recipe.name}, EP={world}: " + ", ".join(f"{k}={v}" for k, v in sorted(stats.items())),
              flush=True)


if __name__ == "__main__":
    main()
