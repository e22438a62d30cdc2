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
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from .errors import InvalidRequest

if TYPE_CHECKING:
    import numpy.typing as npt
    from av.audio.stream import AudioStream
    from PIL import Image

Source = str | os.PathLike[str] | bytes | bytearray

#: Default decode caps (a model's :class:`~omnicore.specs.InputRole` or the server may lower them).
DEFAULT_MAX_FRAMES = 2048
DEFAULT_MAX_PIXELS = 50_000_000
DEFAULT_MAX_DURATION_S = 600.0
#: All decoded frames together (frames x height x width): ~900 MB of RGB, whatever the frame count and size.
DEFAULT_MAX_TOTAL_PIXELS = 300_000_000
#: Most audio channels a file may declare; decoded audio is downmixed to mono or stereo (:func:`read_audio_clip`).
MAX_AUDIO_CHANNELS = 16

_IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpeg"), (b"GIF87a", "gif"), (b"GIF89a", "gif"),
                (b"BM", "bmp"))


def _frames_check(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, LazyFrames):
        return  # its shape comes from the header; the decoder checks the pixels when they are read
    from .outputs.checks import check_frames  # the one frame check (uint8 [F>=1, H, W, 3]); light: numpy only

    check_frames(value)


class LazyFrames:
    """The frames of an uploaded video, decoded only when first read (``np.asarray``, indexing, iteration).

    A queued job then holds the compressed upload (kilobytes) instead of its decoded frames (gigabytes for a
    long clip), every check that needs only the shape (roles, counts, deployment, canvas) runs before any
    pixel is decoded, and decoding happens at the size and count the decoder was told (``keep_frames``,
    ``scale_to_pixels`` of :func:`read_video_clip`). ``shape`` is the header's until the frames are read, the
    decoded one after. A decoder failure on read raises ``InvalidRequest`` naming ``field``.
    """

    dtype = np.dtype(np.uint8)
    ndim = 4

    def __init__(self, source: Source, shape: tuple[int, int, int, int], *, field: str = "video",
                 **caps: Any) -> None:
        self._source: Source | None = source
        self._shape = tuple(int(v) for v in shape)
        self._field = field
        self._caps = caps
        self._frames: np.ndarray | None = None
        self._lock = threading.Lock()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._frames.shape) if self._frames is not None else self._shape

    @property
    def decoded(self) -> bool:
        return self._frames is not None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape))

    def materialize(self) -> np.ndarray:
        """Decode (once; the upload is dropped afterwards) and return the uint8 ``[F, H, W, 3]`` frames."""
        with self._lock:
            if self._frames is None:
                assert self._source is not None
                frames = read_video_clip(self._source, field=self._field, **self._caps).frames
                assert isinstance(frames, np.ndarray)  # read_video_clip always decodes
                self._frames, self._source = frames, None
            return self._frames

    def __array__(self, dtype: npt.DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        frames = self.materialize()
        return frames if dtype is None else frames.astype(dtype)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> Any:
        """Indexing decodes; a leading slice (``frames[:n]``) of frames not yet decoded decodes only those ``n``."""
        if self._frames is None and isinstance(index, slice) and index.start in (None, 0) \
                and index.step in (None, 1) and index.stop is not None and 0 < index.stop < self._shape[0]:
            with self._lock:
                source = self._source
            if source is not None:
                caps = dict(self._caps)
                keep = caps.get("keep_frames")
                caps["keep_frames"] = index.stop if keep is None else min(keep, index.stop)
                return read_video_clip(source, field=self._field, **caps).frames
        return self.materialize()[index]

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.materialize())

    def __getattr__(self, name: str) -> Any:  # any other ndarray attribute (astype, mean, ...): on the decoded frames
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        return f"LazyFrames(shape={self.shape}, decoded={self.decoded})"


def _wave_check(instance: object, attribute: attrs.Attribute, value: np.ndarray) -> None:
    if not isinstance(value, np.ndarray) or value.dtype != np.float32 or value.ndim != 2:
        raise ValueError(f"AudioClip.waveform must be float32 [C, N], got "
                         f"{getattr(value, 'dtype', type(value).__name__)} {getattr(value, 'shape', '')}")


@attrs.frozen(eq=False)
class VideoClip:
    """A decoded video: ``frames`` uint8 ``[F, H, W, 3]`` (RGB) at ``fps`` frames per second."""

    frames: np.ndarray | LazyFrames = attrs.field(validator=_frames_check)  # LazyFrames: decoded when read
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


def _open_arg(source: Source) -> io.BytesIO | str | bytes:
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


