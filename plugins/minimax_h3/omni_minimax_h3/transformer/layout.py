"""``RequestLayout``: where one request's rows sit in its packed document.

The pipeline builds the layout (text, conditioning/reference, audio and video rows, their ``(t, h, w)`` rotary
positions and modality tags); the DiT only reads it. The fields are exactly what diffusers'
``build_packed_sequence`` / ``build_ref2va_packed_sequence`` return, so either may produce them. The document is
padded with ``pad_rows`` rows to a multiple of ``seq_align`` (``[real | pad]``).
``latent_grid`` (set with :meth:`RequestLayout.with_latent_grid`) is the ``(frames, height, width)`` token grid of
the generated video, which both layouts put last (``[text | conditions | audio | video]``); attention planners
(e.g. the NPU's RainFusion) read it from ``AttentionMetadata.latent_grid``.
"""

from __future__ import annotations

import attrs
import torch

#: Packed document alignment of the reference implementation (``MINIMAX_H3_SEQ_ALIGN``).
SEQ_ALIGN = 64

TAG_VIDEO, TAG_TEXT, TAG_AUDIO = 0, 1, 2


def _long_cpu(name: str, t: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dim() != 1 or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{name} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
    return t.detach().to("cpu", torch.int64).contiguous()


@attrs.frozen(eq=False)
class RequestLayout:
    """One request's packed document; host (CPU) tensors. Build it with :meth:`build` (validates)."""

    position_ids: torch.Tensor  # [used, 3] float64
    token_tags: torch.Tensor  # [used] int64: 0 video, 1 text, 2 audio
    video_indices: torch.Tensor  # [Nv] int64, conditioning/reference rows first
    audio_indices: torch.Tensor  # [Na] int64, reference rows first
    text_indices: torch.Tensor  # [L] int64
    num_condition_video_rows: int = 0
    num_condition_audio_rows: int = 0
    seq_len: int = 0  # used + pad rows
    latent_grid: tuple[int, int, int] | None = None  # token grid of the generated video (the last real rows)

    @classmethod
    def build(
        cls,
        position_ids: torch.Tensor,
        token_tags: torch.Tensor,
        video_indices: torch.Tensor,
        audio_indices: torch.Tensor,
        text_indices: torch.Tensor,
        num_condition_video_rows: int = 0,
        num_condition_audio_rows: int = 0,
        *,
        seq_align: int = SEQ_ALIGN,
        pad_seq_len: int | None = None,
    ) -> RequestLayout:
        pos = torch.as_tensor(position_ids).detach().to("cpu", torch.float64).contiguous()
        if pos.dim() != 2 or pos.shape[1] != 3:
            raise ValueError(f"position_ids must be [used, 3], got {tuple(pos.shape)}")
        used = pos.shape[0]
        tags = _long_cpu("token_tags", token_tags)
        if tags.shape[0] != used:
            raise ValueError(f"token_tags has {tags.shape[0]} rows, position_ids {used}")
        if used and (int(tags.min()) < 0 or int(tags.max()) > 2):
            raise ValueError("token_tags must be 0 (video), 1 (text) or 2 (audio)")
        vid, aud, txt = (_long_cpu(n, t) for n, t in
                         (("video_indices", video_indices), ("audio_indices", audio_indices),
                          ("text_indices", text_indices)))
        seen = torch.zeros(used, dtype=torch.int64)
        for name, idx in (("video_indices", vid), ("audio_indices", aud), ("text_indices", txt)):
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= used):
                raise ValueError(f"{name} must lie in [0, {used})")
            seen.index_add_(0, idx, torch.ones_like(idx))
        if used and not bool((seen == 1).all()):
            raise ValueError("video_indices, audio_indices and text_indices must partition the packed rows")
        if not 0 <= num_condition_video_rows <= vid.numel():
            raise ValueError(f"num_condition_video_rows {num_condition_video_rows} outside [0, {vid.numel()}]")
        if not 0 <= num_condition_audio_rows <= aud.numel():
            raise ValueError(f"num_condition_audio_rows {num_condition_audio_rows} outside [0, {aud.numel()}]")
        if pad_seq_len is not None:
            if pad_seq_len < used:
                raise ValueError(f"pad_seq_len {pad_seq_len} is smaller than the {used} used rows")
            seq_len = int(pad_seq_len)
        else:
            if seq_align < 1:
                raise ValueError(f"seq_align must be >= 1, got {seq_align}")
            seq_len = -(-used // seq_align) * seq_align
        return cls(pos, tags, vid, aud, txt, int(num_condition_video_rows), int(num_condition_audio_rows),
                   max(seq_len, used))

    def with_latent_grid(self, grid: tuple[int, int, int]) -> RequestLayout:
        """This layout with the ``(frames, height, width)`` token grid of its generated video rows, checked to be
        exactly the last ``frames * height * width`` real rows."""
        t, h, w = (int(n) for n in grid)
        n = t * h * w
        generated = self.video_indices[self.num_condition_video_rows:]
        if min(t, h, w) <= 0 or generated.numel() != n or not torch.equal(
                generated, torch.arange(self.used - n, self.used)):
            raise ValueError(f"latent_grid {tuple(grid)} ({n} rows) does not describe the "
                             f"{generated.numel()} generated video rows at the end of the document")
        return attrs.evolve(self, latent_grid=(t, h, w))

    @property
    def used(self) -> int:
        return int(self.position_ids.shape[0])

    @property
    def pad_rows(self) -> int:
        return self.seq_len - self.used

    @property
    def num_text_rows(self) -> int:
        return int(self.text_indices.numel())

    @property
    def num_video_rows(self) -> int:
        return int(self.video_indices.numel())

    @property
    def num_audio_rows(self) -> int:
        return int(self.audio_indices.numel())
