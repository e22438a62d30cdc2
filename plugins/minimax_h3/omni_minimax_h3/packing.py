"""The packed-sequence layout of one MiniMax-H3 request and the row (un)patchify.

t2va / fl2va rows: ``[text | keyframe conditions | target audio | target video]``; ref2va rows:
``[text | reference blocks (a video's soundtrack rows right before its frames) | target audio | target video]``.
Every row gets a float64 ``(t, h, w)`` rotary position:

- text row ``i``: ``(i, 0, 0)``;
- a latent frame's spatial grid: per axis ``dim // 2`` points of ``linspace(left, left + r, endpoint=False) * 32``
  with ``r = dim / sqrt(h * w)``, ``left = (1 - r) / 2`` (aspect-normalised, centred);
- latent frame ``k`` of a clip starting at ``o``: ``o + sum_{j<k} span_j``, ``span_j = 5/3 · (1, 4, 4, 4, 4)[j % 5]``;
- audio rows (channel-major): time ``o + arange(T)`` per channel, no height, width pinned to the first (channel 0) or
  last (channel 1) point of the block's width axis.

fl2va's last keyframe sits at ``L + Σ spans - 5/3`` summed pairwise (numpy), ref2va's clock advance of a video
reference sums the same series sequentially: the two orders differ in the last ulp from 16 latent frames on, and
the release uses both, so we do too.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import torch

FRAME_RESCALE = 5.0 / 3.0
FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
SPATIAL_SCALE = 32
TEXT_TAG, VIDEO_TAG, AUDIO_TAG = 1, 0, 2
AUDIO_CHANNELS = 2


@attrs.frozen(eq=False)
class Layout:
    """Host tensors describing one request's packed rows (the fields of the DiT's ``RequestLayout.build``)."""

    position_ids: torch.Tensor  # [used, 3] float64
    token_tags: torch.Tensor  # [used] int64
    video_indices: torch.Tensor  # [Nv] int64, conditioning/reference rows first
    audio_indices: torch.Tensor  # [Na] int64, reference rows first
    text_indices: torch.Tensor  # [L] int64
    num_condition_video_rows: int = 0
    num_condition_audio_rows: int = 0


@attrs.frozen
class ReferenceBlock:
    """One ref2va reference as the layout sees it: its kind, its visual latent grid ``(t, h, w)`` (images and
    videos) and its soundtrack's audio latents per channel (0 = none)."""

    kind: str
    grid: tuple[int, int, int] | None = None
    audio_latents: int = 0


# ------------------------------------------------------------------------------------------------ grids