def open_image(source: Source, *, field: str = "image", max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """A *lazy* Pillow image of ``source`` (path or bytes) whose header-declared size is within ``max_pixels``.

    Only the header is read: the format's own opener is called directly, so Pillow's global decompression-bomb
    limit (``Image.MAX_IMAGE_PIXELS``, ~89 MP) neither caps ``max_pixels`` silently nor turns an oversized
    image into a decoder error — the caller's cap is the one rule, checked before any pixel is decoded.
    """
    from PIL import Image

    head = _read_head(source, 16)
    fmt = image_format(head)
    if fmt is None:
        raise _reject(field, "not a recognised image (PNG, JPEG, WebP, GIF, BMP)")
    Image.init()
    factory, accept = Image.OPEN[fmt.upper()]
    fp = io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview)) \
        else open(os.fspath(source), "rb")
    try:
        img = factory(fp, "")  # the header only; no pixel data is read yet
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for broken headers
        fp.close()
        raise _reject(field, f"cannot decode the image ({type(exc).__name__}: {exc})") from None
    w, h = img.size
    if w * h > max_pixels:
        img.close()
        fp.close()
        raise InvalidRequest(field, f"{w}x{h} has more than {max_pixels} pixels", code="image_too_large")
    img._exclusive_fp = True  # closing the image closes the file it reads from
    return img


