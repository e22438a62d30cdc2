"""Euler flow sampler, its timestep grids, the initial noise and guidance.

Two grids, picked per deployment by the ``sampler_grid`` model option:

- ``release`` (default), the original release's ``FlowMatchDiscreteScheduler``: ``sigma = linspace(1, 0, N + 1)``
  shifted once with ``s*t / (1 + (s - 1)*t)``.
- ``diffusers``, the grid of diffusers' ``FlowMatchEulerDiscreteScheduler(1000, shift, use_dynamic_shifting=False)``
  that the reference serving system uses: its lowest training sigma is already shifted, and the ``N`` inference
  points spaced between 1 and it are shifted again, so the low end is shifted twice (shift 3, 3 steps: timesteps
  [1000, 751.1, 8.93]); computed in float32 like that scheduler, then a final 0 appended.

Either way the model sees ``sigma * 1000`` (float) and a step is ``x += v * (sigma[i+1] - sigma[i])`` with
``v = noise - x0``.
"""

from __future__ import annotations

import torch

#: The ``sampler_grid`` model option's values (the first is the default).
GRIDS = ("release", "diffusers")
NUM_TRAIN_TIMESTEPS = 1000


def _shift(t: torch.Tensor, shift: float) -> torch.Tensor:
    return shift * t / (1.0 + (shift - 1.0) * t)


def sigmas(num_steps: int, shift: float, grid: str = "release") -> torch.Tensor:
    """``N + 1`` sigmas from 1 to 0 (float64 on the host) on the named grid (see the module docstring)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if grid == "release":
        return _shift(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), shift)
    if grid == "diffusers":
        return diffusers_sigmas(num_steps, shift)
    raise ValueError(f"sampler_grid must be one of {', '.join(GRIDS)}, got {grid!r}")


def diffusers_sigmas(num_steps: int, shift: float, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """The ``FlowMatchEulerDiscreteScheduler`` grid: the training sigmas ``linspace(1, T, T) / T`` are shifted
    (float32); ``N`` points from ``sigma_max`` to that shifted ``sigma_min`` are spaced in float64, shifted again
    and rounded to float32; a final 0 follows. Returned as float64 holding those float32 values."""
    lowest = torch.tensor(1.0 / num_train_timesteps, dtype=torch.float32)
    sigma_min = _shift(lowest, shift).item()
    sigma_max = _shift(torch.tensor(1.0, dtype=torch.float32), shift).item()
    t = torch.linspace(sigma_max * num_train_timesteps, sigma_min * num_train_timesteps, num_steps,
                       dtype=torch.float64) / num_train_timesteps
    grid = _shift(t, shift).to(torch.float32)
    return torch.cat([grid, torch.zeros(1, dtype=torch.float32)]).to(torch.float64)


def model_timesteps(grid: torch.Tensor) -> torch.Tensor:
    """What the model is fed at each step: ``sigma * 1000`` for the first ``N`` sigmas. For the diffusers grid this
    equals that scheduler's float32 ``sigmas * 1000`` once the model casts it to float32 (both are the correctly
    rounded product of a float32 sigma and 1000)."""
    return grid[:-1] * float(NUM_TRAIN_TIMESTEPS)


def initial_noise(shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """The starting latents: drawn in bfloat16 from the request's generator, then cast to ``dtype``, as the
    reference and the official code draw them — a float32 draw would give another image for the same seed."""
    return torch.randn(shape, generator=generator, dtype=torch.bfloat16).to(dtype)


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
