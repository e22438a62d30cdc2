"""Causal attention with bidirectional image spans, without an O(S²) mask.

Queries are the last ``Lq`` positions of ``Lk`` keys (``Lq == Lk`` for a full forward, fewer when a cached
prefix supplies the first keys). A query at absolute position ``p`` sees every key ``< limit(p)``, where
``limit(p)`` is the end of the span containing ``p`` or ``p + 1`` outside spans. :func:`span_attention` cuts the
queries into runs with the same structure and runs one SDPA per run: a span (or a run starting at 0, or a single
token) needs no mask at all; a causal text run between spans needs a ``run x keys`` mask, a few rows.

When the engine hands the model an attention backend that declares ``spans`` (omnicore's packed-metadata
contract), :class:`SpanAttention` calls it with packed ``[T, H, D]`` tensors and an ``AttentionMetadata``
carrying the spans; otherwise it uses :func:`span_attention`. :func:`dense_mask_attention` is the O(S²)
reference the tests and the benchmark compare against.
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


def query_runs(q_start: int, q_end: int, spans: Sequence[Span]) -> list[tuple[int, int, int | None]]:
    """Split absolute query positions ``[q_start, q_end)`` into ``(a, b, span_end)`` runs: ``span_end`` is the
    span's end for queries inside a span (they all see keys ``< span_end``), ``None`` for causal runs."""
    ordered = sorted((s, e) for s, e in spans if e > s)
    runs: list[tuple[int, int, int | None]] = []
    p = q_start
    for s, e in ordered:
        if e <= p or s >= q_end:
            continue
        if s > p:
            runs.append((p, s, None))
        runs.append((max(s, p), min(e, q_end), e))
        p = min(e, q_end)
    if p < q_end:
        runs.append((p, q_end, None))
    return runs


def span_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Sequence[Span],
                   scale: float | None = None) -> torch.Tensor:
    """``q [B, Lq, H, D]``, ``k/v [B, Lk, Hkv, D]``; queries are positions ``[Lk - Lq, Lk)``."""
    lq, lk = q.shape[1], k.shape[1]
    offset = lk - lq
    if offset < 0:
        raise ValueError(f"more queries ({lq}) than keys ({lk})")
    k, v = _expand_kv(q, k, v)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, L, D]
    out = torch.empty_like(qt)
    for a, b, span_end in query_runs(offset, lk, spans):
        qa = qt[:, :, a - offset: b - offset]
        if span_end is not None:
            if span_end > lk:
                raise ValueError(f"span ends at {span_end}, past the {lk} keys")
            res = F.scaled_dot_product_attention(qa, kt[:, :, :span_end], vt[:, :, :span_end], scale=scale)
        elif b - a == 1:
            res = F.scaled_dot_product_attention(qa, kt[:, :, :b], vt[:, :, :b], scale=scale)
        elif a == 0:
            res = F.scaled_dot_product_attention(qa, kt[:, :, :b], vt[:, :, :b], is_causal=True, scale=scale)
        else:
            rows = torch.arange(a, b, device=q.device)[:, None]
            mask = torch.arange(b, device=q.device)[None, :] <= rows
            res = F.scaled_dot_product_attention(qa, kt[:, :, :b], vt[:, :, :b], attn_mask=mask, scale=scale)
        out[:, :, a - offset: b - offset] = res
    return out.transpose(1, 2)


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


def _metadata_types() -> tuple[Any, Any] | None:
    try:
        from omnicore.attention.metadata import AttentionMetadata, AttentionSpan
    except ImportError:
        return None
    return AttentionMetadata, AttentionSpan


class SpanAttention:
    """The attention call of every decoder layer: the engine's backend when it serves span metadata, else the
    local mask-free implementation. ``calls`` counts backend calls (tests read it)."""

    def __init__(self, backend: Callable[..., torch.Tensor] | None = None) -> None:
        self.backend = backend if backend is not None and _metadata_types() is not None else None
        self.calls = 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
        if self.backend is None:
            return span_attention(q, k, v, spans)
        metadata_cls, span_cls = _metadata_types()  # type: ignore[misc]
        b, lq, h, d = q.shape
        lk = k.shape[1]
        doc_spans = tuple(span_cls(s, e) for s, e in spans)
        metadata = metadata_cls(
            cu_seqlens_q=tuple(i * lq for i in range(b + 1)), cu_seqlens_k=tuple(i * lk for i in range(b + 1)),
            max_seqlen_q=lq, max_seqlen_k=lk, causal=True, spans=(doc_spans,) * b)
        self.calls += 1
        out = self.backend(q.reshape(b * lq, h, d), k.reshape(b * lk, k.shape[2], d),
                           v.reshape(b * lk, v.shape[2], d), metadata=metadata, causal=True)
        return out.reshape(b, lq, h, d)
