"""3-axis rotary table of MiniMax-H3: one ``inv_freq`` of ``rope_freq_dim`` frequencies shared by
the (t, h, w) axes; angles ``[t·f | h·f | w·f]`` doubled for the rotate-half convention, so the leading
``6·rope_freq_dim`` head channels are rotated. Positions are rounded to float32 before the product, as in the
reference. Built once per request branch (positions do not change across steps).
"""

from __future__ import annotations

import torch
from torch import nn


def inverse_frequencies(rope_freq_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, 2 * rope_freq_dim, 2, dtype=torch.float32) / (2 * rope_freq_dim)))


class H3Rope(nn.Module):
    def __init__(self, rope_freq_dim: int, theta: float) -> None:
        super().__init__()
        self.rope_freq_dim = rope_freq_dim
        self.theta = float(theta)
        self.register_buffer("inv_freq", inverse_frequencies(rope_freq_dim, theta), persistent=False)

    def reset_parameters(self, device: torch.device | str | None = None) -> None:
        """Recompute ``inv_freq`` (after a meta-device build)."""
        self.inv_freq = inverse_frequencies(self.rope_freq_dim, self.theta).to(device)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [S, 3]`` -> ``(cos, sin)`` each ``[S, 1, 6·rope_freq_dim]`` in ``dtype`` (broadcast over
        heads)."""
        inv = self.inv_freq.float()
        pos = positions.to(device=inv.device, dtype=torch.float32)
        freqs = (pos[:, :, None] * inv[None, None, :]).reshape(pos.shape[0], -1)  # [S, 3r]: t | h | w
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]
