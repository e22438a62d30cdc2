"""Packed-varlen attention forward (Triton, flash-attention style online softmax).

One program computes ``BLOCK_M`` query rows of one head of one document. Documents come from ``cu_seqlens``
(device copies cached on the metadata record) or, for dense batches, from uniform lengths passed as ints, so a
call never reads a device value on the host. Keys at or past ``valid_kv`` (``[real | pad]`` packing) are never
loaded; a document left without keys writes zeros. Grouped-query attention maps query head ``h`` to key/value
head ``h // group``. Causal documents are bottom-right aligned (queries are the last positions of the document).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import INTERPRET, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _attn_fwd(Q, K, V, O, CU_Q, CU_K, qk_scale, valid_kv, group, D, LQ, LK,  # noqa: E741 - Q, K, V, O as in the math
              sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
              VARLEN: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    doc = tl.program_id(0)
    start_m = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    if VARLEN:
        qs = tl.load(CU_Q + doc).to(tl.int64)
        qe = tl.load(CU_Q + doc + 1).to(tl.int64)
        ks = tl.load(CU_K + doc).to(tl.int64)
        ke = tl.load(CU_K + doc + 1).to(tl.int64)
        batch = 0
    else:
        qs = tl.zeros([], dtype=tl.int64)
        qe = qs + LQ
        ks = tl.zeros([], dtype=tl.int64)
        ke = ks + LK
        batch = doc.to(tl.int64)
    lq = qe - qs
    if start_m >= lq:
        return
    lk_full = ke - ks
    lk = tl.minimum(ke, tl.maximum(ks, valid_kv)) - ks  # keys past valid_kv are padding
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    dmask = offs_d < D
    mmask = offs_m < lq
    kvh = head // group
    q = tl.load(Q + batch * sqb + (qs + offs_m)[:, None] * sqt + head * sqh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + batch * skb + ks * skt + kvh * skh
    v_base = V + batch * svb + ks * svt + kvh * svh
    pos = lk_full - lq + offs_m  # key position of each query (bottom-right aligned)
    hi = lk
    if CAUSAL:
        hi = tl.maximum(tl.minimum(hi, lk_full - lq + start_m + BLOCK_M), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        nmask = cols < lk
        k = tl.load(k_base + cols[None, :] * skt + offs_d[:, None], mask=nmask[None, :] & dmask[:, None], other=0.0)
        v = tl.load(v_base + cols[:, None] * svt + offs_d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        keep = nmask[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= pos[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: no NaN from -inf - -inf
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + batch * sob + (qs + offs_m)[:, None] * sot + head * soh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def _blocks(d: int) -> tuple[int, int, int]:
    block_d = max(16, next_pow2(d))
    if INTERPRET:
        return 32, 32, block_d  # the interpreter's cost is per program and per op, not per element
    return (128 if block_d <= 64 else 64), (64 if block_d <= 128 else 32), block_d


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, docs: int, max_q: int,
            cu_q: torch.Tensor | None, cu_k: torch.Tensor | None, lq: int, lk: int, valid_kv: int, scale: float,
            causal: bool, strides: tuple[tuple[int, int, int], ...]) -> None:
    heads, kv_heads, d = q.shape[-2], k.shape[-2], q.shape[-1]
    block_m, block_n, block_d = _blocks(d)
    grid = (docs, triton.cdiv(max(max_q, 1), block_m), heads)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _attn_fwd[grid](q, k, v, out, cu_q if cu_q is not None else q, cu_k if cu_k is not None else q,
                    scale * LOG2E, valid_kv, heads // kv_heads, d, lq, lk, *strides[0], *strides[1], *strides[2],
                    *strides[3], VARLEN=cu_q is not None, CAUSAL=causal, UPCAST=INTERPRET, PRECISION=precision,
                    BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                    **({} if INTERPRET else {"num_warps": 4 if block_d <= 64 else 8, "num_stages": 2}))


def varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, *,
                   docs: int, max_q: int, valid_kv: int, scale: float, causal: bool,
                   zero_fill: bool) -> torch.Tensor:
    """``q [T, H, D]``, ``k, v [Tk, Hkv, D]`` (last dim contiguous) -> ``[T, H, D]``."""
    out = (torch.zeros if zero_fill else torch.empty)(q.shape, dtype=q.dtype, device=q.device)
    strides = tuple((0, t.stride(0), t.stride(1)) for t in (q, k, v, out))
    _launch(q, k, v, out, docs=docs, max_q=max_q, cu_q=cu_q, cu_k=cu_k, lq=0, lk=0, valid_kv=valid_kv,
            scale=scale, causal=causal, strides=strides)
    return out


def dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  causal: bool) -> torch.Tensor:
    """``q [B, S, H, D]``, ``k, v [B, Sk, Hkv, D]`` (last dim contiguous) -> ``[B, S, H, D]``."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    strides = tuple((t.stride(0), t.stride(1), t.stride(2)) for t in (q, k, v, out))
    _launch(q, k, v, out, docs=q.shape[0], max_q=q.shape[1], cu_q=None, cu_k=None, lq=q.shape[1], lk=k.shape[1],
            valid_kv=k.shape[1], scale=scale, causal=causal, strides=strides)
    return out
