"""Attention backends of the ``npu`` platform, each with the reference signature
``fn(q, k, v, *, metadata=None, attn_mask=None, scale=None, causal=False)`` (``omnicore.plugin.sdpa_attention``).

Dispatch (docs/contracts-status.md C3.3, with the backend chosen by name instead of an environment variable):

1. **Packed call** (``metadata`` given — omnicore's form of the ``npu_attn_varlen`` opt-in): resolve the layout on
   the host (:func:`omni_backends_npu.resolve.resolve_packed_sequence`). When it resolves,
   :func:`npu_varlen_attention` runs the TND varlen op and :func:`npu_laser_attention` the prefix-K/V-slice
   laser path; that result is returned directly.
   omnicore extension: ``npu_varlen`` hands the varlen op the metadata's real documents as they are when the
   layout does not resolve but is non-causal (several real documents — the offsets are host ints), so only causal
   calls reach step 2 on that backend.
2. Otherwise the mask is rebuilt from the metadata: each document's queries see that document's keys below
   ``valid_kv_length``; queries in padding rows see every real key (their outputs are never consumed). For the
   seed's one-real-document layout this is exactly ``arange(S) < used`` broadcast over the batch. A
   ``valid_kv_length`` that is not a Python int in ``(0, S]`` is refused (``ValueError``): no unmasked attention over
   padding rows, ever.
3. **Masked path**: MindIE-SD attention with op type ``fused_attn_score``. Dense calls (models that do not pack)
   take only this path: one op call, its output returned unchanged.

Every kernel call goes through the op seam (:mod:`omni_backends_npu.seam`); nothing here reads a device tensor on
the host. K/V heads are repeated for grouped-query attention before the op is called.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from omnicore.plugin import check_packed, packed_views

from .resolve import check_valid_kv_length, laser_scale_factor, resolve_metadata
from .seam import LASER_OP_TYPE, MASKED_OP_TYPE, current_ops

logger = logging.getLogger("omni_backends_npu")
_ANNOUNCED: set[tuple[Any, ...]] = set()

#: the op-internal layout the laser kernel supports (inputs stay BSND); the masked path uses it too
OP_LAYOUT = "BNSD"


# ---------------------------------------------------------------------------------------------- shape checks
def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads == 0 or heads % kv_heads or v.shape[-2] != kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads}, "
                         f"v has {v.shape[-2]})")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat K/V heads to the query heads (grouped-query attention); a no-op when they match."""
    groups = q.shape[-2] // k.shape[-2]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=-2), v.repeat_interleave(groups, dim=-2)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _check_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any) -> None:
    check_packed(q, k, v, metadata, documents=False)  # empty documents: refused by the varlen path only
    if metadata.has_spans:
        raise ValueError("the npu attention backends do not implement bidirectional spans (declare spans=False)")


# ---------------------------------------------------------------------------------------------- masks
def causal_mask(lq: int, lk: int, device: Any) -> torch.Tensor:
    """``[lq, lk]`` bool: query ``i`` sits at key position ``lk - lq + i`` and sees keys at or before it."""
    pos = torch.arange(lk - lq, lk, device=device)
    return torch.arange(lk, device=device)[None, :] <= pos[:, None]


def packed_mask(metadata: Any, rows_q: int, rows_k: int, *, causal: bool, device: Any) -> torch.Tensor:
    """The mask of a packed call rebuilt from its host-int metadata, ``[1, 1, rows_q, rows_k]`` bool (True =
    attend); see the module docstring, step 2. Refuses an unusable ``valid_kv_length``."""
    valid = check_valid_kv_length(getattr(metadata, "valid_kv_length", None), rows_k)
    cu_q, cu_k = metadata.cu_seqlens_q, metadata.cu_k
    real_end = cu_k[-1] if valid is None else min(valid, cu_k[-1])
    mask = torch.zeros(rows_q, rows_k, dtype=torch.bool, device=device)
    real_docs = []
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if qe == qs:
            continue
        if ks >= real_end:  # a padding document: see below
            continue
        kv_end = min(ke, real_end)
        block = causal_mask(qe - qs, ke - ks, device)[:, : kv_end - ks] if causal else True
        mask[qs:qe, ks:kv_end] = block
        real_docs.append((qs, qe))
    # padding query rows (padding documents, rows past cu_q[-1]) see every real key: finite, never consumed
    covered = torch.zeros(rows_q, dtype=torch.bool, device=device)
    for qs, qe in real_docs:
        covered[qs:qe] = True
    if real_end > 0:
        mask[~covered, :real_end] = True
    return mask[None, None]


