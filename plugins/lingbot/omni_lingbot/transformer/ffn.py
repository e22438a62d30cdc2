"""Dense SwiGLU feed-forward (``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases)."""

from __future__ import annotations

from typing import Any

import torch
from omnicore.plugin import ops as eager_ops
from torch import nn

from .embeddings import linear


class SwiGLUFeedForward(nn.Module):
    ops: Any = eager_ops  # platform ops (``swiglu``); see norm.bind_ops

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        del token_mask  # dense FFN is per token; padding rows are dropped by the caller
        x = x.to(self.gate_proj.weight.dtype)
        return linear(self.down_proj, self.ops.swiglu(self.gate_proj(x), self.up_proj(x)))
