"""Decode what the writers produce (and ordinary user files): images through Pillow, video+audio through PyAV.

Used by tests, by request preprocessing (reference images/video) and by anything that needs pixels back.
"""

from __future__ import annotations

import io
import os
from typing import NamedTuple

import av
import numpy as np
from PIL import Image

Source = str | os.PathLike[str] | bytes


class DecodedVideo(NamedTuple):
    """``frames`` uint8 ``[F, H, W, 3]``; ``fps`` as a float; ``audio`` float32 ``[C, N]`` or ``None``."""

    frames: np.ndarray
    fps: float
    audio: np.ndarray | None
    sample_rate: int | None


def _open(source: Source):
    return io.BytesIO(source) if isinstance(source, (bytes, bytearray, memoryview)) else os.fspath(source)


def read_image(source: Source) -> np.ndarray:
    """Decode an image file (or its bytes) to uint8 RGB ``[H, W, 3]`` (alpha dropped, palettes expanded)."""
    with Image.open(_open(source)) as image:
        return np.asarray(image.convert("RGB")).copy()


def read_video(source: Source) -> DecodedVideo:
    """Decode the first video stream (RGB, using the colour matrix the file declares) and the first audio stream.

    Audio is returned as decoded: AAC's tail padding (< 1024 samples) is not trimmed.
    """
    with av.open(_open(source)) as container:
        if not container.streams.video:
            raise ValueError("no video stream in the file")
        vstream = container.streams.video[0]
        rate = vstream.average_rate or vstream.guessed_rate or vstream.base_rate
        frames = [
            frame.to_ndarray(format="rgb24", src_color_range=frame.color_range or None)
            for frame in container.decode(vstream)
        ]
    audio, sample_rate = _read_audio(source)
    return DecodedVideo(np.stack(frames), float(rate) if rate else 0.0, audio, sample_rate)


def _read_audio(source: Source) -> tuple[np.ndarray | None, int | None]:
    # A separate pass: demuxing one stream at a time keeps each decoder's packets in order and the code simple.
    with av.open(_open(source)) as container:
        if not container.streams.audio:
            return None, None
        astream = container.streams.audio[0]
        # Whatever the stream's sample format (s16, packed float, ...), hand back planar float32.
        resampler = av.AudioResampler(format="fltp", layout=astream.layout, rate=astream.rate)
        chunks: list[np.ndarray] = []
        for frame in container.decode(astream):
            chunks.extend(f.to_ndarray() for f in resampler.resample(frame))
        chunks.extend(f.to_ndarray() for f in resampler.resample(None))
        rate = astream.rate
    if not chunks:
        return None, None
    return np.concatenate(chunks, axis=1), int(rate)
