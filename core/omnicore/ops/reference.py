"""Eager reference implementations of the platform ops (the definition every faster kernel is tested against).

Names and signatures are the contract of the kernel seam (``omnicore.ops``); a backend's kernel for an op takes
the same arguments and returns the same values within its dtype's tolerance. Each function here is also what a
platform runs when no faster implementation is registered or its ``applies`` predicate says no.

Dtypes: unless stated otherwise the result has torch's promoted dtype of the tensor arguments (so fp32
modulation applied to bf16 activations gives fp32, as in the models that keep their residual stream in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NORMS = ("layer", "rms")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMS normalisation over the last dim, computed in fp32 (statistics and weight multiply), cast back to x's
    dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        normed = normed * weight.float()
    return normed.to(x.dtype)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """AdaLN modulation ``x * (1 + scale) + shift`` (broadcasting)."""
    return torch.addcmul(shift, x, 1 + scale)


def gated_residual(residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Gated residual ``residual + gate * update`` (broadcasting)."""
    return torch.addcmul(residual, gate, update)


def gated_residual_norm_modulate(
    residual: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    norm: str = "layer",
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + gate * update`` then ``m = norm(h) * (1 + scale) + shift``; returns ``(h, m)``.

    ``norm="layer"``: LayerNorm over the last dim in fp32 without bias (scaled by ``weight`` when given), cast
    back to ``h``'s dtype; ``norm="rms"``: :func:`rms_norm`. The fused kernels produce both outputs in one pass
    (the next block's residual stream and its modulated input).
    """
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    h = gated_residual(residual, update, gate)
    if norm == "rms":
        normed = rms_norm(h, weight, eps)
    else:
        w = None if weight is None else weight.float()
        normed = F.layer_norm(h.float(), (h.shape[-1],), w, None, eps).to(h.dtype)
    return h, modulate(normed, shift, scale)


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention, on the first ``R = cos.shape[-1]`` dims of ``x [..., D]``.

    ``out[..., :R] = x[..., :R] * cos + rotate_half(x[..., :R]) * sin`` with ``rotate_half(a) = cat(-a2, a1)``
    (``a1, a2`` the two halves); dims ``R..D`` pass through unchanged (partial RoPE). Computed in the promoted
    dtype of ``x`` and ``cos``/``sin``, returned in ``x``'s dtype.
    """
    rot = cos.shape[-1]
    if sin.shape[-1] != rot:
        raise ValueError(f"cos and sin must have the same last dim, got {cos.shape[-1]} and {sin.shape[-1]}")
    if rot % 2 or rot > x.shape[-1] or rot == 0:
        raise ValueError(f"rotary dim R={rot} must be even, > 0 and <= head dim {x.shape[-1]}")
    head, tail = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-head[..., half:], head[..., :half]], dim=-1)
    out = (head * cos + rotated * sin).to(x.dtype)
    return out if tail.shape[-1] == 0 else torch.cat([out, tail], dim=-1)


def group_norm_silu(
    x: torch.Tensor, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """``silu(group_norm(x))`` over channel dim 1 (``x [N, C, ...]``), as in VAE decoder resnet blocks."""
    return F.silu(F.group_norm(x, num_groups, weight, bias, eps))


def rms_norm_silu(
    x: torch.Tensor,
    gamma: torch.Tensor,
    bias: torch.Tensor | float | None,
    eps: float = 1e-12,
    channel_dim: int = 1,
) -> torch.Tensor:
    """Wan-VAE style ``silu(F.normalize(x, dim=channel_dim) * sqrt(C) * gamma + bias)``
    (``C = x.shape[channel_dim]``)."""
    normed = F.normalize(x, dim=channel_dim, eps=eps) * (x.shape[channel_dim] ** 0.5) * gamma
    if bias is not None:
        normed = normed + bias
    return F.silu(normed)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return F.silu(gate) * up


def upsample2x_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    padding: int = 1) -> torch.Tensor:
    """A 2x nearest upsample of ``x [N, C, H, W]`` followed by ``conv2d(weight, bias, stride 1, padding)``, as in
    VAE decoder up-blocks (diffusers' Wan ``upsample2d``/``upsample3d`` resample: ``nearest-exact`` at scale 2
    picks the same source pixels as ``nearest``). Fused kernels compute it without materialising the upsampled
    image (a 3x3 kernel over the 2x image is a 2x2 kernel per output phase over the original one)."""
    up = F.interpolate(x, scale_factor=2.0, mode="nearest")
    return F.conv2d(up, weight, bias, padding=padding)


