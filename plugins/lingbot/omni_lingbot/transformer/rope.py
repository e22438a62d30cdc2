"""Complex 3-axis rotary embedding of the LingBot DiT.

Each head dim is split into (t, h, w) chunks of ``axes_dims``; a chunk's interleaved pairs ``(x[2i], x[2i+1])`` are
read as one complex number and multiplied by ``exp(i * pos * theta^(-2i/d))``. Frequencies are formed in float64,
the angle table is cast to float32 and turned into complex64 with ``polar`` (the Lumina-style table the reference
describes). Tables are per axis, cached per device, and grow by x1.5 when a position exceeds them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

GROWTH = 1.5


def axis_frequencies(dim: int, theta: float) -> torch.Tensor:
    """``1 / theta^(arange(0, dim, 2) / dim)`` in float64 (``dim // 2`` entries)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def axis_table(dim: int, length: int, theta: float) -> torch.Tensor:
    """``[length, dim // 2]`` complex64 table of ``exp(i * pos * freq)`` for positions ``0..length-1``."""
    angles = torch.outer(torch.arange(length, dtype=torch.float64), axis_frequencies(dim, theta)).float()
    return torch.polar(torch.ones_like(angles), angles)


def grown_length(current: int, needed: int) -> int:
    """New table length when position ``needed - 1`` does not fit ``current``: x1.5 steps until it does."""
    length = current
    while length < needed:
        length = max(length + 1, math.ceil(length * GROWTH))
    return length


class LingBotRotaryEmbedding(nn.Module):
    """Looks up per-token complex frequencies ``[S, head_dim // 2]`` for integer (t, h, w) positions.

    Tables are plain attributes, not buffers: a complex buffer would be mangled by ``model.to(bfloat16)`` and
    would leak into the checkpoint's state dict, which has no RoPE entries.
    """

    def __init__(self, axes_dims: tuple[int, ...], axes_lens: tuple[int, ...], theta: float) -> None:
        super().__init__()
        self.axes_dims = tuple(axes_dims)
        self.axes_lens = list(axes_lens)
        self.theta = float(theta)
        self._tables: dict[tuple[int, torch.device], torch.Tensor] = {}

    def table(self, axis: int, device: torch.device) -> torch.Tensor:
        key = (axis, torch.device(device))
        cached = self._tables.get(key)
        if cached is None or cached.shape[0] != self.axes_lens[axis]:
            cached = axis_table(self.axes_dims[axis], self.axes_lens[axis], self.theta).to(device)
            self._tables[key] = cached
        return cached

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions [S, 3]`` (int64) -> ``[S, sum(axes_dims) // 2]`` complex64."""
        if positions.dim() != 2 or positions.shape[1] != len(self.axes_dims):
            raise ValueError(f"positions must be [S, {len(self.axes_dims)}], got {tuple(positions.shape)}")
        if positions.numel():
            top = positions.max(dim=0).values.tolist()
            for axis, p in enumerate(top):
                if p >= self.axes_lens[axis]:
                    self.axes_lens[axis] = grown_length(self.axes_lens[axis], int(p) + 1)
        return torch.cat(
            [self.table(axis, positions.device)[positions[:, axis]] for axis in range(len(self.axes_dims))], dim=-1
        )


def apply_rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [S, heads, head_dim]`` by ``freqs [S, head_dim // 2]`` on interleaved pairs, in fp32."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs[:, None, :]).flatten(-2).to(x.dtype)


def sample_positions(grid: tuple[int, int, int], text_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(t, h, w) positions of one sample's ``[video ; text]`` rows: video ``(t+L+1, h, w)``, text ``(1..L, 0, 0)``."""
    gt, gh, gw = grid
    t = torch.arange(gt, device=device).view(gt, 1, 1).expand(gt, gh, gw) + (text_len + 1)
    h = torch.arange(gh, device=device).view(1, gh, 1).expand(gt, gh, gw)
    w = torch.arange(gw, device=device).view(1, 1, gw).expand(gt, gh, gw)
    video = torch.stack([t, h, w], dim=-1).reshape(-1, 3)
    text = torch.zeros(text_len, 3, dtype=torch.long, device=device)
    text[:, 0] = torch.arange(1, text_len + 1, device=device)
    return torch.cat([video, text], dim=0)
