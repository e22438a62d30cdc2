"""The CPU reference attention (PyTorch SDPA), dense and packed-varlen.

Layouts follow flash-attention: dense ``[B, S, H, D]``; packed ``[T, H, D]`` where documents are delimited by
``cu_seqlens`` (int32/int64 prefix sums, ``cu_seqlens[0] == 0``, ``cu_seqlens[-1] <= T``). Packed attention
runs one SDPA call per document, so memory is O(Σ Sᵢ²) instead of the O(T²) of a block-diagonal mask, and
tokens of one document can never see another's. Rows past ``cu_seqlens[-1]`` (padding) come back as zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_cu(name: str, cu: torch.Tensor, total: int) -> list[int]:
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D tensor with at least 2 entries, got shape {tuple(cu.shape)}")
    bounds = [int(x) for x in cu.tolist()]
    if bounds[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {bounds[0]}")
    if any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {bounds}")
    if bounds[-1] > total:
        raise ValueError(f"{name}[-1]={bounds[-1]} exceeds the packed length {total}")
    return bounds


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention.

    Dense: ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]`` (GQA when ``H`` is a multiple of ``Hkv``), optional
    boolean ``attn_mask`` broadcastable to ``[B, H, Sq, Sk]`` (True = attend). Packed: ``q [Tq, H, D]``,
    ``k, v [Tk, Hkv, D]`` with ``cu_seqlens_q`` (and ``cu_seqlens_k``, defaulting to ``cu_seqlens_q``); masks
    are not accepted in packed mode because documents already isolate each other.
    """
    if cu_seqlens_q is None:
        if cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_k given without cu_seqlens_q")
        if q.dim() != 4:
            raise ValueError(f"dense attention expects q as [B, S, H, D], got shape {tuple(q.shape)}")
        return _dense(q, k, v, attn_mask, scale, causal)
    if attn_mask is not None:
        raise ValueError("packed attention takes no attn_mask: cu_seqlens already isolates documents")
    if q.dim() != 3:
        raise ValueError(f"packed attention expects q as [T, H, D], got shape {tuple(q.shape)}")
    cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    bq = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    bk = _check_cu("cu_seqlens_k", cu_k, k.shape[0])
    if len(bq) != len(bk):
        raise ValueError(f"cu_seqlens_q has {len(bq) - 1} documents but cu_seqlens_k has {len(bk) - 1}")
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for i in range(len(bq) - 1):
        qs, qe, ks, ke = bq[i], bq[i + 1], bk[i], bk[i + 1]
        if qe == qs:
            continue
        if ke == ks:
            raise ValueError(f"document {i} has {qe - qs} queries but no keys")
        out[qs:qe] = _dense(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], None, scale, causal)[0]
    return out


def _dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float | None,
    causal: bool,
) -> torch.Tensor:
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    if kv_heads != heads:
        kt = kt.repeat_interleave(heads // kv_heads, dim=1)
        vt = vt.repeat_interleave(heads // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, is_causal=causal, scale=scale)
    return out.transpose(1, 2)
