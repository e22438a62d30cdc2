"""Input handling shared by packed attention backends: the layouts and host-int checks of the reference.

Backend authors call :func:`packed_views` to accept packed ``q``/``k``/``v`` as ``[T, H, D]`` or a batch of one,
then :func:`check_packed` to refuse what the reference refuses, before launching a kernel. Both read only shapes
and the metadata's Python ints, never a device tensor.
"""

from __future__ import annotations

import torch

from .metadata import AttentionMetadata


def packed_views(q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(batched, q, k, v)`` with the batch of one dropped (views); re-add it with ``out[None] if batched``.

    Raises ``ValueError`` unless q, k, v are all ``[T, H, D]`` or all ``[1, T, H, D]``.
    """
    batched = q.dim() == 4
    if batched:
        if q.shape[0] != 1 or k.dim() != 4 or k.shape[0] != 1 or v.dim() != 4 or v.shape[0] != 1:
            raise ValueError(f"packed attention takes [T, H, D] (or a batch of one), got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}")
        q, k, v = q[0], k[0], v[0]
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"packed attention expects q, k, v as [T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    return batched, q, k, v


def check_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata, *,
                 documents: bool = True) -> None:
    """The reference's checks of packed ``[T, H, D]`` inputs against ``metadata``, on host ints only.

    Raises ``ValueError`` when the documents run past the packed rows, k and v differ in length, or (with
    ``documents``) a document has queries but no keys below ``valid_kv_length`` (a padding document past it may).
    """
    cu_q, cu_k = metadata.cu_seqlens_q, metadata.cu_k
    if cu_q[-1] > q.shape[0]:
        raise ValueError(f"cu_seqlens_q[-1]={cu_q[-1]} exceeds the packed length {q.shape[0]}")
    if cu_k[-1] > k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(f"cu_seqlens_k[-1]={cu_k[-1]} exceeds the packed key length {k.shape[0]} "
                         f"(or k and v differ: {tuple(k.shape)} vs {tuple(v.shape)})")
    if not documents:
        return
    valid = metadata.valid_kv_length
    for i in range(metadata.num_docs):
        if cu_q[i + 1] == cu_q[i]:
            continue
        ks, ke = cu_k[i], cu_k[i + 1] if valid is None else min(cu_k[i + 1], max(cu_k[i], valid))
        if ke == ks and (valid is None or ks < valid):
            raise ValueError(f"document {i} has {cu_q[i + 1] - cu_q[i]} queries but no keys")
