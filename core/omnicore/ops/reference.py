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


__all__ = [
    "gated_residual", "gated_residual_norm_modulate", "group_norm_silu", "modulate", "rms_norm", "rms_norm_silu",
    "rope_rotate_half", "swiglu", "upsample2x_conv",
]
