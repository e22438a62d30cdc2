"""MiniMax-H3's two sigma schedules and its Euler (eta 0) update.

Grid: ``b = linspace(1, 0, N)`` in float32 (N points, the terminal 0 included, so N - 1 model calls), shifted
``s·b / (1 + (s - 1)·b)``, consecutive duplicates collapsed; video uses shift 12, audio 3. The DiT sees
``t = 1 - sigma`` in [0, 1]. Its output points to the data: ``x0 = x_t + (1 - t)·v``; the update blends
``x_next = r·x_t + (1 - r)·x0`` with ``r = sigma_next / sigma``, in float32.
"""

from __future__ import annotations

import torch


def sigmas(num_points: int, shift: float) -> torch.Tensor:
    """The shifted float32 grid of ``num_points`` points ending at 0 (fewer when the shift makes duplicates)."""
    if num_points < 2:
        raise ValueError(f"a schedule needs at least 2 grid points (one model call), got {num_points}")
    if shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}")
    base = torch.linspace(1.0, 0.0, int(num_points), dtype=torch.float32)
    return torch.unique_consecutive(shift * base / (1 + (shift - 1) * base))


def paired_sigmas(num_points: int, video_shift: float, audio_shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Video and audio grids; they must have equal lengths (one DiT call serves both per step)."""
    video, audio = sigmas(num_points, video_shift), sigmas(num_points, audio_shift)
    if video.numel() != audio.numel():
        raise ValueError("video/audio sigma schedules must have equal length")
    return video, audio


def timesteps(grid: torch.Tensor) -> torch.Tensor:
    """The DiT's ``t = 1 - sigma`` of every step (float32, one fewer than the grid)."""
    return 1.0 - grid[:-1]


def euler_step(sample: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor, sigma: torch.Tensor,
               sigma_next: torch.Tensor) -> torch.Tensor:
    """One data-ward Euler step in float32 (``t`` is the float32 ``1 - sigma`` the DiT saw)."""
    x = sample.float()
    denoised = x + (1 - t.to(x.device, torch.float32)) * velocity.float()
    ratio = sigma_next.to(x.device, torch.float32) / sigma.to(x.device, torch.float32)
    return (ratio * x + (1.0 - ratio) * denoised).to(sample.dtype)
