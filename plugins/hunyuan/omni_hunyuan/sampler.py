"""Euler flow sampler and guidance (models.md §0.1, §3.4, §3.8).

The release grid: ``sigma = linspace(1, 0, N + 1)`` shifted once with ``s*t / (1 + (s - 1)*t)``; the model sees
``sigma * 1000`` (float); a step is ``x += v * (sigma[i+1] - sigma[i])`` with ``v = noise - x0``.
"""

from __future__ import annotations

import torch


def sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """``N + 1`` sigmas from 1 to 0 (float64 on the host)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift * t / (1.0 + (shift - 1.0) * t)


def model_timesteps(grid: torch.Tensor) -> torch.Tensor:
    """What the model is fed at each step: ``sigma * 1000`` for the first ``N`` sigmas."""
    return grid[:-1] * 1000.0


def euler_step(latents: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    return latents + velocity.to(latents.dtype) * (sigma_next - sigma)


def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float, rescale: float = 0.0) -> torch.Tensor:
    """``u + g (c - u)``; with ``rescale > 0`` the result's std is pulled toward the conditional one's
    (``rescale`` blends the rescaled and the plain guided prediction)."""
    guided = uncond + scale * (cond - uncond)
    if rescale <= 0.0:
        return guided
    dims = tuple(range(1, cond.dim()))
    std_cond = cond.std(dim=dims, keepdim=True)
    std_guided = guided.std(dim=dims, keepdim=True)
    rescaled = guided * (std_cond / std_guided)
    return rescale * rescaled + (1.0 - rescale) * guided
