"""Fused 2x nearest upsample + 3x3 conv (Triton): a sub-pixel implicit GEMM that never builds the 2x image.

A 3x3 kernel (padding 1) over the 2x nearest-upsampled image is, for each output phase ``(a, b)`` (row and
column parity), a 2x2 kernel over the source image: output row ``2i`` reads source rows ``i-1, i`` with taps
``w0 | w1 + w2`` and output row ``2i+1`` reads rows ``i, i+1`` with taps ``w0 + w1 | w2`` (columns alike). One
program computes a block of source pixels ``(i, j)`` of one phase for a block of output channels: the sum over
input channels and the four taps is a ``[pixels, C] x [C, Cout]`` matrix product per tap (``tl.dot``), 16
instead of 36 multiply-adds per output pixel and channel pair. The folded weights are built once per weight
tensor (cached until the tensor changes; :func:`clear_folded_weights` drops them) in fp32 and kept in fp32.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import triton
import triton.language as tl

_CACHE: dict[int, tuple[Any, tuple[Any, ...], torch.Tensor]] = {}
_LOCK = threading.Lock()


def fold_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[Cout, C, 3, 3]`` -> fp32 ``[2 (a), 2 (b), 2 (dy), 2 (dx), C, Cout]``: the 2x2 kernel of every output
    phase, laid out for the kernel's ``[C, Cout]`` tiles."""
    w = weight.float()
    rows = (torch.stack([w[:, :, 0], w[:, :, 1] + w[:, :, 2]], dim=2),  # a = 0: source rows i-1, i
            torch.stack([w[:, :, 0] + w[:, :, 1], w[:, :, 2]], dim=2))  # a = 1: source rows i, i+1
    phases = []
    for r in rows:  # [Cout, C, 2 (dy), 3 (cols)]
        cols = (torch.stack([r[..., 0], r[..., 1] + r[..., 2]], dim=3),  # b = 0: source cols j-1, j
                torch.stack([r[..., 0] + r[..., 1], r[..., 2]], dim=3))  # b = 1: cols j, j+1
        phases.append(torch.stack(cols, dim=0))  # [2 (b), Cout, C, dy, dx]
    folded = torch.stack(phases, dim=0)  # [a, b, Cout, C, dy, dx]
    return folded.permute(0, 1, 4, 5, 3, 2).contiguous()


def folded_weight(weight: torch.Tensor) -> torch.Tensor:
    """The cached :func:`fold_weight` of ``weight`` (rebuilt when its storage or version counter changes)."""
    key = id(weight)
    stamp = (weight._version, weight.data_ptr(), weight.device)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0]() is weight and hit[1] == stamp:
            return hit[2]
    folded = fold_weight(weight)
    def forget(_ref: Any, k: int = key) -> None:
        _CACHE.pop(k, None)

    with _LOCK:
        _CACHE[key] = (weakref.ref(weight, forget), stamp, folded)
    return folded


def clear_folded_weights() -> int:
    """Drop every cached folded weight (rebuilt on the next call); returns how many were held."""
    with _LOCK:
        n = len(_CACHE)
        _CACHE.clear()
    return n


@triton.jit
def _upsample2x_conv_kernel(X, WF, B, Y, C, H, W, COUT, sxn, sxc, sxh, sxw, syn, syc, syh, syw,
                            HAS_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                            BLOCK_O: tl.constexpr):
    pid = tl.program_id(0)
    tiles = tl.cdiv(H * W, BLOCK_P)
    n = (pid // (4 * tiles)).to(tl.int64)
    phase = (pid // tiles) % 4
    a = phase // 2
    b = phase % 2
    pix = (pid % tiles) * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = pix < H * W
    i = pix // W
    j = pix % W
    outs = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    omask = outs < COUT
    acc = tl.zeros([BLOCK_P, BLOCK_O], dtype=tl.float32)
    chans = tl.arange(0, BLOCK_C)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + chans
        cmask = c < C
        for tap in range(4):
            dy = tap // 2
            dx = tap % 2
            yy = i + a - 1 + dy
            xx = j + b - 1 + dx
            inside = pmask & (yy >= 0) & (yy < H) & (xx >= 0) & (xx < W)
            xt = tl.load(X + n * sxn + c[None, :] * sxc + yy[:, None] * sxh + xx[:, None] * sxw,
                         mask=inside[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            wbase = WF + ((((a * 2 + b) * 2 + dy) * 2 + dx) * C).to(tl.int64) * COUT
            wt = tl.load(wbase + c[:, None] * COUT + outs[None, :], mask=cmask[:, None] & omask[None, :],
                         other=0.0)
            acc += tl.dot(xt, wt, input_precision="ieee")
    if HAS_B:
        acc += tl.load(B + outs, mask=omask, other=0.0).to(tl.float32)[None, :]
    ptr = Y + n * syn + outs[None, :] * syc + (2 * i + a)[:, None] * syh + (2 * j + b)[:, None] * syw
    tl.store(ptr, acc.to(Y.dtype.element_ty), mask=pmask[:, None] & omask[None, :])


def upsample2x_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    padding: int = 1) -> torch.Tensor:
    """``conv2d(upsample_nearest_2x(x), weight, bias, padding=1)`` for a 3x3 ``weight`` (inputs
    ``omni_backends_cuda.ops.upsample2x_conv_applies`` accepted); fp32 accumulation, output in x's dtype."""
    n, c, h, w = x.shape
    cout = weight.shape[0]
    out = torch.empty((n, cout, 2 * h, 2 * w), dtype=x.dtype, device=x.device)
    if out.numel():
        wf = folded_weight(weight)
        block_p, block_o = 64, max(16, min(64, triton.next_power_of_2(cout)))
        block_c = max(16, min(32, triton.next_power_of_2(c)))
        grid = (n * 4 * triton.cdiv(h * w, block_p), triton.cdiv(cout, block_o))
        _upsample2x_conv_kernel[grid](
            x, wf, bias if bias is not None else wf, out, c, h, w, cout, *x.stride(), *out.stride(),
            HAS_B=bias is not None, BLOCK_P=block_p, BLOCK_C=block_c, BLOCK_O=block_o)
    return out


__all__ = ["clear_folded_weights", "fold_weight", "folded_weight", "upsample2x_conv"]