def read_image_input(source: object, *, field: str = "image",
                     max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """An image input (PIL image, uint8 ``[H, W, 3]`` array, path or bytes) -> RGB ``PIL.Image``, pixel-capped
    from the header before decoding (see :func:`open_image`)."""
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
        head = _read_head(source, 16)
    except OSError as exc:
        raise _reject(field, f"cannot read the image: {exc.strerror or exc}") from None
    if image_format(head) is None:
        raise _reject(field, "not a recognised image (PNG, JPEG, WebP, GIF, BMP)")
    img = open_image(source, field=field, max_pixels=max_pixels)
    try:
        with img:
            img.load()
            return img if img.mode == "RGB" else img.convert("RGB")
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


def scaled_size(width: int, height: int, max_pixels: int | None) -> tuple[int, int]:
    """``(width, height)`` shrunk (aspect kept, even sides) so ``width * height <= max_pixels``; unchanged when it
    already fits or ``max_pixels`` is ``None``."""
    if max_pixels is None or width * height <= max_pixels:
        return width, height
    scale = (max_pixels / (width * height)) ** 0.5
    return max(2, int(width * scale) // 2 * 2), max(2, int(height * scale) // 2 * 2)


@attrs.frozen
class MediaProbe:
    """What a container's header declares, read without decoding: enough to refuse or budget an upload."""

    kind: str
    width: int = 0
    height: int = 0
    frames: int | None = None  # declared frame count (video), when the container says
    fps: float = 0.0
    duration_s: float | None = None
    channels: int = 0  # audio
    sample_rate: int = 0  # audio

    def decoded_bytes(self, *, keep_frames: int | None = None, max_pixels: int | None = None,
                      max_frames: int = DEFAULT_MAX_FRAMES) -> int:
        """Bytes the decoded clip will hold: RGB frames (at most ``keep_frames``, scaled to ``max_pixels``) or
        float32 mono/stereo samples; an unknown frame count assumes ``max_frames`` (the decoder's hard stop)."""
        if self.kind == "image":
            return self.width * self.height * 3
        if self.kind == "video":
            n = self.frames if self.frames is not None else (
                int(self.duration_s * self.fps) + 1 if self.duration_s and self.fps else max_frames)
            n = min(n, keep_frames) if keep_frames is not None else n
            w, h = scaled_size(self.width, self.height, max_pixels)
            return min(n, max_frames + 1) * w * h * 3
        seconds = self.duration_s if self.duration_s is not None else DEFAULT_MAX_DURATION_S
        return int(seconds * self.sample_rate) * min(2, max(1, self.channels)) * 4


def probe_media(kind: str, source: Source, *, field: str = "media") -> MediaProbe:
    """The header of an image (size), video (size, frames, fps, duration) or audio (channels, rate, duration)
    upload, without decoding any pixel or sample."""
    if kind == "image":
        img = open_image(source, field=field, max_pixels=2**62)
        with img:
            return MediaProbe("image", width=img.size[0], height=img.size[1])
    import av

    try:
        with av.open(_open_arg(source)) as container:
            streams = container.streams.video if kind == "video" else container.streams.audio
            if not streams:
                raise _reject(field, f"has no {kind} stream")
            s = streams[0]
            duration = float(s.duration * s.time_base) if s.duration is not None and s.time_base is not None \
                else container.duration / 1_000_000 if container.duration is not None else None
            if kind == "audio":
                return MediaProbe("audio", duration_s=duration, channels=_channels(s), sample_rate=int(s.rate or 0))
            rate = s.average_rate or s.guessed_rate or s.base_rate
            return MediaProbe("video", width=int(s.codec_context.width or 0), height=int(s.codec_context.height or 0),
                              frames=int(s.frames) if s.frames else None, fps=float(rate) if rate else 0.0,
                              duration_s=duration)
    except InvalidRequest:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise _reject(field, f"cannot open the {kind} ({type(exc).__name__})") from None


def read_video_clip(source: Source, *, field: str = "video", max_frames: int = DEFAULT_MAX_FRAMES,
                    max_pixels: int = DEFAULT_MAX_PIXELS, max_duration_s: float | None = DEFAULT_MAX_DURATION_S,
                    min_duration_s: float | None = None,
                    max_total_pixels: int = DEFAULT_MAX_TOTAL_PIXELS, keep_frames: int | None = None,
                    scale_to_pixels: int | None = None) -> VideoClip:
    """Decode the first video stream to RGB uint8 frames (PyAV), refusing what breaks a cap.

    The frame size, declared frame count and declared duration are checked from the header first; frames and
    their pixels are counted while decoding, so a file that lies about its length or size still stops at
    ``max_frames`` / ``max_total_pixels`` (all frames together) before it can exhaust memory.

    Decoding costs only what the caller will use: ``keep_frames`` stops reading after that many frames (the rest
    is never decoded, and does not count against ``max_frames``), and ``scale_to_pixels`` converts each frame
    straight to a smaller RGB size (aspect kept) so a full-size copy of the clip never exists.
    """
    import av

    try:
        with av.open(_open_arg(source)) as container:
            if not container.streams.video:
                raise _reject(field, "has no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "SLICE"  # frame threading keeps extra full-size frames in flight
            w, h = stream.codec_context.width, stream.codec_context.height
            if w and h and w * h > max_pixels:
                raise _reject(field, f"frames of {w}x{h} have more than {max_pixels} pixels")
            if stream.duration is not None and stream.time_base is not None:
                _check_duration(field, float(stream.duration * stream.time_base), None, max_duration_s)
            declared = int(stream.frames) if stream.frames else None
            if declared is not None and keep_frames is None and declared > max_frames:
                raise _reject(field, f"has more than {max_frames} frames")
            out_w, out_h = scaled_size(w, h, scale_to_pixels) if w and h else (0, 0)
            if declared is not None and out_w and min(declared, keep_frames or declared) * out_w * out_h \
                    > max_total_pixels:
                raise _reject(field, f"decodes to more than {max_total_pixels} pixels in all")
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            fps = float(rate) if rate else 0.0
            frames: list[np.ndarray] = []
            total = 0
            for frame in container.decode(stream):
                if keep_frames is not None and len(frames) >= keep_frames:
                    break
                if len(frames) >= max_frames:
                    raise _reject(field, f"has more than {max_frames} frames")
                if frame.width * frame.height > max_pixels:
                    raise _reject(field, f"has frames of more than {max_pixels} pixels")
                fw, fh = scaled_size(frame.width, frame.height, scale_to_pixels)
                total += fw * fh
                if total > max_total_pixels:
                    raise _reject(field, f"decodes to more than {max_total_pixels} pixels in all")
                if (fw, fh) != (frame.width, frame.height):
                    frames.append(frame.reformat(width=fw, height=fh, format="rgb24").to_ndarray())
                else:
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
    del frames
    if keep_frames is None:
        _check_duration(field, clip.duration_s, min_duration_s, max_duration_s)
    else:
        _check_duration(field, clip.duration_s, min_duration_s, None)
    return clip


def lazy_video_clip(source: Source, *, field: str = "video", max_frames: int = DEFAULT_MAX_FRAMES,
                    max_pixels: int = DEFAULT_MAX_PIXELS, max_duration_s: float | None = DEFAULT_MAX_DURATION_S,
                    min_duration_s: float | None = None, max_total_pixels: int = DEFAULT_MAX_TOTAL_PIXELS,
                    keep_frames: int | None = None, scale_to_pixels: int | None = None) -> VideoClip:
    """A :class:`VideoClip` whose frames (:class:`LazyFrames`) are decoded only when a model reads them.

    Everything the header and the packet index say is checked now, without decoding a frame: a video stream,
    the frame size against ``max_pixels``, the frame count (declared, else counted from the demuxed packets)
    against ``max_frames``, the duration against the caps, a frame rate, and the pixels of all decoded frames
    together against ``max_total_pixels``. The same caps bound the decode when it happens.
    """
    import av

    try:
        with av.open(_open_arg(source)) as container:
            if not container.streams.video:
                raise _reject(field, "has no video stream")
            stream = container.streams.video[0]
            w, h = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
            if not (w and h):
                raise _reject(field, "declares no frame size")
            if w * h > max_pixels:
                raise _reject(field, f"frames of {w}x{h} have more than {max_pixels} pixels")
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            fps = float(rate) if rate else 0.0
            if fps <= 0:
                raise _reject(field, "declares no frame rate")
            count = int(stream.frames) if stream.frames else 0
            if not count:  # no index in the header: count the packets (demuxing only, nothing is decoded)
                for packet in container.demux(stream):
                    if packet.size:
                        count += 1
                        if count > max_frames and keep_frames is None:
                            break
    except InvalidRequest:
        raise
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise _reject(field, f"cannot decode the video ({type(exc).__name__})") from None
    if count < 1:
        raise _reject(field, "has no decodable frames")
    if keep_frames is None and count > max_frames:
        raise _reject(field, f"has more than {max_frames} frames")
    kept = min(count, keep_frames) if keep_frames is not None else count
    _check_duration(field, count / fps, min_duration_s if keep_frames is None else None, max_duration_s)
    if keep_frames is not None:
        _check_duration(field, kept / fps, min_duration_s, None)
    out_w, out_h = scaled_size(w, h, scale_to_pixels)
    if kept * out_w * out_h > max_total_pixels:
        raise _reject(field, f"decodes to more than {max_total_pixels} pixels in all")
    frames = LazyFrames(source, (kept, out_h, out_w, 3), field=field, max_frames=max_frames, max_pixels=max_pixels,
                        max_duration_s=max_duration_s, min_duration_s=None, max_total_pixels=max_total_pixels,
                        keep_frames=keep_frames, scale_to_pixels=scale_to_pixels)
    return VideoClip(frames, fps)


def _channels(stream: AudioStream) -> int:
    ctx = stream.codec_context
    n = getattr(ctx, "channels", None) or (len(stream.layout.channels) if stream.layout is not None else 0)
    return int(n or 0)


def read_audio_clip(source: Source, *, field: str = "audio",
                    max_duration_s: float | None = DEFAULT_MAX_DURATION_S,
                    min_duration_s: float | None = None, max_channels: int = MAX_AUDIO_CHANNELS) -> AudioClip:
    """Decode the first audio stream (of an audio file or a video's soundtrack) to planar float32 (PyAV),
    downmixed to mono (a mono source) or stereo (anything wider).

    The channel count is checked from the header before anything is decoded (more than ``max_channels`` is
    refused), and the resampler always writes one or two planes: PyAV 18 mis-sizes planar frames of eight or
    more channels and ``to_ndarray`` on them crashes the process, so wide layouts are never materialised.
    """
    import av

    try:
        with av.open(_open_arg(source)) as container:
            if not container.streams.audio:
                raise _reject(field, "has no audio stream")
            stream = container.streams.audio[0]
            channels = _channels(stream)
            if channels < 1:
                raise _reject(field, "declares no audio channels")
            if channels > max_channels:
                raise _reject(field, f"has {channels} audio channels, more than the {max_channels} accepted "
                                     f"(it is downmixed to stereo)")
            if stream.duration is not None and stream.time_base is not None:
                _check_duration(field, float(stream.duration * stream.time_base), None, max_duration_s)
            rate = int(stream.rate or 0)
            if rate <= 0:
                raise _reject(field, "declares no sample rate")
            cap = None if max_duration_s is None else int(max_duration_s * rate) + rate  # + 1 s of codec slack
            resampler = av.AudioResampler(format="fltp", layout="mono" if channels == 1 else "stereo", rate=rate)
            chunks, total = [], 0
            for frame in container.decode(stream):
                if len(frame.layout.channels) != channels:  # a stream that changes layout mid-way
                    raise _reject(field, "changes its channel layout while playing")
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


def load_media(kind: str, data: object, *, field: str | None = None, **caps: Any) -> Any:
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


def _source(data: object, field: str) -> Source:
    if isinstance(data, (str, bytes, bytearray, os.PathLike)):
        return data
    raise _reject(field, f"must be a path, bytes or a decoded clip, got {type(data).__name__}")


def media_duration(kind: str, data: object, *, field: str = "media") -> float | None:
    """Duration in seconds of a video/audio input (decoded or not); ``None`` for images or when unknown."""
    if kind == "image":
        return None
    if isinstance(data, (VideoClip, AudioClip)):
        return data.duration_s
    if isinstance(data, (str, bytes, bytearray, os.PathLike)):
        return probe_duration(data, kind, field=field)
    return None
