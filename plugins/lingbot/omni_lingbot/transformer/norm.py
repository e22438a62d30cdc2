"""Normalisation layers of the LingBot DiT, computed in fp32 whatever the input dtype.

RMSNorm runs through the platform op ``rms_norm`` (``omnicore.ops``): the eager reference by default, a backend's
fused kernel once the model is bound to a platform's op table (:func:`bind_ops`).
"""

from __future__ import annotations

from typing import Any

import torch
from omnicore.plugin import ops as eager_ops
from torch import nn


def bind_ops(model: nn.Module, ops: Any) -> nn.Module:
    """Route every op-using submodule of ``model`` through ``ops`` (a platform's op table); returns ``model``."""
    for module in model.modules():
        if hasattr(type(module), "ops"):
            module.ops = ops
    return model


class RMSNorm(nn.Module):
    """RMSNorm with fp32 statistics and an fp32 weight multiply; returns the input dtype.

    Kept fp32 in bf16 inference, so the multiply is done on
    ``weight.float()`` before casting back.
    """

    ops: Any = eager_ops

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class FP32LayerNorm(nn.LayerNorm):
    """``LayerNorm`` evaluated in fp32 (the final ``norm_out`` has no affine parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return nn.functional.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)
