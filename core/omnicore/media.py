"""Conditioning media: decoded clip records, content sniffing and capped decoders (Pillow for images, PyAV for
video and audio).

Plugins get :class:`VideoClip` (uint8 ``[F, H, W, 3]`` + fps) and :class:`AudioClip` (float32 ``[C, N]`` + sample
rate) from :func:`load_media` (or ``MediaInput.load()``). Every decoder takes caps and checks them from the
container's header before any frame is decoded where the header says enough, so an oversized upload is refused
cheaply; errors are :class:`~omnicore.errors.InvalidRequest` naming ``field``. PyAV and Pillow load lazily.
"""

from __future__ import annotations

import io
import os
from typing import Any

import attrs
import numpy as np

from .errors import InvalidRequest

Source = str | os.PathLike[str] | bytes | bytearray

#: Default decode caps (a model's :class:`~omnicore.specs.InputRole` or the server may lower them).
DEFAULT_MAX_FRAMES = 2048
DEFAULT_MAX_PIXELS = 50_000_000
DEFAULT_MAX_DURATION_S = 600.0
#: All decoded frames together (frames x height x width): ~900 MB of RGB, whatever the frame count and size.
DEFAULT_MAX_TOTAL_PIXELS = 300_000_000

_IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpeg"), (b"GIF87a", "gif"), (b"GIF89a", "gif"),
                (b"BM", "bmp"))


def _frames_check(instance: Any, attribute: attrs.Attribute, value: np.ndarray) -> None:
    from .outputs.checks import check_frames  # the one frame check (uint8 [F>=1, H, W, 3]); light: numpy only

    check_frames(value)


def _wave_check(instance: Any, attribute: attrs.Attribute, value: np.ndarray) -> None:
    if not isinstance(value, np.ndarray) or value.dtype != np.float32 or value.ndim != 2:
        raise ValueError(f"AudioClip.waveform must be float32 [C, N], got "
                         f"{getattr(value, 'dtype', type(value).__name__)} {getattr(value, 'shape', '')}")


@attrs.frozen(eq=False)
class VideoClip:
    """A decoded video: ``frames`` uint8 ``[F, H, W, 3]`` (RGB) at ``fps`` frames per second."""

    frames: np.ndarray = attrs.field(validator=_frames_check)
    fps: float = attrs.field(converter=float)

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps if self.fps > 0 else 0.0


@attrs.frozen(eq=False)
class AudioClip:
    """Decoded audio: ``waveform`` float32 ``[channels, samples]`` in [-1, 1] at ``sample_rate`` Hz."""

    waveform: np.ndarray = attrs.field(validator=_wave_check)
    sample_rate: int = attrs.field(converter=int)

    @property
    def duration_s(self) -> float:
        return self.waveform.shape[1] / self.sample_rate if self.sample_rate > 0 else 0.0


def _read_head(source: Source, n: int = 64) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source[:n])
    with open(os.fspath(source), "rb") as f:
        return f.read(n)


def _open_arg(source: Source) -> Any:
    return io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview)) else os.fspath(source)


def image_format(head: bytes) -> str | None:
    """``png``/``jpeg``/``webp``/``gif``/``bmp`` from the first bytes, else ``None``."""
    for magic, name in _IMAGE_MAGIC:
        if head.startswith(magic):
            return name
    if len(head) >= 12 and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return None


def sniff_kind(source: Source, *, field: str = "media") -> str:
    """``"image"``, ``"video"`` or ``"audio"`` from the file's content (never its name).

    Images are recognised by their magic bytes; anything else is probed with PyAV: a container with a video
    stream is a video, one with only audio streams is audio. Unreadable or unknown content is an
    ``InvalidRequest`` on ``field``.
    """
    try:
        head = _read_head(source)
    except OSError as exc:
        shown = "the data" if isinstance(source, (bytes, bytearray)) else os.fspath(source)
        raise InvalidRequest(field, f"cannot read {shown}"
                                    f": {exc.strerror or exc}") from None
    if image_format(head) is not None:
        return "image"
    import av

    try:
        with av.open(_open_arg(source)) as container:
            if container.streams.video:
                return "video"
            if container.streams.audio:
                return "audio"
    except (av.FFmpegError, OSError, ValueError):
        pass
    raise InvalidRequest(field, "not a recognised image (PNG, JPEG, WebP, GIF, BMP), video or audio file")


