"""The CPU reference attention (PyTorch SDPA), dense and packed-varlen; every backend is tested against it.

Call signature shared by every attention backend::

    fn(q, k, v, *, metadata=None, attn_mask=None, scale=None, causal=False) -> Tensor

Dense (``metadata is None``): ``q [B, Sq, H, D]``, ``k, v [B, Sk, Hkv, D]`` (GQA when ``H`` is a multiple of
``Hkv``), optional boolean ``attn_mask`` broadcastable to ``[B, H, Sq, Sk]`` (True = attend). Packed: ``q [Tq, H, D]``,
``k, v [Tk, Hkv, D]`` (a leading batch of 1 is accepted) described by an
:class:`~omnicore.attention.metadata.AttentionMetadata` — documents, ``valid_kv_length`` (``[real | pad]``),
prefix K/V (more keys than queries), causal and bidirectional spans, an optional sparse plan (a dense backend
ignores it; selection never gives a dense backend to a call site that requires sparsity).

The reference works one document at a time on host-int offsets: documents never see each other and no device
tensor is read on the host. Inside a causal document every query sees a key *prefix* (up to its own position, or
to the end of the bidirectional span it sits in), so the queries are cut into runs that share one prefix
(:func:`~omnicore.attention.metadata.query_runs`) and each run is one SDPA call over its prefix with no mask: a
span, a single token, or a causal stretch from position 0 (``is_causal``). Only a causal stretch that starts
later (text between images, queries after a cached prefix) takes a mask, built in row blocks of at most
:data:`MASK_BLOCK_ELEMENTS`, so no ``[S, S]`` mask is ever made. Grouped K/V heads are read in place
(``enable_gqa``), never repeated. Query rows outside every document (or past ``valid_kv_length``) come back as
zeros.

The keywords ``cu_seqlens_q`` / ``cu_seqlens_k`` (tensors) of the first wave are still accepted for
compatibility; they are read on the host once per call (a device sync), so new code passes ``metadata``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .inputs import check_packed, packed_views
from .metadata import AttentionMetadata, QueryRun, query_runs


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    metadata: AttentionMetadata | None = None,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention (see the module docstring for layouts and metadata semantics)."""
    if metadata is None and (cu_seqlens_q is not None or cu_seqlens_k is not None):
        metadata = legacy_metadata(cu_seqlens_q, cu_seqlens_k)
    elif cu_seqlens_q is not None or cu_seqlens_k is not None:
        raise ValueError("pass either metadata= or the legacy cu_seqlens_q/cu_seqlens_k, not both")
    if metadata is None:
        if q.dim() != 4:
            raise ValueError(f"dense attention expects q as [B, S, H, D], got shape {tuple(q.shape)}")
        sq, sk = q.shape[1], k.shape[1]
        if causal and sq < sk and attn_mask is None:  # bottom-right causal over a longer key prefix
            if q.shape[2] % k.shape[2]:
                raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of key/value heads ({k.shape[2]})")
            out = q.new_empty(*q.shape[:3], v.shape[-1])
            _attend_runs(q, k, v, out, query_runs(sk - sq, sk), sk - sq, scale)
            return out
        if causal and sq != sk:
            mask = _causal_mask(sq, sk, q.device)
            attn_mask = mask if attn_mask is None else attn_mask & mask
            causal = False
        return _dense(q, k, v, attn_mask, scale, causal)
    if attn_mask is not None:
        raise ValueError("packed attention takes no attn_mask: the metadata's documents already isolate rows")
    batched, q, k, v = packed_views(q, k, v)
    out = packed_reference(q, k, v, metadata, scale=scale, causal=causal or metadata.causal)
    return out[None] if batched else out


def legacy_metadata(cu_q: torch.Tensor | None, cu_k: torch.Tensor | None) -> AttentionMetadata:
    """Metadata from first-wave ``cu_seqlens`` tensors (reads them on the host)."""
    if cu_q is None:
        raise ValueError("cu_seqlens_k given without cu_seqlens_q")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu is not None and (cu.dim() != 1 or cu.numel() < 2):
            raise ValueError(f"{name} must be a 1-D tensor with at least 2 entries, got shape {tuple(cu.shape)}")
    return AttentionMetadata(cu_seqlens_q=[int(x) for x in cu_q.tolist()],
                             cu_seqlens_k=None if cu_k is None else [int(x) for x in cu_k.tolist()])


