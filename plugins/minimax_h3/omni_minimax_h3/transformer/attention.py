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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

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
    """Calls a packed attention backend on ``q, k, v [T, heads, D]`` for a :class:`Documents` layout.

    With a block-sparse ``planner`` (:func:`enable_sparse_attention`; the backend executes plans) a DiT layer's
    call gets its layer's planned metadata — built once per :class:`Documents` and layer, cached on it; calls
    without a layer index (the token refiner) and layouts without a published video grid stay dense."""

    def __init__(self, fn: AttentionFn | None = None) -> None:
        if fn is None:
            from omnicore.plugin import sdpa_attention

            fn = sdpa_attention
        self.fn: AttentionFn = fn
        self.planner: Any = None
        self.layers = 0

    def metadata(self, docs: Documents, layer: int | None) -> AttentionMetadata:
        if self.planner is None or layer is None or docs.metadata.latent_grid is None:
            return docs.metadata
        planned = docs.__dict__.get("_planned")
        if planned is None or planned[0] is not self.planner:
            planned = (self.planner, self.planner.layer_metadata(docs.metadata, self.layers))
            docs.__dict__["_planned"] = planned
        return cast(AttentionMetadata, planned[1][layer])

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents,
                 scale: float, layer: int | None = None) -> torch.Tensor:
        return self.fn(q, k, v, metadata=self.metadata(docs, layer), scale=scale)


def enable_sparse_attention(dit: Any, options: Mapping[str, Any] | None = None) -> bool:
    """Attach block-sparse plans to ``dit``'s layer attention when its backend executes them (it carries a
    ``sparse_planner`` factory, e.g. ``npu_rainfusion``), built from ``options`` (``sparsity``, ``skip_layers``);
    returns whether plans are on. H3's documents are ``[text / conditions / audio | video]``: the video rows are the
    last real rows, which is what the published ``latent_grid`` promises."""
    packed: PackedAttention = dit.attention
    factory = getattr(packed.fn, "sparse_planner", None)
    packed.planner = factory(dict(options or {})) if callable(factory) else None
    packed.layers = len(dit.blocks)
    for i, block in enumerate(dit.blocks):
        block.attn.layer_index = i
    return packed.planner is not None


class RMSNorm(nn.Module):
    """Holds ``weight`` and ``eps``; the math is ``ops.rms_norm`` (fp32 inside, cast back)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, ops: Any) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class H3Attention(nn.Module):
    #: the DiT layer this attention belongs to (set by enable_sparse_attention; None: the token refiner's)
    layer_index: int | None = None

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
        out = attention(q, k, v, docs, self.scale, self.layer_index)
        return self.out_proj(out.reshape(t, self.inner).to(x.dtype))