def _reject(field: str, rule: str) -> InvalidRequest:
    return InvalidRequest(field, rule)


def read_image_input(source: Any, *, field: str = "image", max_pixels: int = DEFAULT_MAX_PIXELS) -> Any:
    """An image input (PIL image, uint8 ``[H, W, 3]`` array, path or bytes) -> RGB ``PIL.Image``, pixel-capped."""
    import warnings

    from PIL import Image

    if isinstance(source, Image.Image):
        return source if source.mode == "RGB" else source.convert("RGB")
    if isinstance(source, np.ndarray):
        if source.dtype != np.uint8 or source.ndim != 3 or source.shape[-1] != 3:
            raise _reject(field, f"an image array must be uint8 [H, W, 3], got {source.dtype} {source.shape}")
        return Image.fromarray(source)
    if not isinstance(source, (str, bytes, bytearray, os.PathLike)):
        raise _reject(field, f"must be a PIL image, a uint8 array, a path or bytes, got {type(source).__name__}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(_open_arg(source)) as img:
                w, h = img.size
                if w * h > max_pixels:
                    raise _reject(field, f"{w}x{h} has more than {max_pixels} pixels")
                img.load()
                return img.convert("RGB")
    except InvalidRequest:
        raise
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for broken data
        raise _reject(field, f"cannot decode the image ({type(exc).__name__}: {exc})") from None


def _check_duration(field: str, duration: float | None, min_s: float | None, max_s: float | None) -> None:
    if duration is None:
        return
    if max_s is not None and duration > max_s + 1e-6:
        raise _reject(field, f"lasts {duration:.3g} s, longer than the limit of {max_s:g} s")
    if min_s is not None and duration < min_s - 1e-6:
        raise _reject(field, f"lasts {duration:.3g} s, shorter than the minimum of {min_s:g} s")


def probe_duration(source: Source, kind: str, *, field: str = "media") -> float | None:
    """The duration (s) the container declares for its first ``kind`` stream, without decoding; ``None`` if unknown."""
    import av

    try:
        with av.open(_open_arg(source)) as container:
            streams = container.streams.video if kind == "video" else container.streams.audio
            if not streams:
                raise _reject(field, f"has no {kind} stream")
            s = streams[0]
            if s.duration is not None and s.time_base is not None:
                return float(s.duration * s.time_base)
            if container.duration is not None:
                return container.duration / 1_000_000
    except InvalidRequest:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise _reject(field, f"cannot open the {kind} ({type(exc).__name__})") from None
    return None


def read_video_clip(source: Source, *, field: str = "video", max_frames: int = DEFAULT_MAX_FRAMES,
                    max_pixels: int = DEFAULT_MAX_PIXELS, max_duration_s: float | None = DEFAULT_MAX_DURATION_S,
                    min_duration_s: float | None = None,
                    max_total_pixels: int = DEFAULT_MAX_TOTAL_PIXELS) -> VideoClip:
    """Decode the first video stream to RGB uint8 frames (PyAV), refusing what breaks a cap.

    The frame size and declared duration are checked from the header first; frames and their pixels are counted
    while decoding, so a file that lies about its length or size still stops at ``max_frames`` /
    ``max_total_pixels`` (all frames together) before it can exhaust memory.
    """
    import av

    try:
        with av.open(_open_arg(source)) as container:
            if not container.streams.video:
                raise _reject(field, "has no video stream")
            stream = container.streams.video[0]
            w, h = stream.codec_context.width, stream.codec_context.height
            if w and h and w * h > max_pixels:
                raise _reject(field, f"frames of {w}x{h} have more than {max_pixels} pixels")
            if stream.duration is not None and stream.time_base is not None:
                _check_duration(field, float(stream.duration * stream.time_base), None, max_duration_s)
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            fps = float(rate) if rate else 0.0
            frames: list[np.ndarray] = []
            total = 0
            for frame in container.decode(stream):
                if len(frames) >= max_frames:
                    raise _reject(field, f"has more than {max_frames} frames")
                if frame.width * frame.height > max_pixels:
                    raise _reject(field, f"has frames of more than {max_pixels} pixels")
                total += frame.width * frame.height
                if total > max_total_pixels:
                    raise _reject(field, f"decodes to more than {max_total_pixels} pixels in all")
                frames.append(frame.to_ndarray(format="rgb24"))
    except InvalidRequest:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise _reject(field, f"cannot decode the video ({type(exc).__name__})") from None
    if not frames:
        raise _reject(field, "has no decodable frames")
    if fps <= 0:
        raise _reject(field, "declares no frame rate")
    clip = VideoClip(np.stack(frames), fps)
    _check_duration(field, clip.duration_s, min_duration_s, max_duration_s)
    return clip


def read_audio_clip(source: Source, *, field: str = "audio",
                    max_duration_s: float | None = DEFAULT_MAX_DURATION_S,
                    min_duration_s: float | None = None) -> AudioClip:
    """Decode the first audio stream (of an audio file or a video's soundtrack) to planar float32 (PyAV)."""
    import av

    try:
        with av.open(_open_arg(source)) as container:
            if not container.streams.audio:
                raise _reject(field, "has no audio stream")
            stream = container.streams.audio[0]
            if stream.duration is not None and stream.time_base is not None:
                _check_duration(field, float(stream.duration * stream.time_base), None, max_duration_s)
            rate = int(stream.rate)
            cap = None if max_duration_s is None else int(max_duration_s * rate) + rate  # + 1 s of codec slack
            resampler = av.AudioResampler(format="fltp", layout=stream.layout, rate=rate)
            chunks, total = [], 0
            for frame in container.decode(stream):
                for f in resampler.resample(frame):
                    chunks.append(f.to_ndarray())
                    total += chunks[-1].shape[1]
                if cap is not None and total > cap:
                    raise _reject(field, f"is longer than the limit of {max_duration_s:g} s")
            chunks.extend(f.to_ndarray() for f in resampler.resample(None))
    except InvalidRequest:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise _reject(field, f"cannot decode the audio ({type(exc).__name__})") from None
    if not chunks:
        raise _reject(field, "has no decodable audio")
    clip = AudioClip(np.concatenate(chunks, axis=1).astype(np.float32, copy=False), rate)
    _check_duration(field, clip.duration_s, min_duration_s, max_duration_s)
    return clip


def load_media(kind: str, data: Any, *, field: str | None = None, **caps: Any) -> Any:
    """Decode one input of ``kind``: images -> RGB ``PIL.Image``; video -> :class:`VideoClip`; audio ->
    :class:`AudioClip`. Already decoded data is returned as is (clips are re-checked against duration caps)."""
    field = field or kind
    if kind == "image":
        return read_image_input(data, field=field, **caps)
    if kind == "video":
        if isinstance(data, VideoClip):
            _check_duration(field, data.duration_s, caps.get("min_duration_s"), caps.get("max_duration_s"))
            return data
        return read_video_clip(_source(data, field), field=field, **caps)
    if kind == "audio":
        if isinstance(data, AudioClip):
            _check_duration(field, data.duration_s, caps.get("min_duration_s"), caps.get("max_duration_s"))
            return data
        return read_audio_clip(_source(data, field), field=field, **caps)
    raise _reject(field, f"unknown media kind {kind!r}")


def _source(data: Any, field: str) -> Source:
    if isinstance(data, (str, bytes, bytearray, os.PathLike)):
        return data
    raise _reject(field, f"must be a path, bytes or a decoded clip, got {type(data).__name__}")


def media_duration(kind: str, data: Any, *, field: str = "media") -> float | None:
    """Duration in seconds of a video/audio input (decoded or not); ``None`` for images or when unknown."""
    if kind == "image":
        return None
    if isinstance(data, (VideoClip, AudioClip)):
        return data.duration_s
    if isinstance(data, (str, bytes, bytearray, os.PathLike)):
        return probe_duration(data, kind, field=field)
    return None
