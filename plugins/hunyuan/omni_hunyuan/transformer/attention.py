"""Causal attention with bidirectional image spans, without an O(S²) mask.

Queries are the last ``Lq`` positions of ``Lk`` keys (``Lq == Lk`` for a full forward, fewer when a cached
prefix supplies the first keys). A query at absolute position ``p`` sees every key ``< limit(p)``, where
``limit(p)`` is the end of the span containing ``p`` or ``p + 1`` outside spans.

:class:`SpanAttention` hands the engine's attention backend (one that declares ``spans``, omnicore's
packed-metadata contract) packed ``[T, H, D]`` tensors and an ``AttentionMetadata`` carrying the spans; with no
backend, :func:`span_attention` makes the same call on omnicore's reference ``sdpa``, which cuts the queries into
runs sharing one key prefix and runs one SDPA per run (``omnicore.attention.metadata.query_runs``).
:func:`dense_mask_attention` is the O(S²) reference the tests and the benchmark compare against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

Span = tuple[int, int]


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
    return k, v


def span_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Sequence[Span],
                   scale: float | None = None) -> torch.Tensor:
    """``q [B, Lq, H, D]``, ``k/v [B, Lk, Hkv, D]``; queries are positions ``[Lk - Lq, Lk)``. Computed by
    omnicore's reference backend from span metadata (its mask-free run decomposition)."""
    from omnicore.plugin import sdpa_attention

    return _packed_call(sdpa_attention, q, k, v, spans, scale)


def dense_mask(lq: int, lk: int, spans: Sequence[Span], device: Any = None) -> torch.Tensor:
    """The ``[Lq, Lk]`` boolean mask (True = attend) the spans describe: causal plus bidirectional spans."""
    rows = torch.arange(lk - lq, lk, device=device)
    limit = rows + 1
    for s, e in spans:
        inside = (rows >= s) & (rows < e)
        limit = torch.where(inside, torch.full_like(limit, e), limit)
    return torch.arange(lk, device=device)[None, :] < limit[:, None]


def dense_mask_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Sequence[Span],
                         scale: float | None = None) -> torch.Tensor:
    """Reference: one SDPA call with the full ``[Lq, Lk]`` mask."""
    k, v = _expand_kv(q, k, v)
    mask = dense_mask(q.shape[1], k.shape[1], spans, q.device)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         scale=scale)
    return out.transpose(1, 2)


def _packed_call(backend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 spans: Sequence[Span], scale: float | None = None) -> torch.Tensor:
    """One packed call: each batch row is a causal document carrying the same spans (key positions)."""
    from omnicore.plugin import AttentionMetadata, AttentionSpan

    b, lq, h, d = q.shape
    lk = k.shape[1]
    if lq > lk:
        raise ValueError(f"more queries ({lq}) than keys ({lk})")
    doc_spans = tuple(AttentionSpan(s, e) for s, e in spans if e > s)
    metadata = AttentionMetadata(
        cu_seqlens_q=tuple(i * lq for i in range(b + 1)), cu_seqlens_k=tuple(i * lk for i in range(b + 1)),
        max_seqlen_q=lq, max_seqlen_k=lk, causal=True, spans=(doc_spans,) * b)
    out = backend(q.reshape(b * lq, h, d), k.reshape(b * lk, k.shape[2], d), v.reshape(b * lk, v.shape[2], d),
                  metadata=metadata, scale=scale, causal=True)
    return out.reshape(b, lq, h, v.shape[-1])


class SpanAttention:
    """The attention call of every decoder layer, through the engine's attention backend (one that serves span
    metadata), or omnicore's reference backend when none is given. ``calls`` counts the calls (tests read it)."""

    def __init__(self, backend: Callable[..., torch.Tensor] | None = None) -> None:
        self.backend = backend
        self.calls = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
        self.calls += 1
        if self.backend is None:
            return span_attention(q, k, v, spans)
        return _packed_call(self.backend, q, k, v, spans)
