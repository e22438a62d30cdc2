"""A CPU implementation of the documented semantics of the ops behind the npu op seam (``CpuReferenceOps``).

It is not MindIE-SD: it computes what the seam's documentation (:mod:`omni_backends_npu.seam`) says each op
computes, in float32 with torch SDPA, and records every call (:attr:`CpuReferenceOps.calls`) so tests can check
what each attention path handed the op — shapes, views, scale, op type, layout, mask. Install it with
``omni_backends_npu.seam.use_ops(CpuReferenceOps())``.

The rf_v2 op's stand-in follows MindIE-SD's documented selection: the prefix and the promoted rows stay dense;
the sparse video rows form 128-row blocks; every query block keeps the ``ceil(blocks * (1 - sparsity))`` key blocks
whose mean-pooled key scores highest against its mean-pooled query. It skips the spatial rearrangement (the
promoted rows are taken as the video's last rows), so with ``sparsity > 0`` it matches the kernel's kind of
result, not its exact block choice; with ``sparsity = 0`` it is dense attention over ``used_len`` rows.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.nn.functional as F

from .seam import LAYOUTS, OP_TYPES


@attrs.define
class OpCall:
    """One recorded op call: the op's name, the tensors it received (the objects themselves) and its keywords."""

    op: str
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kwargs: dict[str, Any]
    output: torch.Tensor | None = None


def _sdpa_bsnd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k.float().transpose(1, 2),
                                         v.float().transpose(1, 2), attn_mask=mask, scale=scale)
    return out.transpose(1, 2).to(q.dtype)


class CpuReferenceOps:
    """CPU implementation of the documented op semantics of the npu op seam (tests; see the module docstring)."""

    name = "cpu-reference"

    def __init__(self) -> None:
        self.calls: list[OpCall] = []

    def _record(self, op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> OpCall:
        call = OpCall(op, q, k, v, kwargs)
        self.calls.append(call)
        return call

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                  attn_mask: torch.Tensor | None, scale: float, op_type: str, layout: str) -> torch.Tensor:
        call = self._record("attention", query, key, value, attn_mask=attn_mask, scale=scale, op_type=op_type,
                            layout=layout)
        if op_type not in OP_TYPES or layout not in LAYOUTS:
            raise ValueError(f"attention_forward: unknown op_type {op_type!r} or layout {layout!r}")
        if query.dim() != 4 or key.shape[:2] != value.shape[:2] or query.shape[2] != key.shape[2]:
            raise ValueError(f"attention_forward takes BSND tensors with equal heads, got {tuple(query.shape)}, "
                             f"{tuple(key.shape)}, {tuple(value.shape)}")
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            raise ValueError(f"attn_mask must be boolean (True = attend), got {attn_mask.dtype}")
        call.output = _sdpa_bsnd(query, key, value, attn_mask, scale)
        return call.output

    def varlen_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                         cu_seqlens_q: list[int], cu_seqlens_k: list[int], max_seqlen_q: int, max_seqlen_k: int,
                         scale: float) -> torch.Tensor:
        call = self._record("varlen_attention", query, key, value, cu_seqlens_q=cu_seqlens_q,
                            cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                            scale=scale)
        if query.dim() != 3 or key.dim() != 3 or query.shape[1] != key.shape[1]:
            raise ValueError(f"attention_forward_varlen takes TND tensors with equal heads, got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}")
        if not (isinstance(cu_seqlens_q, list) and isinstance(cu_seqlens_k, list)) or any(
                type(x) is not int for x in (*cu_seqlens_q, *cu_seqlens_k)):
            raise TypeError("cu_seqlens must be host lists of ints")
        if len(cu_seqlens_q) != len(cu_seqlens_k) or cu_seqlens_q[0] != 0 or cu_seqlens_k[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0 and pair up, got {cu_seqlens_q}, {cu_seqlens_k}")
        if cu_seqlens_q[-1] != query.shape[0] or cu_seqlens_k[-1] != key.shape[0]:
            raise ValueError(f"cu_seqlens end at {cu_seqlens_q[-1]}/{cu_seqlens_k[-1]}, tensors hold "
                             f"{query.shape[0]}/{key.shape[0]} rows")
        out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
        for i in range(len(cu_seqlens_q) - 1):
            qs, qe, ks, ke = cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]
            if qe > qs and ke > ks:
                out[qs:qe] = _sdpa_bsnd(query[None, qs:qe], key[None, ks:ke], value[None, ks:ke], None, scale)[0]
        call.output = out
        return out

    def sparse_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, plan: Any,
                         scale: float) -> torch.Tensor:
        call = self._record("sparse_attention", query, key, value, plan=plan, scale=scale)
        rows = query.shape[1]
        if query.dim() != 4 or query.shape[0] != 1 or rows != plan.used_len or key.shape[1] != rows:
            raise ValueError(f"sparse_attention(rf_v2) takes [1, used_len={plan.used_len}, N, D] BSND tensors, "
                             f"got {tuple(query.shape)}, {tuple(key.shape)}")
        call.output = _sdpa_bsnd(query, key, value, block_sparse_mask(query, key, plan, scale), scale)
        return call.output


def block_sparse_mask(query: torch.Tensor, key: torch.Tensor, plan: Any, scale: float) -> torch.Tensor | None:
    """``[1, N, S, S]`` bool of the stand-in's block selection (``None`` = dense, with ``sparsity = 0``)."""
    from .rainfusion import keep_count

    blocks, size = plan.sparse_blocks, plan.block_size
    keep = keep_count(blocks, plan.sparsity)
    if blocks == 0 or keep >= blocks:
        return None
    start = plan.prefix_len
    stop = start + blocks * size
    heads, rows = query.shape[2], query.shape[1]
    qb = query[0, start:stop].float().reshape(blocks, size, heads, -1).mean(1)  # [blocks, N, D]
    kb = key[0, start:stop].float().reshape(blocks, size, heads, -1).mean(1)
    scores = torch.einsum("qnd,knd->nqk", qb, kb) * scale  # [N, q blocks, k blocks]
    chosen = scores.topk(keep, dim=-1).indices
    block_keep = torch.zeros(heads, blocks, blocks, dtype=torch.bool)
    block_keep.scatter_(-1, chosen, True)
    mask = torch.ones(heads, rows, rows, dtype=torch.bool)
    mask[:, start:stop, start:stop] = block_keep.repeat_interleave(size, 1).repeat_interleave(size, 2)
    return mask[None]