def lora_segment_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_ends: torch.Tensor) -> torch.Tensor:
    """The LoRA deltas of a batch whose rows use different adapters (grouped, punica-style "SGMV").

    ``x [N, in]`` rows; ``a [S, R, in]`` and ``b [S, out, R]`` one slot per segment (the adapter's ``lora_A`` and
    ``lora_B``, every scale already folded into ``b``; smaller ranks zero-padded to ``R``; several adapters on one
    request are their ranks concatenated, which is exact); ``seg_ends [S]`` int64 cumulative row ends on the host:
    segment ``s`` covers rows ``[seg_ends[s-1], seg_ends[s])`` (``seg_ends[-1] == N``; a row without adapters sits
    in a segment whose slot is zero). Returns ``delta [N, out]`` = ``(x_s a_s^T) b_s^T`` per segment, in ``x``'s
    dtype (accumulated in the promoted dtype of ``x`` and the slots).

    Equal-length segments run as one batched matmul pair; unequal ones (packed sequences) one pair per segment.
    """
    if x.dim() != 2 or a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"lora_segment_delta takes x [N, in], a [S, R, in], b [S, out, R]; got "
                         f"{tuple(x.shape)}, {tuple(a.shape)}, {tuple(b.shape)}")
    n, s = x.shape[0], a.shape[0]
    if b.shape[0] != s or b.shape[2] != a.shape[1] or a.shape[2] != x.shape[1] or seg_ends.shape != (s,):
        raise ValueError(f"lora_segment_delta shapes disagree: x {tuple(x.shape)}, a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, seg_ends {tuple(seg_ends.shape)}")
    ends = [int(e) for e in seg_ends.tolist()]
    if s == 0 or ends[-1] != n or any(e1 < e0 for e0, e1 in zip([0, *ends], ends)):
        raise ValueError(f"seg_ends must be non-decreasing row ends ending at N={n}, got {ends}")
    dtype, out_dtype = torch.promote_types(x.dtype, a.dtype), x.dtype
    if x.dtype != dtype:  # (no-op conversions skipped: this runs once per adapted linear per forward)
        x = x.to(dtype)
    if a.dtype != dtype or b.dtype != dtype:
        a, b = a.to(dtype), b.to(dtype)
    if s == 1:  # the whole batch in one segment: two plain matmuls
        out = (x @ a[0].t()) @ b[0].t()
        return out if out_dtype == dtype else out.to(out_dtype)
    lengths = [e1 - e0 for e0, e1 in zip([0, *ends], ends)]
    if len(set(lengths)) == 1:  # one bmm pair over [S, L, in]
        xs = x.reshape(s, lengths[0], x.shape[1])
        out = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2)).reshape(n, b.shape[1])
        return out if out_dtype == dtype else out.to(out_dtype)
    out = x.new_zeros((n, b.shape[1]), dtype=dtype)
    start = 0
    for i, end in enumerate(ends):
        if end > start:
            out[start:end] = (x[start:end] @ a[i].t()) @ b[i].t()
        start = end
    return out if out_dtype == dtype else out.to(out_dtype)


__all__ = [
    "gated_residual", "gated_residual_norm_modulate", "group_norm_silu", "lora_segment_delta", "modulate", "rms_norm",
    "rms_norm_silu", "rope_rotate_half", "swiglu", "upsample2x_conv",
]
