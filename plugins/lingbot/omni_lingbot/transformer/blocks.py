"""One LingBot transformer block: sandwich norms, tanh-gated residuals, learned ``scale_shift_table``.

    mod = temb6 + scale_shift_table -> (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp)
    x = x + tanh(gate_msa) * norm_post_attn(attn(norm1(x) * (1 + scale_msa) + shift_msa))
    x = x + tanh(gate_mlp) * norm_post_ffn(ffn(norm2(x) * (1 + scale_mlp) + shift_mlp))

The residual stream and the modulation are fp32; tensors are cast to the weight dtype at each Linear.
"""

from __future__ import annotations

from typing import Any

import torch
from omnicore.plugin import ops as eager_ops
from torch import nn

from .attention import AttentionFn, LingBotAttention
from .config import LingBotTransformerConfig
from .ffn import SwiGLUFeedForward
from .layout import JointLayout
from .moe import LingBotMoE
from .norm import RMSNorm


def build_ffn(config: LingBotTransformerConfig, index: int) -> nn.Module:
    if not config.is_moe_layer(index):
        return SwiGLUFeedForward(config.hidden_size, config.intermediate_size)
    return LingBotMoE(
        config.hidden_size,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate=config.moe_intermediate_size,
        n_shared_experts=config.n_shared_experts,
        score_func=config.score_func,
        norm_topk_prob=config.norm_topk_prob,
        n_group=config.n_group,
        topk_group=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor,
    )


class LingBotBlock(nn.Module):
    ops: Any = eager_ops  # platform ops (modulate, gated residual, their fused form); see norm.bind_ops

    def __init__(self, config: LingBotTransformerConfig, index: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.norm_eps
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 6 * hidden))
        self.norm1 = RMSNorm(hidden, eps)
        self.attn = LingBotAttention(hidden, config.num_attention_heads, eps, config.qkv_bias, config.out_bias)
        self.norm_post_attn = RMSNorm(hidden, eps)
        self.norm2 = RMSNorm(hidden, eps)
        self.ffn = build_ffn(config, index)
        self.norm_post_ffn = RMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,
        temb6: torch.Tensor,
        layout: JointLayout,
        freqs: torch.Tensor,
        attention: AttentionFn,
    ) -> torch.Tensor:
        """``x [T, H]`` fp32 packed rows, ``temb6 [B, 6H]`` per-sample time modulation -> ``[T, H]`` fp32."""
        mod = temb6.float() + self.scale_shift_table.float()
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mod.chunk(6, dim=-1)
        ops = self.ops
        h = layout.modulate(self.norm1(x), shift_msa, scale_msa, ops)
        attn = self.norm_post_attn(self.attn(h, freqs, layout.attention, attention))
        x, h = layout.gated_add_norm_modulate(x, torch.tanh(gate_msa), attn, shift_mlp, scale_mlp, self.norm2.weight,
                                              self.norm2.eps, ops)  # = modulate(norm2(gated_add(...))), fusable
        ffn = self.norm_post_ffn(self.ffn(h, layout.token_mask))
        return layout.gated_add(x, torch.tanh(gate_mlp), ffn, ops)
