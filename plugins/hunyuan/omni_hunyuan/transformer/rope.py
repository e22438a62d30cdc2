"""2-D rotary position embedding.

Text token ``p`` gets ``y = x = p`` (plain 1-D RoPE). An image span starting at ``L`` with an ``h x w`` grid gets
``y = L + (w*h - h)//2 + i``, ``x = L + (w*h - w)//2 + j`` (the reference truncates the half-integer offsets),
and the text after it resumes at ``L + w*h``. Frequencies are assigned to (y, x) in alternating pairs; the
table is applied rotate-half style over the whole head dimension.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def positions_2d(seq_len: int, images: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """``[seq_len, 2]`` (y, x) integer positions; ``images`` lists ``(start, h, w)`` spans of ``h*w`` tokens."""
    ys, xs = [], []
    last = 0
    for start, h, w in sorted(images):
        if start < last:
            raise ValueError(f"image span at {start} overlaps the previous section ending at {last}")
        ys.append(torch.arange(last, start))
        xs.append(torch.arange(last, start))
        by, bx = start + (w * h - h) // 2, start + (w * h - w) // 2
        grid_y = torch.arange(h).repeat_interleave(w) + by
        grid_x = torch.arange(w).repeat(h) + bx
        ys.append(grid_y)
        xs.append(grid_x)
        last = start + h * w
    if last > seq_len:
        raise ValueError(f"image spans end at {last}, past the sequence length {seq_len}")
    ys.append(torch.arange(last, seq_len))
    xs.append(torch.arange(last, seq_len))
    return torch.stack([torch.cat(ys), torch.cat(xs)], dim=1)


def rope_table(positions: torch.Tensor, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[S, head_dim]`` (float32) for ``positions [S, 2]``."""
    if head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 for 2-D RoPE, got {head_dim}")
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # [D/2]
    inv = inv.reshape(head_dim // 4, 2)  # consecutive pairs -> (y, x)
    angles = positions.to(torch.float64)[:, None, :] * inv[None]  # [S, D/4, 2]
    angles = angles.reshape(positions.shape[0], head_dim // 2).repeat(1, 2)
    return angles.cos().float(), angles.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, S, H, D]`` with ``cos/sin [S, D]``; computed in float32, cast back."""
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    xf = x.float()
    return (xf * c + rotate_half(xf) * s).to(x.dtype)
