"""fp4moe.model.init: weights redrawn from generators keyed by the seed and the global parameter name; megatron's
distributions kept (std per weight kind, constants untouched). That EP2 x DP2 then trains like one process is
tests/train/test_cli.py::test_two_processes_data_parallel_equal_one_process[2]."""
from __future__ import annotations

import pytest
import torch

from tests.model.test_gpt_model import _cfg

pytest.importorskip("megatron.core")


def _built(seed: int = 0):
    from fp4moe.model.gpt_model import build_gpt_model

    torch.manual_seed(seed)  # megatron's own draws: differ with this seed
    return build_gpt_model(_cfg())


def test_same_seed_same_weights_whatever_megatron_drew(mp):
    from fp4moe.model.init import global_names, reinit_layout_invariant

    a, b = _built(0), _built(1)
    assert not torch.equal(a.embedding.word_embeddings.weight, b.embedding.word_embeddings.weight)
    norms = {n: p.clone() for n, p in a.named_parameters() if p.ndim == 1}
    n = reinit_layout_invariant(a, 7)
    assert n == reinit_layout_invariant(b, 7) > 10
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
    assert all(torch.equal(p, norms[n]) for n, p in a.named_parameters() if p.ndim == 1)
    c = _built(0)
    reinit_layout_invariant(c, 8)
    assert not torch.equal(c.output_layer.weight, a.output_layer.weight)
    std, out_std = a.config.init_method_std, a.config.output_layer_init_method.keywords["std"]
    for name, p in a.named_parameters():
        if p.ndim == 2:
            want = out_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else std
            assert abs(p.float().std().item() / want - 1) < 0.05, (name, p.float().std().item(), want)
    g = global_names(a)  # EP1: every expert is local, local index = global index; layer i is global layer i
    assert g["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"] == \
        "decoder.layers.1.mlp.experts.global_experts.3.linear_fc1.weight"
    assert g["embedding.word_embeddings.weight"] == "embedding.word_embeddings.weight"


def test_global_names_follow_expert_and_layer_numbers(mp):
    from fp4moe.model.init import global_names

    m = _built()
    moe = m.decoder.layers[1].mlp
    moe.local_expert_indices = [4 + i for i in range(len(moe.local_expert_indices))]  # as EP rank 1 of 2 holds
    m.decoder.layers[1].layer_number = 7                                               # as a later pipeline stage
    g = global_names(m)
    assert g["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"] == \
        "decoder.layers.6.mlp.experts.global_experts.4.linear_fc2.weight"
    assert g["decoder.layers.1.mlp.router.weight"] == "decoder.layers.6.mlp.router.weight"
    assert g["decoder.layers.0.self_attention.linear_proj.weight"] == "decoder.layers.0.self_attention.linear_proj.weight"
