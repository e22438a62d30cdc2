"""Where each sample's rows sit in the packed joint sequence (models.md §2.4, "Batch > 1").

Sample ``i`` contributes one document ``[video_i ; text_i]`` (video first, only the real text tokens), documents are
laid end to end and optionally zero-padded to a multiple of ``pad_to_multiple`` rows. Attention sees the documents
through ``cu_seqlens`` only (no O(S^2) mask); per-sample modulation is applied segment by segment.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from omnicore.attention.packed import PackedSequence

from .rope import sample_positions


@attrs.frozen
class JointLayout:
    """Packed-sequence metadata of one forward: segments, video row ranges, ``cu_seqlens``, RoPE positions."""

    grid: tuple[int, int, int]
    text_lengths: tuple[int, ...]
    packed: PackedSequence
    cu_seqlens: torch.Tensor
    positions: torch.Tensor
    token_mask: torch.Tensor | None  # [T] bool, None when there are no padding rows
    segments: tuple[tuple[int, int], ...]  # (start, end) row range of each sample's document

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
        return cls(tuple(grid), tuple(int(n) for n in text_lengths), packed, packed.cu_seqlens(device), positions,
                   token_mask, segments)

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

    def modulate(self, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """``x * (1 + scale_i) + shift_i`` per sample (``shift, scale [B, H]`` fp32); padding rows become 0."""
        if self._single:
            return torch.addcmul(shift, x, 1 + scale)
        parts = [torch.addcmul(shift[i], x[s:e], 1 + scale[i]) for i, (s, e) in enumerate(self.segments)]
        pad = self.total - self.packed.valid_length
        if pad:
            parts.append(x.new_zeros(pad, x.shape[-1], dtype=parts[0].dtype))
        return torch.cat(parts, dim=0)

    def gated_add(self, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``x + gate_i * y`` per sample (``gate [B, H]``, already tanh-ed); padding rows keep ``x``."""
        if self._single:
            return torch.addcmul(x, gate, y.to(x.dtype))
        parts = [torch.addcmul(x[s:e], gate[i], y[s:e].to(x.dtype)) for i, (s, e) in enumerate(self.segments)]
        valid = self.packed.valid_length
        if self.total > valid:
            parts.append(x[valid:])
        return torch.cat(parts, dim=0)
