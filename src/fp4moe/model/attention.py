"""SDPA core attention for megatron-core multi-latent attention without Transformer Engine.

megatron-core 0.16.1's MLA (megatron/core/transformer/multi_latent_attention.py:155-166) builds its core
attention with ``k_channels=q_head_dim`` (nope + rope) and ``v_channels=v_head_dim``; the local
``DotProductAttention`` (megatron/core/transformer/dot_product_attention.py) takes neither and assumes one head
dim, so ``get_gpt_layer_local_spec(multi_latent_attention=True)`` fails at construction. This module is the
drop-in replacement: ``torch.nn.functional.scaled_dot_product_attention`` handles q/k head dim != v head dim.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPACoreAttention(MegatronModule):
    """Core attention on [s, b, heads, dim] tensors (megatron layout) -> [s, b, heads * v_dim].

    Causal masking only (``AttnMaskType.causal``; megatron's GPT passes ``attention_mask=None`` or the causal
    mask for it); no packed sequences, no context parallelism (CP > 1 needs TE in megatron-core anyway).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Any = None, **_: Any) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("SDPACoreAttention does not support context parallelism (parallel.context > 1)")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None,
                **_: Any) -> torch.Tensor:
        if packed_seq_params is not None:
            raise NotImplementedError("SDPACoreAttention: packed sequences are not supported")
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention: attention_bias is not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b, heads, _ = query.shape
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != heads:  # grouped-query attention: repeat kv heads
            rep = heads // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        causal = mask_type == AttnMaskType.causal
        mask = None
        if not causal and attention_mask is not None:
            mask = ~attention_mask  # megatron masks are True where attention is NOT allowed
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=causal, scale=self.softmax_scale)
        # [b, h, s, dv] -> [s, b, h * dv]
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * out.shape[-1])
