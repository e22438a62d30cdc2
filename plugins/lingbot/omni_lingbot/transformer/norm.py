"""Normalisation layers of the LingBot DiT (models.md §0.2, §2.4), computed in fp32 whatever the input dtype."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics and an fp32 weight multiply; returns the input dtype.

    Kept fp32 in bf16 inference (models.md §2.4 lists every norm as fp32-kept), so the multiply is done on
    ``weight.float()`` before casting back.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class FP32LayerNorm(nn.LayerNorm):
    """``LayerNorm`` evaluated in fp32 (the final ``norm_out`` has no affine parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)
