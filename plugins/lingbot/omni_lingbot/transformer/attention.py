"""Self-attention of a LingBot block on a packed ``[T, hidden]`` sequence.

q/k/v projections -> per-head RMSNorm -> complex RoPE -> a packed attention backend (documents described by an
``AttentionMetadata`` with host-int lengths, no mask) -> ``to_out``. The backend is any callable with the signature
of ``omnicore.attention.reference.sdpa_attention``. (The RoPE is interleaved-complex, not the rotate-half op of
``omnicore.ops``, so it stays local.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from omnicore.plugin import AttentionMetadata
from torch import nn

from .embeddings import linear
from .norm import RMSNorm
from .rope import apply_rotary

AttentionFn = Callable[..., torch.Tensor]


class LingBotAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float, qkv_bias: bool, out_bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.to_q = nn.Linear(hidden, hidden, bias=qkv_bias)
        self.to_k = nn.Linear(hidden, hidden, bias=qkv_bias)
        self.to_v = nn.Linear(hidden, hidden, bias=qkv_bias)
        self.norm_q = RMSNorm(self.head_dim, eps)
        self.norm_k = RMSNorm(self.head_dim, eps)
        self.to_out = nn.Linear(hidden, hidden, bias=out_bias)

    def forward(
        self,
        x: torch.Tensor,
        freqs: torch.Tensor,
        metadata: AttentionMetadata,
        attention: AttentionFn,
    ) -> torch.Tensor:
        """``x [T, hidden]`` (any float dtype), ``freqs [T, head_dim/2]`` complex -> ``[T, hidden]`` (Linear dtype)."""
        t = x.shape[0]
        q = linear(self.to_q, x).view(t, self.heads, self.head_dim)
        k = linear(self.to_k, x).view(t, self.heads, self.head_dim)
        v = linear(self.to_v, x).view(t, self.heads, self.head_dim)
        q = apply_rotary(self.norm_q(q), freqs)
        k = apply_rotary(self.norm_k(k), freqs)
        out = attention(q, k, v, metadata=metadata, scale=1.0 / math.sqrt(self.head_dim))
        return linear(self.to_out, out.reshape(t, -1))
