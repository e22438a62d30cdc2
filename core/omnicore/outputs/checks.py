"""Validation of what a writer is handed: frames, frame rate and audio. Errors name the offending field.

Writers re-check even though :class:`~omnicore.outputs.output.Output` validates on construction, because the
record is mutable and lower-level encoders (``encode_mp4``) take plain arrays.
"""

from __future__ import annotations

import math
from fractions import Fraction
from numbers import Real
from typing import Protocol

import numpy as np

from ..errors import InvalidRequest

# Sample rates the MPEG-4 AAC sampling-frequency table can signal (ISO/IEC 14496-3, 1.6.3.4).
AAC_SAMPLE_RATES = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350)

# NTSC-family rates are stored as k*1000/1001; a float like 23.976 means 24000/1001, not 2997/125.
_NTSC_BASES = (24, 30, 48, 60, 120, 240)
_MAX_FPS = 1000


class Encodable(Protocol):
    """What a writer needs from an output (:class:`~omnicore.outputs.output.Output` is one)."""

    kind: str
    frames: np.ndarray
    fps: float | None
    audio: np.ndarray | None
    sample_rate: int | None


def check_frames(frames: object) -> np.ndarray:
    """``frames`` must be a uint8 ``[F, H, W, 3]`` array with ``F >= 1``; returns it C-contiguous.

    The one frame check: ``Output`` runs it on construction, the writers and encoders before encoding."""
    if not isinstance(frames, np.ndarray):
        raise InvalidRequest("frames", f"must be a numpy uint8 array [F, H, W, 3], got {type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise InvalidRequest("frames", f"must have dtype uint8 (values 0..255), got {frames.dtype}")
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise InvalidRequest("frames", f"must have shape [F, H, W, 3], got {tuple(frames.shape)}")
    if min(frames.shape[:3]) < 1:
        raise InvalidRequest("frames", f"must hold at least one frame of at least 1x1 pixels, got {frames.shape}")
    return np.ascontiguousarray(frames)


def fps_fraction(fps: object) -> Fraction:
    """The exact frame rate for ``fps``: NTSC rates (23.976, 29.97, 59.94, ...) become ``k*1000/1001``."""
    if isinstance(fps, bool) or not isinstance(fps, Real):
        raise InvalidRequest("fps", f"an MP4 needs a frame rate (a positive number), got {fps!r}")
    value = float(fps)
    if not math.isfinite(value) or not 0 < value <= _MAX_FPS:
        raise InvalidRequest("fps", f"must be finite and in (0, {_MAX_FPS}], got {fps!r}")
    if isinstance(fps, Fraction):
        return fps
    for base in _NTSC_BASES:
        ntsc = Fraction(base * 1000, 1001)
        if abs(value - float(ntsc)) < 5e-4:
            return ntsc
    return Fraction(value).limit_denominator(1001)


def check_audio(audio: object, sample_rate: object) -> tuple[np.ndarray, int]:
    """Audio must be float ``[channels, samples]`` (1 or 2 channels; 1-D means mono) at an AAC sample rate.

    Returns float32 ``[C, N]`` clipped to [-1, 1] (decoders overshoot a little; AAC cannot carry more anyway).
    """
    if not isinstance(audio, np.ndarray):
        raise InvalidRequest("audio", f"must be a numpy float32 array [channels, samples], got {type(audio).__name__}")
    if not np.issubdtype(audio.dtype, np.floating):
        raise InvalidRequest(
            "audio", f"must be float32 in [-1, 1], got dtype {audio.dtype} (scale integer PCM by its full range first)"
        )
    if audio.ndim == 1:
        audio = audio[None, :]
    if audio.ndim != 2 or audio.shape[0] not in (1, 2):
        hint = " (transpose to [channels, samples]?)" if audio.ndim == 2 and audio.shape[1] in (1, 2) else ""
        raise InvalidRequest("audio", f"must be [channels, samples] with 1 or 2 channels, got {audio.shape}{hint}")
    if audio.shape[1] < 1:
        raise InvalidRequest("audio", "must hold at least one sample")
    if not np.all(np.isfinite(audio)):
        raise InvalidRequest("audio", "contains NaN or infinite samples")
    if sample_rate is None:
        raise InvalidRequest("sample_rate", "is required when audio is set")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise InvalidRequest("sample_rate", f"must be an integer number of Hz, got {sample_rate!r}")
    if int(sample_rate) not in AAC_SAMPLE_RATES:
        rates = ", ".join(str(r) for r in AAC_SAMPLE_RATES)
        raise InvalidRequest("sample_rate", f"AAC supports {rates} Hz; got {sample_rate} (resample first)")
    clipped = np.clip(audio, -1.0, 1.0).astype(np.float32, copy=False)
    return np.ascontiguousarray(clipped), int(sample_rate)