# ---------------------------------------------------------------------------------------------- the paths
def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """BSND tensors, one MindIE-SD ``fused_attn_score`` call, its output returned unchanged."""
    k, v = _expand_kv(q, k, v)
    return current_ops().attention(q, k, v, attn_mask=attn_mask, scale=scale, op_type=MASKED_OP_TYPE,
                                   layout=OP_LAYOUT)


def varlen_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: tuple[list[int], list[int]],
                scale: float) -> torch.Tensor:
    """TND ``[T, N, D]`` tensors (batch dim already dropped) -> MindIE-SD varlen with host lists
    ``[0, *seq_q]``, ``[0, *seq_k]`` and the softmax scale. Never reads or builds a mask."""
    seq_q, seq_k = seqs
    cu_q, cu_k = [0, *seq_q], [0, *seq_k]
    k, v = _expand_kv(q, k, v)
    return current_ops().varlen_attention(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:])),
        max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:])), scale=scale)


def laser_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: tuple[list[int], list[int]],
               scale: float, input_scale: Any = None) -> torch.Tensor:
    """On BSND ``[1, S, N, D]`` tensors: K/V become the zero-copy views ``[:, :used_k]`` (dropping a strict
    suffix padding document is numerically identical to masking it), Q keeps its full length, no mask, op-internal
    layout BNSD; with a laser input scale ``f`` the inputs are divided by ``f``, the kernel scale multiplied by
    ``f**2`` and the output multiplied by ``f``."""
    used_k = seqs[1][0]
    k, v = k[:, :used_k], v[:, :used_k]
    k, v = _expand_kv(q, k, v)
    f = laser_scale_factor(input_scale)
    if f is not None:
        q, k, v = q / f, k / f, v / f
        scale = scale * f * f
    out = current_ops().attention(q, k, v, attn_mask=None, scale=scale, op_type=LASER_OP_TYPE, layout=OP_LAYOUT)
    return out * f if f is not None else out


def real_documents(metadata: Any, rows_k: int) -> tuple[list[int], list[int]]:
    """The documents of a packed call the varlen op can take as they are (host ints): every document whose keys
    start below ``valid_kv_length`` (all of them without it), keys clipped there. Trailing padding documents are
    left out (their rows come back as zeros). Refuses an unusable ``valid_kv_length`` like the mask rebuild."""
    valid = check_valid_kv_length(getattr(metadata, "valid_kv_length", None), rows_k)
    cu_q, cu_k = metadata.cu_seqlens_q, metadata.cu_k
    end = cu_k[-1] if valid is None else min(valid, cu_k[-1])
    docs = sum(1 for start in cu_k[:-1] if start < end)
    return list(cu_q[: docs + 1]), [min(x, end) for x in cu_k[: docs + 1]]


def documents_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any,
                     scale: float) -> torch.Tensor:
    """omnicore's extension of the varlen path for layouts the packed resolution does not resolve (several real
    documents: LingBot's batch CFG, a MiniMax-H3 batch): the offsets are host ints, so the varlen op takes the real
    documents directly — still no mask — instead of the quadratic masked fallback. Non-causal calls only."""
    cu_q, cu_k = real_documents(metadata, k.shape[0])
    for i in range(len(cu_q) - 1):
        if cu_q[i + 1] > cu_q[i] and cu_k[i + 1] == cu_k[i]:
            raise ValueError(f"document {i} has {cu_q[i + 1] - cu_q[i]} queries but no keys")
    rows = cu_q[-1]
    out = varlen_path(q[:rows], k[: cu_k[-1]], v[: cu_k[-1]], (cu_q[1:], cu_k[1:]), scale)
    if rows < q.shape[0]:
        out = torch.cat([out, out.new_zeros(q.shape[0] - rows, *out.shape[1:])], dim=0)
    return out


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
           scale: float | None, causal: bool) -> torch.Tensor:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"dense attention expects q, k, v as [B, S, H, D], got shape {tuple(q.shape)}")
    _check_heads(q, k, v)
    if causal:
        mask = causal_mask(q.shape[1], k.shape[1], q.device)
        attn_mask = mask if attn_mask is None else attn_mask & mask
    return masked_attention(q, k, v, attn_mask, _scale(q, scale))


