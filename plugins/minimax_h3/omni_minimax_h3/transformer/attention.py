"""Self-attention of MiniMax-H3 on a packed ``[T, hidden]`` sequence, and the call into the attention backend.

``qkv_proj`` (one fused GEMM, rows laid out ``[Q; K; V]``) -> per-head q/k RMSNorm -> rotate-half RoPE on the
leading ``rotary_dim`` channels (none in the token refiner) -> packed attention -> ``out_proj``.

The backend (chosen by ``options.attention(AttentionRequirement(packed_varlen=True, packed_mask_free=True))``)
is called as ``fn(q, k, v, metadata=AttentionMetadata, scale=...)`` with host-side document bounds. Documents are
``[real | pad]`` per request; for a single request the metadata carries ``valid_kv_length`` so a mask-free backend
drops the padding keys. No O(S²) mask is ever built. Every record also publishes
``laser_input_scale = 256`` (:data:`LASER_INPUT_SCALE`): H3's q/k logits overflow the fp16 workspace of the
Ascend laser kernel otherwise; backends without that workspace ignore it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from omnicore.plugin import AttentionMetadata
from torch import nn

AttentionFn = Callable[..., torch.Tensor]

#: the pre-scaling factor H3 asks of fp16-workspace attention kernels (q, k, v / 256; exact: a power of two)
LASER_INPUT_SCALE = 256


class Documents:
    """Host-side document bounds of one packed forward, with the device/metadata forms built once."""

    def __init__(self, bounds: Sequence[int], device: torch.device, *, valid_kv_length: int | None = None,
                 max_seqlen: int | None = None, latent_grid: tuple[int, int, int] | None = None) -> None:
        self.bounds = tuple(int(b) for b in bounds)
        if self.bounds[0] != 0 or any(b < a for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"document bounds must start at 0 and not decrease, got {self.bounds}")
        self.total = self.bounds[-1]
        self.valid_kv_length = valid_kv_length
        spans = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
        self.max_seqlen = int(max_seqlen if max_seqlen is not None else max(spans, default=0))
        self.device = torch.device(device)
        self.metadata = AttentionMetadata(cu_seqlens_q=self.bounds, cu_seqlens_k=None, max_seqlen_q=self.max_seqlen,
                                          max_seqlen_k=self.max_seqlen, valid_kv_length=self.valid_kv_length,
                                          latent_grid=latent_grid, laser_input_scale=LASER_INPUT_SCALE)


class PackedAttention:
    """Calls a packed attention backend on ``q, k, v [T, heads, D]`` for a :class:`Documents` layout."""

    def __init__(self, fn: AttentionFn | None = None) -> None:
        if fn is None:
            from omnicore.plugin import sdpa_attention

            fn = sdpa_attention
        self.fn: AttentionFn = fn

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents,
                 scale: float) -> torch.Tensor:
        return self.fn(q, k, v, metadata=docs.metadata, scale=scale)


class RMSNorm(nn.Module):
    """Holds ``weight`` and ``eps``; the math is ``ops.rms_norm`` (fp32 inside, cast back)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, ops: Any) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class H3Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, head_dim: int, qk_eps: float) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = head_dim
        self.inner = heads * head_dim
        self.scale = 1.0 / math.sqrt(head_dim)
        self.qkv_proj = nn.Linear(hidden, 3 * self.inner, bias=False)
        self.q_norm = RMSNorm(head_dim, qk_eps)
        self.k_norm = RMSNorm(head_dim, qk_eps)
        self.out_proj = nn.Linear(self.inner, hidden, bias=False)

    def forward(self, x: torch.Tensor, docs: Documents, attention: PackedAttention, ops: Any,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``x [T, hidden]``; ``rope`` = (cos, sin) ``[T, 1, rotary_dim]`` or None -> ``[T, hidden]``."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).view(t, 3, self.heads, self.head_dim).unbind(1)
        q = self.q_norm(q, ops)
        k = self.k_norm(k, ops)
        if rope is not None:
            q = ops.rope_rotate_half(q, *rope)
            k = ops.rope_rotate_half(k, *rope)
        out = attention(q, k, v, docs, self.scale)
        return self.out_proj(out.reshape(t, self.inner).to(x.dtype))
