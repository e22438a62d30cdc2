"""Segmented LoRA (Triton, punica-style SGMV): ``delta[rows of s] = (x[rows of s] @ a[s].T) @ b[s].T`` for every
segment ``s`` of a batch, in two kernels — shrink (``x -> t``, rank-wide) and expand (``t -> delta``).

Segment ``s`` is rows ``[seg_ends[s-1], seg_ends[s])`` (segment 0 starts at row 0); segments may be empty, and rows past
the last end get a zero delta. A program owns one row block (and, in expand, one output-column block) and walks
the segments: only those overlapping its rows do work, rows of other segments are masked to zero, so a block that
straddles a segment boundary is right without a per-block segment table (the launch never reads ``seg_ends``
on the host, it only copies the vector to the device: no synchronisation). Ranks are zero-padded by the caller;
the rank tile is padded further to a power of two of at least 16 (``tl.dot``'s minimum) with zeros.

Precision: both products accumulate in fp32. For 16-bit inputs ``t`` is rounded to the input dtype before the
expand (as the eager reference's bmm does) and the dots run on tensor cores; for fp32 they use IEEE fp32 (no
TF32), so fp32 results match the reference to accumulation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import INTERPRET, next_pow2

#: widest rank tile the kernels take (``lora_segment_delta_applies`` refuses larger ranks)
MAX_RANK = 128


@triton.jit
def _seg_bounds(SEG, s):
    """Rows ``[lo, hi)`` of segment ``s``."""
    hi = tl.load(SEG + s).to(tl.int64)
    lo = tl.load(SEG + s - 1, mask=s > 0, other=0).to(tl.int64)
    return lo, hi


@triton.jit
def _shrink_kernel(X, A, T, SEG, N, IN, R, S, K_PER_SPLIT,
                   sxn, sxk, sas, sar, sak,
                   SPLIT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """``T[rows, :R] (+)= X[rows, k-range] @ A[seg(row), :R, k-range].T`` in fp32 (atomic adds when split over K)."""
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    k_begin = tl.program_id(1).to(tl.int64) * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, IN)
    rows = row0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    rmask_r = offs_r < R
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for s in range(0, S):
        lo, hi = _seg_bounds(SEG, s)
        lo = tl.maximum(lo, row0)
        hi = tl.minimum(tl.minimum(hi, row0 + BLOCK_M), N)
        if lo < hi:
            in_seg = (rows >= lo) & (rows < hi)
            for k0 in range(k_begin, k_end, BLOCK_K):
                ks = k0 + offs_k
                kmask = ks < k_end
                x = tl.load(X + rows[:, None] * sxn + ks[None, :] * sxk, mask=in_seg[:, None] & kmask[None, :],
                            other=0.0)
                a = tl.load(A + s * sas + offs_r[None, :] * sar + ks[:, None] * sak,
                            mask=rmask_r[None, :] & kmask[:, None], other=0.0)
                if UPCAST:
                    x = x.to(tl.float32)
                    a = a.to(tl.float32)
                else:
                    a = a.to(x.dtype)
                acc += tl.dot(x, a, input_precision=PRECISION)
    mask = (rows < N)[:, None] & rmask_r[None, :]
    ptrs = T + rows[:, None] * BLOCK_R + offs_r[None, :]
    if SPLIT:
        tl.atomic_add(ptrs, acc, mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def _expand_kernel(T, B, Y, SEG, N, OUT, R, S,
                   sbs, sbo, sbr, syn, syo,
                   ROUND_T: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """``Y[rows, cols] = T[rows, :R] @ B[seg(row), cols, :R].T``; rows in no segment get 0."""
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = row0 + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    rmask_r = offs_r < R
    cmask = cols < OUT
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(0, S):
        lo, hi = _seg_bounds(SEG, s)
        lo = tl.maximum(lo, row0)
        hi = tl.minimum(tl.minimum(hi, row0 + BLOCK_M), N)
        if lo < hi:
            in_seg = (rows >= lo) & (rows < hi)
            t = tl.load(T + rows[:, None] * BLOCK_R + offs_r[None, :], mask=in_seg[:, None] & rmask_r[None, :],
                        other=0.0)
            b = tl.load(B + s * sbs + cols[None, :] * sbo + offs_r[:, None] * sbr,
                        mask=cmask[None, :] & rmask_r[:, None], other=0.0)
            if ROUND_T:  # the reference's first bmm rounds t to the input dtype
                t = t.to(Y.dtype.element_ty)
            if UPCAST:
                t = t.to(tl.float32)
                b = b.to(tl.float32)
            else:
                b = b.to(t.dtype)
            acc += tl.dot(t, b, input_precision=PRECISION)
    tl.store(Y + rows[:, None] * syn + cols[None, :] * syo, acc.to(Y.dtype.element_ty),
             mask=(rows < N)[:, None] & cmask[None, :])


def _split_k(row_blocks: int, k_blocks: int) -> int:
    """How many K ranges the shrink is cut into: enough programs to fill a GPU (~256) when the batch has few
    row blocks, never more than there are K blocks."""
    if row_blocks >= 128:
        return 1
    return max(1, min(k_blocks, 256 // max(1, row_blocks)))


def lora_segment_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_ends: torch.Tensor) -> torch.Tensor:
    """The ``(N, out)`` LoRA delta of ``x (N, in)`` with per-segment ``a (S, R, in)`` and ``b (S, out, R)`` (scales
    already folded into ``b``; one dtype for all three, the result's), the platform op ``lora_segment_delta``
    (see the module docstring)."""
    n, d_in = x.shape
    s_count, rank, _ = a.shape
    d_out = b.shape[1]
    out = torch.empty((n, d_out), dtype=x.dtype, device=x.device)
    if n == 0 or d_out == 0:
        return out
    if s_count == 0 or rank == 0 or d_in == 0:
        return out.zero_()
    block_r = max(16, next_pow2(rank))
    block_m = 16 if n <= 16 else (32 if n <= 64 else 64)
    block_k = 64 if d_in >= 64 else max(16, next_pow2(d_in))
    row_blocks = triton.cdiv(n, block_m)
    k_blocks = triton.cdiv(d_in, block_k)
    split = _split_k(row_blocks, k_blocks)
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    split = triton.cdiv(d_in, k_per_split)
    sixteen = x.dtype in (torch.float16, torch.bfloat16)
    precision = "ieee" if not sixteen else "tf32"  # "tf32" is ignored by 16-bit dots; fp32 stays exact
    upcast = INTERPRET  # the interpreter computes dots in numpy, which has no bf16
    seg = seg_ends.to(device=x.device, dtype=torch.int64, non_blocking=True)  # the caller's host vector
    t = (torch.zeros if split > 1 else torch.empty)((n, block_r), dtype=torch.float32, device=x.device)
    _shrink_kernel[(row_blocks, split)](
        x, a, t, seg, n, d_in, rank, s_count, k_per_split, *x.stride(), *a.stride(),
        SPLIT=split > 1, UPCAST=upcast, PRECISION=precision, BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_R=block_r)
    block_n = 64 if d_out >= 64 else max(16, next_pow2(d_out))
    _expand_kernel[(row_blocks, triton.cdiv(d_out, block_n))](
        t, b, out, seg, n, d_out, rank, s_count, *b.stride(), *out.stride(),
        ROUND_T=sixteen, UPCAST=upcast, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r)
    return out


__all__ = ["MAX_RANK", "lora_segment_delta"]