def _packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any, attn_mask: Any, scale: float | None,
            causal: bool, path: str, input_scale: Any = None) -> torch.Tensor:
    if attn_mask is not None:
        raise ValueError("packed attention takes no attn_mask: the metadata's documents already isolate rows")
    _check_heads(q, k, v)
    batched, q, k, v = packed_views(q, k, v)
    _check_packed(q, k, v, metadata)
    softmax_scale = _scale(q, scale)
    causal = causal or bool(metadata.causal)
    seqs = resolve_metadata(metadata, causal=causal)
    out = None
    if seqs is not None and seqs[0][-1] == q.shape[0] and seqs[1][-1] == k.shape[0]:
        if path == "laser":
            out = laser_path(q[None], k[None], v[None], seqs, softmax_scale, input_scale)[0]
        else:
            out = varlen_path(q, k, v, seqs, softmax_scale)
    elif path == "varlen" and not causal:
        out = documents_varlen(q, k, v, metadata, softmax_scale)
    if out is None:
        mask = packed_mask(metadata, q.shape[0], k.shape[0], causal=causal, device=q.device)
        out = masked_attention(q[None], k[None], v[None], mask, softmax_scale)[0]
    return out[None] if batched else out


# ---------------------------------------------------------------------------------------------- backends
def npu_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, metadata: Any = None,
                         attn_mask: torch.Tensor | None = None, scale: float | None = None,
                         causal: bool = False) -> torch.Tensor:
    """``npu_varlen``: packed ``[real | pad]`` calls through the TND varlen op, other non-causal packed
    calls through the same op with their real documents, causal packed and dense calls masked."""
    if metadata is None:
        return _dense(q, k, v, attn_mask, scale, causal)
    return _packed(q, k, v, metadata, attn_mask, scale, causal, "varlen")


def npu_laser_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, metadata: Any = None,
                        attn_mask: torch.Tensor | None = None, scale: float | None = None, causal: bool = False,
                        laser_input_scale: Any = None) -> torch.Tensor:
    """``npu_laser``: packed ``[real | pad]`` calls through the prefix-K/V-slice laser path, everything else
    masked. ``laser_input_scale`` (or the metadata's attribute of that name, when a model publishes one) is the
    fp16-workspace pre-scaling factor ``f`` (MiniMax-H3 documents 256)."""
    if metadata is None:
        return _dense(q, k, v, attn_mask, scale, causal)
    if laser_input_scale is None:
        laser_input_scale = getattr(metadata, "laser_input_scale", None)
    return _packed(q, k, v, metadata, attn_mask, scale, causal, "laser", laser_input_scale)


def npu_rainfusion_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, metadata: Any = None,
                             attn_mask: torch.Tensor | None = None, scale: float | None = None,
                             causal: bool = False) -> torch.Tensor:
    """``npu_rainfusion``: a packed call carrying a :class:`~omni_backends_npu.rainfusion.RainFusionPlan` runs the
    rf_v2 block-sparse op over the plan's ``used_len`` rows (padding rows are never handed over; their outputs are
    zeros); every other call — no plan (warm-up step, exempt layer, no grid), a video too short for block
    selection, causal — is :func:`npu_varlen_attention`."""
    from .rainfusion import RainFusionPlan, real_rows

    plan = getattr(metadata, "sparse_plan", None)
    if (not isinstance(plan, RainFusionPlan) or not plan.selects_blocks or causal or metadata.causal
            or attn_mask is not None):
        return npu_varlen_attention(q, k, v, metadata=metadata, attn_mask=attn_mask, scale=scale, causal=causal)
    _check_heads(q, k, v)
    batched, q, k, v = packed_views(q, k, v)
    _check_packed(q, k, v, metadata)
    used, rows = plan.used_len, q.shape[0]
    if real_rows(metadata) != used:
        raise ValueError(f"the RainFusion plan covers {used} rows (prefix {plan.prefix_len} + video "
                         f"{plan.video_rows}) but the metadata's real document has {real_rows(metadata)}")
    key = (plan.prefix_len, plan.latent_shape, plan.sparsity)
    if key not in _ANNOUNCED:  # activation log: sparsity, grid, prefix and video rows, once per layout
        _ANNOUNCED.add(key)
        logger.info(plan.describe())
    k, v = _expand_kv(q, k, v)
    q, k, v = q[:used], k[:used], v[:used]
    if plan.video_first:  # [video | rest] -> the kernel's [prefix | video]; rotated back below (exact)
        q, k, v = (torch.cat([t[plan.video_rows:], t[:plan.video_rows]]) for t in (q, k, v))
    out = current_ops().sparse_attention(q[None], k[None], v[None], plan=plan, scale=_scale(q, scale))[0]
    if plan.video_first:
        out = torch.cat([out[plan.prefix_len:], out[:plan.prefix_len]])
    if used < rows:
        out = torch.cat([out, out.new_zeros(rows - used, *out.shape[1:])], dim=0)
    return out[None] if batched else out


def _attach_planner() -> None:
    from .rainfusion import sparse_planner

    # how a model recognises a plan-executing backend and builds its planner (see omni_backends_npu.rainfusion)
    npu_rainfusion_attention.sparse_planner = sparse_planner  # type: ignore[attr-defined]


_attach_planner()
