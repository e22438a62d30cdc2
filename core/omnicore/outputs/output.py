"""The :class:`Output` record: uint8 frames, optional audio, metrics; ``save(path)`` picks the format."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from .checks import check_frames

if TYPE_CHECKING:
    from .options import EncodeOptions


@attrs.define(eq=False)
class Output:
    """One generated image or video.

    ``frames`` is uint8 ``[F, H, W, 3]`` (images have ``F == 1``); ``audio`` is float32 ``[channels, samples]``
    in [-1, 1] with ``sample_rate``; ``metrics`` holds per-stage timings (s) and peak memory (bytes); ``text`` is
    text the model produced with the media (a revised prompt, its reasoning), ``None`` when it made none.
    """

    kind: str  # "image" | "video"
    frames: np.ndarray
    fps: float | None = None
    audio: np.ndarray | None = None
    sample_rate: int | None = None
    request_id: str = ""
    index: int = 0
    seed: int | None = None
    metrics: dict[str, Any] = attrs.Factory(dict)
    text: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.kind not in ("image", "video"):
            raise ValueError(f"Output.kind must be 'image' or 'video', got {self.kind!r}")
        check_frames(self.frames)  # InvalidRequest("frames", ...), a ValueError, naming what is wrong
        if self.text is not None and not isinstance(self.text, str):
            raise ValueError(f"Output.text must be a string or None, got {type(self.text).__name__}")
        if self.kind == "image" and self.frames.shape[0] != 1:
            raise ValueError(f"an image output has exactly one frame, got {self.frames.shape[0]}")

    @property
    def height(self) -> int:
        return int(self.frames.shape[1])

    @property
    def width(self) -> int:
        return int(self.frames.shape[2])

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    def save(self, path: str | Path, options: EncodeOptions | None = None) -> Path:
        """Write to ``path`` atomically; the suffix picks the format (.png/.webp/.jpg for images, .mp4 for video)."""
        from .writers import DEFAULT_OPTIONS, write_output

        return write_output(self, Path(path), options or DEFAULT_OPTIONS)

    def to_bytes(self, fmt: str, options: EncodeOptions | None = None) -> bytes:
        """Encode in memory (``"png"``, ``"webp"``, ``"jpeg"``, ``"mp4"``)."""
        from .writers import DEFAULT_OPTIONS, encode_output

        return encode_output(self, fmt, options or DEFAULT_OPTIONS)
