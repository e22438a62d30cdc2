"""Where each sample's rows sit in the packed joint sequence.

Sample ``i`` contributes one document ``[video_i ; text_i]`` (video first, only the real text tokens), documents are
laid end to end and optionally zero-padded to a multiple of ``pad_to_multiple`` rows. Attention sees the documents
through the packed :class:`~omnicore.attention.metadata.AttentionMetadata` only (host-int ``cu_seqlens``; padding is
a trailing ``[real | pad]`` document with ``valid_kv_length``, so no O(S^2) mask); per-sample modulation is applied
segment by segment through the platform ops ``modulate`` / ``gated_residual``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from omnicore.plugin import AttentionMetadata, PackedSequence
from omnicore.plugin import ops as eager_ops

from .rope import sample_positions


@attrs.frozen
class JointLayout:
    """Packed-sequence metadata of one forward: segments, video row ranges, ``cu_seqlens``, RoPE positions."""

    grid: tuple[int, int, int]
    text_lengths: tuple[int, ...]
    packed: PackedSequence
    positions: torch.Tensor
    token_mask: torch.Tensor | None  # [T] bool, None when there are no padding rows
    segments: tuple[tuple[int, int], ...]  # (start, end) row range of each sample's document
    attention: AttentionMetadata  # what every attention call of the forward receives as ``metadata=``

    @classmethod
    def build(
        cls,
        grid: tuple[int, int, int],
        text_lengths: Sequence[int],
        device: torch.device,
        pad_to_multiple: int = 1,
    ) -> JointLayout:
        n_video = grid[0] * grid[1] * grid[2]
        lengths = [n_video + int(n) for n in text_lengths]
        packed = PackedSequence.from_lengths(lengths, pad_to_multiple)
        positions = torch.cat([sample_positions(grid, int(n), device) for n in text_lengths], dim=0)
        pad = packed.padded_length - packed.valid_length
        token_mask = None
        if pad:
            positions = torch.cat([positions, positions.new_zeros(pad, 3)], dim=0)
            token_mask = torch.zeros(packed.padded_length, dtype=torch.bool, device=device)
            token_mask[: packed.valid_length] = True
        o = packed.offsets
        segments = tuple((o[i], o[i + 1]) for i in range(len(lengths)))
        metadata = AttentionMetadata.from_packed(packed, latent_grid=tuple(grid))
        return cls((int(grid[0]), int(grid[1]), int(grid[2])), tuple(int(n) for n in text_lengths), packed,
                   positions, token_mask, segments, metadata)

    @property
    def batch(self) -> int:
        return len(self.text_lengths)

    @property
    def n_video(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def total(self) -> int:
        return self.packed.padded_length

    @property
    def _single(self) -> bool:
        return self.batch == 1 and self.token_mask is None

    def pack(self, video: torch.Tensor, texts: Sequence[torch.Tensor]) -> torch.Tensor:
        """``video [B, Nv, H]`` and per-sample real text ``[L_i, H]`` -> packed ``[T, H]``."""
        docs = []
        for i, text in enumerate(texts):
            docs.append(video[i])
            docs.append(text)
        pad = self.total - self.packed.valid_length
        if pad:
            docs.append(video.new_zeros(pad, video.shape[-1]))
        return torch.cat(docs, dim=0)

    def video_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> ``[B, Nv, H]``: each sample's video rows (they lead its document)."""
        return torch.stack([x[s:s + self.n_video] for s, _ in self.segments], dim=0)

    def modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, ops: Any = eager_ops) -> torch.Tensor:
        """``x * (1 + scale_i) + shift_i`` per sample (``shift, scale [B, H]`` fp32); padding rows become 0."""
        if self._single:
            return ops.modulate(x, shift, scale)
        parts = [ops.modulate(x[s:e], shift[i], scale[i]) for i, (s, e) in enumerate(self.segments)]
        pad = self.total - self.packed.valid_length
        if pad:
            parts.append(x.new_zeros(pad, x.shape[-1], dtype=parts[0].dtype))
        return torch.cat(parts, dim=0)

    def gated_add(self, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, ops: Any = eager_ops) -> torch.Tensor:
        """``x + gate_i * y`` per sample (``gate [B, H]``, already tanh-ed); padding rows keep ``x``."""
        if self._single:
            return ops.gated_residual(x, y.to(x.dtype), gate)
        parts = [ops.gated_residual(x[s:e], y[s:e].to(x.dtype), gate[i]) for i, (s, e) in enumerate(self.segments)]
        valid = self.packed.valid_length
        if self.total > valid:
            parts.append(x[valid:])
        return torch.cat(parts, dim=0)

    def gated_add_norm_modulate(
        self,
        x: torch.Tensor,
        gate: torch.Tensor,
        y: torch.Tensor,
        shift: torch.Tensor,
        scale: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        ops: Any = eager_ops,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`gated_add` then :meth:`modulate` of its RMSNorm (``weight``, ``eps``), in one platform op
        (``gated_residual_norm_modulate``, what fused AdaLN kernels implement); returns ``(x_new, modulated)``."""
        if self._single:
            return ops.gated_residual_norm_modulate(x, y.to(x.dtype), gate, shift, scale, eps, norm="rms",
                                                    weight=weight)
        xs, hs = [], []
        for i, (s, e) in enumerate(self.segments):
            xi, hi = ops.gated_residual_norm_modulate(x[s:e], y[s:e].to(x.dtype), gate[i], shift[i], scale[i], eps,
                                                      norm="rms", weight=weight)
            xs.append(xi)
            hs.append(hi)
        valid = self.packed.valid_length
        if self.total > valid:
            xs.append(x[valid:])
            hs.append(x.new_zeros(self.total - valid, x.shape[-1], dtype=hs[0].dtype))
        return torch.cat(xs, dim=0), torch.cat(hs, dim=0)
