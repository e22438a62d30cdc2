"""Putting conditioning media onto MiniMax-H3's canvas and rates (models.md §1.2–§1.3; what diffusers' resize and
ref2va setup steps do, so the conditioning latents match).

- fl2va keyframes: the first in packed order is *stretched* onto the canvas (PIL LANCZOS); a second one is
  cover-resized (``round``-ed size) and centre-cropped at ``(src - dst) // 2``.
- ref2va images: resized (LANCZOS) so the short edge is the deployment's reference short edge (2048 in the
  release), both sides rounded to multiples of 32 — no area cap.
- audio: float32 stereo at 32 kHz, truncated to the generated duration; mono is duplicated. Other sample rates
  are resampled linearly (the release uses torchaudio's sinc resampler; pass 32 kHz audio for exact parity).
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