def spatial_axis(dim: int, patch: int, sqrt_area: float) -> torch.Tensor:
    r = dim / sqrt_area
    left = (1.0 - r) / 2.0
    # numpy's endpoint=False linspace is start + arange(n) * (stop - start) / n, which the release's grid is
    return torch.from_numpy(np.linspace(left, left + r, dim // patch, endpoint=False) * SPATIAL_SCALE)


def frame_grid(latent_h: int, latent_w: int, patch_h: int, patch_w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, w)`` positions of one latent frame's rows (row-major) ``[n, 2]`` and the width axis."""
    sqrt_area = float(np.sqrt(latent_h * latent_w))
    hs = spatial_axis(latent_h, patch_h, sqrt_area)
    ws = spatial_axis(latent_w, patch_w, sqrt_area)
    gh, gw = torch.meshgrid(hs, ws, indexing="ij")
    return torch.stack([gh.reshape(-1), gw.reshape(-1)], dim=-1), ws


def frame_times(num_latent_frames: int, origin: float) -> torch.Tensor:
    spans = torch.tensor([FRAME_RESCALE * FRAMES_PER_LATENT[k % len(FRAMES_PER_LATENT)]
                          for k in range(num_latent_frames)], dtype=torch.float64)
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def span_pairwise(num_latent_frames: int) -> float:
    spans = np.full(num_latent_frames, FRAME_RESCALE, dtype=np.float64)
    for k in range(len(FRAMES_PER_LATENT)):
        spans[k::len(FRAMES_PER_LATENT)] *= FRAMES_PER_LATENT[k]
    return float(spans.sum())


def span_sequential(num_latent_frames: int) -> float:
    total = 0.0
    for k in range(num_latent_frames):
        total += FRAME_RESCALE * FRAMES_PER_LATENT[k % len(FRAMES_PER_LATENT)]
    return total


def _audio_positions(pos: torch.Tensor, start: int, latents: int, origin: float, width_axis: torch.Tensor) -> None:
    rows = slice(start, start + AUDIO_CHANNELS * latents)
    pos[rows, 0] = (origin + torch.arange(latents, dtype=torch.float64)).repeat(AUDIO_CHANNELS)
    pos[rows, 2] = torch.cat([torch.full((latents,), float(width_axis[0]), dtype=torch.float64),
                              torch.full((latents,), float(width_axis[-1]), dtype=torch.float64)])


def _video_positions(pos: torch.Tensor, start: int, frames: int, grid: torch.Tensor, origin: float) -> int:
    n = frames * grid.shape[0]
    rows = slice(start, start + n)
    pos[rows, 0] = frame_times(frames, origin).repeat_interleave(grid.shape[0])
    pos[rows, 1:] = grid.repeat(frames, 1)
    return n


def _finish(pos: torch.Tensor, text_tags: torch.Tensor, video: list[torch.Tensor], audio: list[torch.Tensor],
            cond_video: int, cond_audio: int) -> Layout:
    used = pos.shape[0]
    length = text_tags.shape[0]
    video_idx = torch.cat(video) if video else torch.zeros(0, dtype=torch.int64)
    audio_idx = torch.cat(audio) if audio else torch.zeros(0, dtype=torch.int64)
    tags = torch.empty(used, dtype=torch.int64)
    tags[:length] = text_tags.to(torch.int64)
    tags[audio_idx] = AUDIO_TAG
    tags[video_idx] = VIDEO_TAG
    return Layout(pos, tags, video_idx, audio_idx, torch.arange(length), cond_video, cond_audio)


# ------------------------------------------------------------------------------------------------ layouts


def keyframe_layout(text_tags: torch.Tensor, num_latent_frames: int, latent_h: int, latent_w: int,
                    num_audio_latents: int, anchors: Sequence[str] = (), patch: tuple[int, int, int] = (1, 2, 2)
                    ) -> Layout:
    """t2va (no anchors) and fl2va (``"first"`` / ``"last"`` per keyframe, packed order)."""
    _, ph, pw = patch
    grid, width_axis = frame_grid(latent_h, latent_w, ph, pw)
    per_frame = grid.shape[0]
    length = int(text_tags.shape[0])
    cond = len(anchors) * per_frame
    audio_rows = AUDIO_CHANNELS * num_audio_latents
    video_rows = num_latent_frames * per_frame
    used = length + cond + audio_rows + video_rows
    pos = torch.zeros(used, 3, dtype=torch.float64)
    pos[:length, 0] = torch.arange(length, dtype=torch.float64)
    origin = float(length)
    for i, anchor in enumerate(anchors):
        if anchor == "first":
            t = origin
        elif anchor == "last":
            t = origin + span_pairwise(num_latent_frames) - FRAME_RESCALE
        else:
            raise ValueError(f"keyframe anchor must be 'first' or 'last', got {anchor!r}")
        rows = slice(length + i * per_frame, length + (i + 1) * per_frame)
        pos[rows, 0] = t
        pos[rows, 1:] = grid
    audio_start = length + cond
    _audio_positions(pos, audio_start, num_audio_latents, origin, width_axis)
    video_start = audio_start + audio_rows
    _video_positions(pos, video_start, num_latent_frames, grid, origin)
    return _finish(pos, text_tags,
                   [torch.arange(length, audio_start), torch.arange(video_start, used)],
                   [torch.arange(audio_start, video_start)], cond, 0)


def reference_layout(text_tags: torch.Tensor, references: Sequence[ReferenceBlock], num_latent_frames: int,
                     latent_h: int, latent_w: int, num_audio_latents: int, patch: tuple[int, int, int] = (1, 2, 2)
                     ) -> Layout:
    """ref2va: reference blocks in request order on a shared clock that starts after the text."""
    _, ph, pw = patch
    target_grid, target_width = frame_grid(latent_h, latent_w, ph, pw)
    length = int(text_tags.shape[0])

    def visual_rows(grid: tuple[int, int, int]) -> int:
        return grid[0] * (grid[1] // ph) * (grid[2] // pw)

    ref_video = sum(visual_rows(r.grid) for r in references if r.grid is not None)
    ref_audio = sum(AUDIO_CHANNELS * r.audio_latents for r in references)
    audio_rows = AUDIO_CHANNELS * num_audio_latents
    video_rows = num_latent_frames * target_grid.shape[0]
    used = length + ref_video + ref_audio + audio_rows + video_rows
    pos = torch.zeros(used, 3, dtype=torch.float64)
    pos[:length, 0] = torch.arange(length, dtype=torch.float64)
    video: list[torch.Tensor] = []
    audio: list[torch.Tensor] = []
    cursor, clock = length, float(length)
    for ref in references:
        if ref.kind == "image":
            assert ref.grid is not None
            grid, _ = frame_grid(ref.grid[1], ref.grid[2], ph, pw)
            n = visual_rows(ref.grid)
            pos[cursor:cursor + n, 0] = clock
            pos[cursor:cursor + n, 1:] = grid.repeat(ref.grid[0], 1)
            video.append(torch.arange(cursor, cursor + n))
            cursor += n
            clock += 1.0  # an image takes one integer slot
        elif ref.kind == "audio":
            n = AUDIO_CHANNELS * ref.audio_latents
            _audio_positions(pos, cursor, ref.audio_latents, clock, target_width)
            audio.append(torch.arange(cursor, cursor + n))
            cursor += n
            clock += float(ref.audio_latents)
        elif ref.kind == "video":
            assert ref.grid is not None
            grid, width_axis = frame_grid(ref.grid[1], ref.grid[2], ph, pw)
            na = AUDIO_CHANNELS * ref.audio_latents
            _audio_positions(pos, cursor, ref.audio_latents, clock, width_axis)
            audio.append(torch.arange(cursor, cursor + na))
            cursor += na
            nv = _video_positions(pos, cursor, ref.grid[0], grid, clock)
            video.append(torch.arange(cursor, cursor + nv))
            cursor += nv
            clock += max(float(ref.audio_latents), span_sequential(ref.grid[0]))
        else:
            raise ValueError(f"reference kind must be image, video or audio, got {ref.kind!r}")
    audio_start = cursor
    _audio_positions(pos, audio_start, num_audio_latents, clock, target_width)
    video_start = audio_start + audio_rows
    _video_positions(pos, video_start, num_latent_frames, target_grid, clock)
    video.append(torch.arange(video_start, used))
    audio.append(torch.arange(audio_start, video_start))
    return _finish(pos, text_tags, video, audio, ref_video, ref_audio)


# ------------------------------------------------------------------------------------------------ rows


def patchify(latents: torch.Tensor, patch: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """``[B, C, T, H, W]`` -> rows ``[B·t·h·w, C·pt·ph·pw]`` (tokens t, h, w; features channel-major)."""
    pt, ph, pw = patch
    b, c, t, h, w = latents.shape
    x = latents.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(-1, c * pt * ph * pw).contiguous()


def unpatchify(rows: torch.Tensor, channels: int, frames: int, latent_h: int, latent_w: int,
               patch: tuple[int, int, int] = (1, 2, 2)) -> torch.Tensor:
    """The inverse of :func:`patchify` for one clip: rows -> ``[1, C, T, H, W]``."""
    pt, ph, pw = patch
    x = rows.reshape(1, frames // pt, latent_h // ph, latent_w // pw, channels, pt, ph, pw)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(1, channels, frames, latent_h, latent_w).contiguous()


def audio_rows_to_latents(rows: torch.Tensor, num_audio_latents: int) -> torch.Tensor:
    """Channel-major rows ``[2·T, C]`` -> ``[2, C, T]`` for the audio VAE."""
    return rows.reshape(AUDIO_CHANNELS, num_audio_latents, rows.shape[-1]).permute(0, 2, 1).contiguous()