def packed_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Packed attention, one document at a time, from the metadata's host ints."""
    check_packed(q, k, v, metadata, documents=False)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    cu_q, cu_k = metadata.cu_seqlens_q, metadata.cu_k
    valid = metadata.valid_kv_length
    spans = metadata.spans if causal else None
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for i in range(metadata.num_docs):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if valid is not None:
            qe = min(qe, max(qs, valid)) if metadata.cu_seqlens_k is None else qe
            ke = min(ke, max(ks, valid))
        if qe == qs:
            continue
        if ke == ks:
            if valid is not None and ks >= valid:
                continue  # a padding document: its outputs are unspecified (zeros here)
            raise ValueError(f"document {i} has {qe - qs} queries but no keys")
        if causal:
            # queries are the document's last positions (bottom-right), counted on its full lengths; a query
            # placed before the first key (more queries than keys) sees nothing and stays zero
            first = (cu_k[i + 1] - ks) - (cu_q[i + 1] - qs)
            skip = max(0, -first)
            runs = query_runs(first + skip, first + qe - qs, spans[i] if spans is not None else (),
                              key_limit=ke - ks) if qe - qs > skip else ()
            first, qs = first + skip, qs + skip
        else:
            first, runs = 0, (QueryRun(0, qe - qs, ke - ks),)
        _attend_runs(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], out[None, qs:qe], runs, first, scale)
    return out


#: the most boolean mask elements one SDPA call gets (a causal run starting past position 0 is cut into row
#: blocks that fit, so no call ever holds a ``queries x keys`` mask of the whole document)
MASK_BLOCK_ELEMENTS = 1 << 20


def _attend_runs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    runs: Sequence[QueryRun],
    first: int,
    scale: float | None,
) -> None:
    """One SDPA call per :class:`QueryRun` (or per row block of a late causal run), written into ``out``.

    ``q [B, n, H, D]`` holds the queries at positions ``first .. first + n - 1``; ``k, v [B, L, Hkv, D]``
    the document's keys from position 0; ``out [B, n, H, Dv]`` (a view) receives the rows. A run needs no mask
    when its queries share one key prefix, or when it is causal from position 0 (``is_causal`` on the square).
    """
    gqa = q.shape[2] != k.shape[2]
    qt, kt, vt, ot = (x.transpose(1, 2) for x in (q, k, v, out))  # views [B, heads, rows, D]
    for run in runs:
        a, b = run.start - first, run.end - first
        if not run.causal or run.start == 0:
            keys = run.keys
            ot[:, :, a:b] = F.scaled_dot_product_attention(qt[:, :, a:b], kt[:, :, :keys], vt[:, :, :keys],
                                                           is_causal=run.causal, scale=scale, enable_gqa=gqa)
            continue
        rows = max(1, MASK_BLOCK_ELEMENTS // run.end)
        for p in range(run.start, run.end, rows):
            e = min(run.end, p + rows)  # queries at p .. e - 1 see keys [0, own position]
            mask = torch.arange(e, device=q.device)[None, :] <= torch.arange(p, e, device=q.device)[:, None]
            ot[:, :, p - first:e - first] = F.scaled_dot_product_attention(
                qt[:, :, p - first:e - first], kt[:, :, :e], vt[:, :, :e], attn_mask=mask, scale=scale,
                enable_gqa=gqa)


def _causal_mask(lq: int, lk: int, device: torch.device) -> torch.Tensor:
    """``[lq, lk]`` bool: query ``i`` sits at key position ``lk - lq + i`` and sees the keys at or before it."""
    pos = torch.arange(lk - lq, lk, device=device)
    return torch.arange(lk, device=device)[None, :] <= pos[:, None]


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
