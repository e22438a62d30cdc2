"""Element-wise kernels (Triton): partial rotate-half RoPE and SwiGLU, computed in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._triton import next_pow2


# ---------------------------------------------------------------------------------------------- RoPE (rotate-half)
@triton.jit
def _rope_kernel(X, COS, SIN, Y, N, A1, A2, D, R,
                 sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3,
                 HAS_TAIL: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = (row < N)[:, None]
    i2 = (row % A2)[:, None]
    i1 = ((row // A2) % A1)[:, None]
    i0 = (row // (A2 * A1))[:, None]
    xrow = X + i0 * sx0 + i1 * sx1 + i2 * sx2
    crow = COS + i0 * sc0 + i1 * sc1 + i2 * sc2
    srow = SIN + i0 * ss0 + i1 * ss1 + i2 * ss2
    yrow = Y + row[:, None] * D
    half = R // 2
    offs = tl.arange(0, BLOCK_H)[None, :]
    mask = rmask & (offs < half)
    x1 = tl.load(xrow + offs * sx3, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xrow + (offs + half) * sx3, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(crow + offs * sc3, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(crow + (offs + half) * sc3, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(srow + offs * ss3, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(srow + (offs + half) * ss3, mask=mask, other=0.0).to(tl.float32)
    tl.store(yrow + offs, (x1 * c1 - x2 * s1).to(Y.dtype.element_ty), mask=mask)
    tl.store(yrow + half + offs, (x2 * c2 + x1 * s2).to(Y.dtype.element_ty), mask=mask)
    if HAS_TAIL:
        tail = R + tl.arange(0, BLOCK_T)[None, :]
        tmask = rmask & (tail < D)
        tl.store(yrow + tail, tl.load(xrow + tail * sx3, mask=tmask, other=0.0), mask=tmask)


def as4d(shape: torch.Size) -> tuple[int, ...]:
    return (1,) * (4 - len(shape)) + tuple(shape)


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot, d = cos.shape[-1], x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not out.numel():
        return out
    x4 = x.reshape(as4d(x.shape)) if x.dim() < 4 else x
    lead = x4.shape[:3]
    c4, s4 = (t.reshape(as4d(t.shape)).expand(*lead, rot) for t in (cos, sin))
    n = lead[0] * lead[1] * lead[2]
    rows = max(1, min(64, 2048 // next_pow2(d)))
    _rope_kernel[(triton.cdiv(n, rows),)](
        x4, c4, s4, out, n, lead[1], lead[2], d, rot, *x4.stride(), *c4.stride(), *s4.stride(), HAS_TAIL=d > rot,
        ROWS=rows, BLOCK_H=next_pow2(rot // 2), BLOCK_T=next_pow2(max(1, d - rot)))
    return out


# ---------------------------------------------------------------------------------------------- SwiGLU
@triton.jit
def _swiglu_kernel(G, U, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf * tl.sigmoid(gf)).to(g.dtype).to(tl.float32)  # the reference rounds silu(gate) to gate's dtype
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (act * u).to(Y.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    n = out.numel()
    if n:
        block = 1024
        _swiglu_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block)
    return out
