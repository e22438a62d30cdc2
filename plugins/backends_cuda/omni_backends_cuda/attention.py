"""Attention backends of the ``cuda`` platform, each with the reference signature
``fn(q, k, v, *, metadata=None, attn_mask=None, scale=None, causal=False)`` (``omnicore.plugin.sdpa_attention``).

- :func:`triton_varlen_attention`: our Triton kernel; packed documents from host-int metadata, GQA, causal,
  ``[real | pad]`` packing (``valid_kv_length``) without a mask; dense batches through the same kernel.
- :func:`cuda_sdpa_attention`: torch's fused SDPA for dense calls (flash / memory-efficient kernels on CUDA).
- :func:`flash_varlen_attention`: ``flash_attn_varlen_func`` (the optional ``flash-attn`` package).

None of them reads a device tensor on the host: document lengths are the metadata's Python ints and device copies
of ``cu_seqlens`` are cached (on the metadata record, or per layout here for ``valid_kv_length`` clipping).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from omnicore.plugin import check_packed, packed_views

from ._triton import kernel_dtype, on_kernel_device


# ---------------------------------------------------------------------------------------------- shared checks
def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads == 0 or heads % kv_heads or v.shape[-2] != kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads}, "
                         f"v has {v.shape[-2]})")
    if k.shape[-1] != q.shape[-1] or v.shape[-1] != q.shape[-1]:
        raise ValueError(f"q, k, v head dims differ: {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")


def _last_dim_contiguous(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _longest(cu: tuple[int, ...]) -> int:
    return max((b - a for a, b in zip(cu, cu[1:])), default=0)


# ---------------------------------------------------------------------------------------------- Triton
def triton_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, metadata: Any = None,
                            attn_mask: torch.Tensor | None = None, scale: float | None = None,
                            causal: bool = False) -> torch.Tensor:
    """Triton packed-varlen (and dense) attention; see the module docstring."""
    from .kernels.attention import dense_forward, varlen_forward

    if not on_kernel_device(q, k, v):
        raise ValueError(f"the Triton attention kernel runs on CUDA tensors, got {q.device}")
    if not kernel_dtype(q, k, v):
        raise ValueError(f"the Triton attention kernel takes fp16/fp32 (bf16 from compute capability 8.0), got "
                         f"{q.dtype} on {q.device}")
    _heads(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if metadata is None:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"dense attention expects q, k, v as [B, S, H, D], got shape {tuple(q.shape)}")
        if attn_mask is not None:  # arbitrary masks are torch's job; the result is the same
            return _sdpa(q, k, v, attn_mask, scale, causal)
        q, k, v = _last_dim_contiguous(q, k, v)
        return dense_forward(q, k, v, scale=scale, causal=causal)
    if attn_mask is not None:
        raise ValueError("packed attention takes no attn_mask: the metadata's documents already isolate rows")
    if metadata.has_spans:
        raise ValueError("the Triton varlen kernel does not implement bidirectional spans (declares spans=False)")
    batched, q, k, v = packed_views(q, k, v)
    check_packed(q, k, v, metadata)
    q, k, v = _last_dim_contiguous(q, k, v)
    cu_q = metadata.cu_seqlens_q
    valid = metadata.valid_kv_length if metadata.valid_kv_length is not None else metadata.total_k
    out = varlen_forward(q, k, v, metadata.cu_seqlens_q_tensor(q.device), metadata.cu_seqlens_k_tensor(q.device),
                         docs=metadata.num_docs, max_q=_longest(cu_q), valid_kv=valid, scale=scale,
                         causal=causal or metadata.causal, zero_fill=cu_q[-1] < q.shape[0])
    return out[None] if batched else out


# ---------------------------------------------------------------------------------------------- torch SDPA
def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, scale: float | None,
          causal: bool) -> torch.Tensor:
    """``[B, S, H, D]`` SDPA with GQA; causal is bottom-right aligned like the reference when ``Sq != Sk``."""
    sq, sk = q.shape[1], k.shape[1]
    if causal and sq != sk:
        pos = torch.arange(sk - sq, sk, device=q.device)
        mask = torch.arange(sk, device=q.device)[None, :] <= pos[:, None]
        attn_mask = mask if attn_mask is None else attn_mask & mask
        causal = False
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, is_causal=causal, scale=scale,
                                         enable_gqa=gqa)
    return out.transpose(1, 2)


def cuda_sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, metadata: Any = None,
                        attn_mask: torch.Tensor | None = None, scale: float | None = None,
                        causal: bool = False) -> torch.Tensor:
    """Dense attention through torch's fused SDPA (declares no packed support: selection never gives it a packed
    call site; a packed call is refused rather than computed wrongly)."""
    if metadata is not None:
        raise ValueError("cuda_sdpa is a dense backend (packed_varlen=False); packed calls need triton_varlen, "
                         "flash_varlen or sdpa")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"dense attention expects q, k, v as [B, S, H, D], got shape {tuple(q.shape)}")
    _heads(q, k, v)
    return _sdpa(q, k, v, attn_mask, scale, causal)


# ---------------------------------------------------------------------------------------------- flash-attn
@functools.lru_cache(maxsize=256)
def _clipped_cu(cu_k: tuple[int, ...], valid: int, device: str) -> torch.Tensor:
    """``cu_seqlens_k`` with every document's keys cut at ``valid`` (one device copy per layout and device)."""
    clipped = [cu_k[0]] + [min(e, max(s, valid)) for s, e in zip(cu_k, cu_k[1:])]
    # keep offsets non-decreasing and absolute: documents past `valid` keep their start, lose their keys
    return torch.tensor(clipped, dtype=torch.int32, device=device)


def flash_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, metadata: Any = None,
                           attn_mask: torch.Tensor | None = None, scale: float | None = None,
                           causal: bool = False) -> torch.Tensor:
    """flash-attn 2: ``flash_attn_varlen_func`` for packed calls, ``flash_attn_func`` for dense ones."""
    import flash_attn

    _heads(q, k, v)
    if metadata is None:
        if q.dim() != 4:
            raise ValueError(f"dense attention expects q as [B, S, H, D], got shape {tuple(q.shape)}")
        if attn_mask is not None:
            return _sdpa(q, k, v, attn_mask, scale, causal)
        # flash-attn's causal mask is bottom-right aligned, like the reference
        return flash_attn.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
    if attn_mask is not None:
        raise ValueError("packed attention takes no attn_mask: the metadata's documents already isolate rows")
    if metadata.has_spans:
        raise ValueError("flash_varlen does not implement bidirectional spans (declares spans=False)")
    batched, q, k, v = packed_views(q, k, v)
    check_packed(q, k, v, metadata)
    cu_k = metadata.cu_seqlens_k_tensor(q.device)
    valid = metadata.valid_kv_length
    if valid is not None and valid < metadata.total_k:
        cu_k = _clipped_cu(metadata.cu_k, valid, str(q.device))
    out = flash_attn.flash_attn_varlen_func(
        q, k, v, metadata.cu_seqlens_q_tensor(q.device), cu_k, _longest(metadata.cu_seqlens_q),
        _longest(metadata.cu_k), softmax_scale=scale, causal=causal or metadata.causal)
    if metadata.total_q < q.shape[0]:  # rows outside every document: zeros, as in the reference
        out[metadata.total_q:] = 0
    return out[None] if batched else out


def flash_attn_importable() -> bool:
    """Whether the optional ``flash-attn`` package is installed (checked without importing it)."""
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None
