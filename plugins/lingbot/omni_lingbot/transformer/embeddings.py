"""Input/output embeddings of the LingBot DiT: patchify, timestep and text embedders.

Module and parameter names match the diffusers checkpoint layout: ``time_embedder.linear_{1,2}``,
``text_embedder.{norm, linear_1, linear_2}``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .norm import RMSNorm


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Apply ``module`` after casting ``x`` to its weight dtype ("cast at Linear boundaries")."""
    return module(x.to(module.weight.dtype))


def patchify(x: torch.Tensor, patch_size: tuple[int, int, int]) -> torch.Tensor:
    """``[B, C, F, H, W]`` -> ``[B, gt*gh*gw, pf*ph*pw*C]``; tokens in (t, h, w) order, features in (pf, ph, pw, c)."""
    b, c, f, h, w = x.shape
    pf, ph, pw = patch_size
    if f % pf or h % ph or w % pw:
        raise ValueError(f"latent shape (F={f}, H={h}, W={w}) is not divisible by patch_size {tuple(patch_size)}")
    gt, gh, gw = f // pf, h // ph, w // pw
    x = x.reshape(b, c, gt, pf, gh, ph, gw, pw).permute(0, 2, 4, 6, 3, 5, 7, 1)
    return x.reshape(b, gt * gh * gw, pf * ph * pw * c)


def unpatchify(tokens: torch.Tensor, grid: tuple[int, int, int], patch_size: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of :func:`patchify`: ``[B, gt*gh*gw, pf*ph*pw*C]`` -> ``[B, C, gt*pf, gh*ph, gw*pw]``."""
    b = tokens.shape[0]
    gt, gh, gw = grid
    pf, ph, pw = patch_size
    c = tokens.shape[-1] // (pf * ph * pw)
    x = tokens.reshape(b, gt, gh, gw, pf, ph, pw, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(b, c, gt * pf, gh * ph, gw * pw)


def sinusoidal_timestep_embedding(timesteps: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """``[B]`` -> ``[B, dim]`` fp32 as ``[cos | sin]`` (diffusers ``Timesteps(dim, flip_sin_to_cos=True, 0)``)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    args = timesteps.float()[:, None] * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedding(nn.Module):
    """``linear_2(silu(linear_1(t_freq)))`` — same names and math as diffusers' ``TimestepEmbedding``."""

    def __init__(self, in_dim: int, hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, hidden, bias=bias)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, t_freq: torch.Tensor) -> torch.Tensor:
        return linear(self.linear_2, self.act(linear(self.linear_1, t_freq))).float()


#: The text embedder's RMSNorm eps: fixed by the reference model, not the checkpoint's ``norm_eps`` (which only
#: the blocks and the output norm use), so a checkpoint with another ``norm_eps`` still normalises text the same.
TEXT_NORM_EPS = 1e-6


class TextEmbedder(nn.Module):
    """Projects text-encoder states into the DiT width: ``linear_2(silu(linear_1(rmsnorm(x))))``."""

    def __init__(self, text_dim: int, hidden: int, eps: float = TEXT_NORM_EPS) -> None:
        super().__init__()
        self.norm = RMSNorm(text_dim, eps)
        self.linear_1 = nn.Linear(text_dim, hidden)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.linear_2, self.act(linear(self.linear_1, self.norm(x))))
