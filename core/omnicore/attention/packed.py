"""Packed-sequence metadata: documents laid end to end, described by ``cu_seqlens`` (host-side, no device sync)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch


@attrs.frozen
class PackedSequence:
    """Where each document sits in a packed ``[T, ...]`` tensor.

    ``valid_length`` is Σ lengths; rows past it are padding (``T`` may be larger so shapes stay static).
    """

    lengths: tuple[int, ...]
    padded_length: int

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], pad_to_multiple: int = 1) -> PackedSequence:
        if not lengths or any(int(n) < 0 for n in lengths):
            raise ValueError(f"document lengths must be a non-empty list of non-negative ints, got {list(lengths)}")
        if pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
        total = sum(int(n) for n in lengths)
        padded = -(-total // pad_to_multiple) * pad_to_multiple
        return cls(tuple(int(n) for n in lengths), padded)

    @property
    def valid_length(self) -> int:
        return sum(self.lengths)

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [0], 0
        for n in self.lengths:
            acc += n
            out.append(acc)
        return tuple(out)

    def cu_seqlens(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.tensor(self.offsets, dtype=torch.int32, device=device)

    def split(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """The per-document views of a packed tensor (padding dropped)."""
        o = self.offsets
        return [packed[o[i]:o[i + 1]] for i in range(len(self.lengths))]

    def pack(self, documents: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate documents and zero-pad to ``padded_length`` rows."""
        if [d.shape[0] for d in documents] != list(self.lengths):
            raise ValueError("document shapes do not match the packed lengths")
        packed = torch.cat(list(documents), dim=0)
        pad = self.padded_length - packed.shape[0]
        if pad:
            packed = torch.cat([packed, packed.new_zeros(pad, *packed.shape[1:])], dim=0)
        return packed
