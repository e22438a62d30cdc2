"""Putting conditioning media onto MiniMax-H3's canvas and rates.

- fl2va keyframes: the first in packed order is *stretched* onto the canvas (PIL LANCZOS); a second one is
  cover-resized (``round``-ed size) and centre-cropped at ``(src - dst) // 2``.
- ref2va images: resized (LANCZOS) so the short edge is the deployment's reference short edge (2048 in the
  release), both sides rounded to multiples of 32 — no area cap.
- audio: float32 stereo at 32 kHz, truncated to the generated duration; mono is duplicated. Other sample rates
  are resampled linearly (the release uses torchaudio's sinc resampler; pass 32 kHz audio for exact parity).
- ref2va videos: onto 24 fps slots, truncated to the generated length, resized onto the canvas of their own
  aspect ratio; the VAE encodes the first 17n+5 frames; Qwen3-VL reads them at 2 fps in blocks of two frames
  labelled ``"<t seconds>"``; their soundtrack (when the file has one) is an audio reference of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image


def to_rgb(image: Any) -> Image.Image:
    if isinstance(image, Image.Image):
        return image.convert("RGB") if image.mode != "RGB" else image
    if isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3 and image.shape[-1] == 3:
        return Image.fromarray(image)
    raise TypeError(f"expected a PIL image or uint8 [H, W, 3] array, got {type(image).__name__}")


def fit_keyframe(image: Image.Image, height: int, width: int, *, index: int) -> Image.Image:
    """The ``index``-th keyframe (packed order) on a ``height`` x ``width`` canvas."""
    if image.size == (width, height):
        return image
    if index == 0:
        return image.resize((width, height), Image.Resampling.LANCZOS)
    scale = max(width / image.size[0], height / image.size[1])
    size = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
    left, top = max(0, (size[0] - width) // 2), max(0, (size[1] - height) // 2)
    return image.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height))


def fit_reference_image(image: Image.Image, short_edge: int, multiple: int = 32) -> Image.Image:
    width, height = image.size
    scale = short_edge / min(width, height)
    target = (max(multiple, round(width * scale / multiple) * multiple),
              max(multiple, round(height * scale / multiple) * multiple))
    return image if image.size == target else image.resize(target, Image.Resampling.LANCZOS)


def stereo_at(waveform: np.ndarray, sample_rate: int, target_rate: int, max_seconds: float) -> torch.Tensor:
    """``[C, N]`` (C = 1 or 2) -> float32 ``[2, M]`` at ``target_rate``, at most ``max_seconds`` long."""
    wave = torch.as_tensor(np.asarray(waveform, dtype=np.float32))
    if wave.dim() != 2 or wave.shape[0] not in (1, 2):
        raise ValueError(f"a reference waveform must be [1 or 2, samples], got {tuple(wave.shape)}")
    wave = wave[:, : int(max_seconds * sample_rate)]
    if wave.shape[0] != 2:
        wave = wave.expand(2, -1).contiguous()
    if sample_rate != target_rate:
        n = max(1, round(wave.shape[1] * target_rate / sample_rate))
        wave = torch.nn.functional.interpolate(wave[None], size=n, mode="linear", align_corners=False)[0]
    return wave.contiguous()


# ------------------------------------------------------------------------------------------------ video references


def video_at_24fps(frames: np.ndarray, fps: float, num_frames: int, canvas: tuple[int, int]) -> np.ndarray:
    """A ref2va video reference on MiniMax-H3's clock and canvas: frames held/dropped onto 24 fps slots (each
    frame until the slot of the next, the last until the slot the stream's end rounds to), truncated to the
    generated ``num_frames``, resized (LANCZOS) onto ``canvas`` ``(height, width)`` — the canvas its own aspect ratio
    resolves to under the target's rule."""
    import math

    target = 24.0
    if fps != target:
        scale = target / fps
        slots = np.floor(np.arange(frames.shape[0]) * scale + 0.5).astype(np.int64)
        frames = np.repeat(frames, np.diff(slots, append=math.floor(frames.shape[0] * scale + 0.5)), axis=0)
    frames = frames[:num_frames]
    height, width = canvas
    if frames.shape[1:3] == (height, width):
        return frames
    return np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.Resampling.LANCZOS))
                     for f in frames])


def encodable_frames(count: int) -> int:
    """Frames of a reference the video VAE encodes: snapped *down* to 17n+5 (at least 22)."""
    return max(1, (count - 5) // 17) * 17 + 5


def conditioner_frames(frames: np.ndarray, fps: float = 24.0, sample_fps: float = 2.0, temporal_patch: int = 2
                       ) -> tuple[list[np.ndarray], list[float]]:
    """The frames Qwen3-VL reads (every ``fps / sample_fps``-th, deduplicated) and one timestamp per vision block:
    blocks merge ``temporal_patch`` frames (the last repeated to fill) and carry their mean time."""
    stride = fps / sample_fps
    indices: list[int] = []
    cursor = 0.0
    while round(cursor) < frames.shape[0]:
        if not indices or round(cursor) > indices[-1]:
            indices.append(round(cursor))
        cursor += stride
    if len(indices) < temporal_patch:
        raise ValueError(f"a reference video needs at least {round((temporal_patch - 1) * stride) + 1} frames")
    times = [i / sample_fps for i in range(len(indices))]
    times += [times[-1]] * (-len(times) % temporal_patch)
    blocks = [(times[i] + times[i + temporal_patch - 1]) / 2 for i in range(0, len(times), temporal_patch)]
    return [frames[i] for i in indices], blocks


def _smart_resize(num_frames: int, height: int, width: int, factor: int, temporal: int, min_pixels: int,
                  max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video sizing: both sides multiples of ``factor``, total pixels of the clip in [min, max]."""
    import math

    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


#: Qwen3-VL video processor defaults (``Qwen3VLVideoProcessor``): per-clip pixel bounds, patching, normalisation.
VIDEO_MIN_PIXELS = 128 * 32 * 32
VIDEO_MAX_PIXELS = 32 * 32 * 768


def video_pixel_values(frames: list[np.ndarray], *, patch: int = 16, merge: int = 2, temporal: int = 2,
                       mean: float = 0.5, std: float = 0.5) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``pixel_values_videos`` ``[t·h·w, 3·temporal·patch²]`` and the grid ``(t, h, w)`` of one sampled clip, laid
    out as Qwen3-VL's video processor does. transformers needs torchvision for that processor; this resizes with
    torch's antialiased bicubic on float pixels (torchvision's uint8 kernel may round a level differently)."""
    clip = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).float()  # [T, 3, H, W]
    t = clip.shape[0]
    h, w = _smart_resize(t, clip.shape[2], clip.shape[3], patch * merge, temporal, VIDEO_MIN_PIXELS,
                         VIDEO_MAX_PIXELS)
    if (h, w) != tuple(clip.shape[2:]):
        clip = torch.nn.functional.interpolate(clip, size=(h, w), mode="bicubic", antialias=True,
                                               align_corners=False).clamp(0, 255).round()
    clip = (clip / 255.0 - mean) / std
    if pad := -t % temporal:
        clip = torch.cat([clip, clip[-1:].expand(pad, -1, -1, -1)])
    gt, gh, gw = clip.shape[0] // temporal, h // patch, w // patch
    x = clip.view(gt, temporal, 3, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, 3 * temporal * patch * patch)
    return x.contiguous(), (gt, gh, gw)
