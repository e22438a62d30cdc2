"""Ulysses sequence parallelism for the LingBot DiT (``--parallel ulysses=P``).

The packed joint sequence is padded to a multiple of ``P`` rows (padding rows attend nowhere and get no routed MoE
output, so results do not depend on it) and each rank runs the blocks on its ``T / P`` rows. Per-sample row
operations (AdaLN modulation, gated residuals) need to know which sample each local row belongs to:
:class:`ShardedLayout` is the block-facing view of a :class:`~.layout.JointLayout` restricted to one shard (the
documents it cuts, ``SequenceShard.pieces``). Attention goes through :class:`omnicore.parallel.ulysses.
UlyssesAttention` with the full sequence's metadata; the rows are gathered back before the output head.
"""

from __future__ import annotations

from typing import Any

import torch
from omnicore.plugin import AttentionMetadata, SequenceShard
from omnicore.plugin import ops as eager_ops

from .layout import JointLayout


class ShardedLayout:
    """What a block needs from the layout, for this rank's rows ``[shard.start, shard.end)`` of it."""

    def __init__(self, layout: JointLayout, shard: SequenceShard) -> None:
        self.layout = layout
        self.shard = shard
        self.pieces = shard.pieces(layout.packed.offsets)  # (sample, local start, local end)
        self.valid = max(0, min(layout.packed.valid_length - shard.start, shard.rows))  # local rows before padding
        self.token_mask = None if layout.token_mask is None else shard.take(layout.token_mask)

    @property
    def attention(self) -> AttentionMetadata:
        return self.layout.attention  # the full sequence's: Ulysses attention sees every row

    def _tail(self, x: torch.Tensor) -> int:
        return x.shape[0] - self.valid

    def modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, ops: Any = eager_ops) -> torch.Tensor:
        parts = [ops.modulate(x[s:e], shift[i], scale[i]) for i, s, e in self.pieces]
        if self._tail(x):
            parts.append(x.new_zeros(self._tail(x), x.shape[-1], dtype=parts[0].dtype if parts else x.dtype))
        return torch.cat(parts, dim=0)

    def gated_add(self, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, ops: Any = eager_ops) -> torch.Tensor:
        parts = [ops.gated_residual(x[s:e], y[s:e].to(x.dtype), gate[i]) for i, s, e in self.pieces]
        if self._tail(x):
            parts.append(x[self.valid:])
        return torch.cat(parts, dim=0)

    def gated_add_norm_modulate(self, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, shift: torch.Tensor,
                                scale: torch.Tensor, weight: torch.Tensor, eps: float,
                                ops: Any = eager_ops) -> tuple[torch.Tensor, torch.Tensor]:
        xs, hs = [], []
        for i, s, e in self.pieces:
            xi, hi = ops.gated_residual_norm_modulate(x[s:e], y[s:e].to(x.dtype), gate[i], shift[i], scale[i], eps,
                                                      norm="rms", weight=weight)
            xs.append(xi)
            hs.append(hi)
        if self._tail(x):
            xs.append(x[self.valid:])
            hs.append(x.new_zeros(self._tail(x), x.shape[-1], dtype=hs[0].dtype if hs else x.dtype))
        return torch.cat(xs, dim=0), torch.cat(hs, dim=0)
