"""Encoder settings for the writers, one validated record so callers never pass codec options by hand.

The defaults aim at "looks like the model's output" rather than small files (generated frames are the product),
and at reproducible bytes: a fixed ``video_threads`` (x264's output depends on its thread count, so "auto" would
make the bytes depend on the machine's core count). See :mod:`.mp4` for the AVX-512 caveat.
"""

from __future__ import annotations

import attrs

from ..errors import ConfigError

X264_PRESETS = (
    "ultrafast",
    "superfast",
    "veryfast",
    "faster",
    "fast",
    "medium",
    "slow",
    "slower",
    "veryslow",
)


def _in_range(lo: int, hi: int):
    def check(inst: object, attr: attrs.Attribute, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigError(f"EncodeOptions.{attr.name}", f"must be an integer in [{lo}, {hi}], got {value!r}")

    return check


def _preset(inst: object, attr: attrs.Attribute, value: object) -> None:
    if value not in X264_PRESETS:
        raise ConfigError("EncodeOptions.x264_preset", f"must be one of {', '.join(X264_PRESETS)}; got {value!r}")


def _bool(inst: object, attr: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"EncodeOptions.{attr.name}", f"must be True or False, got {value!r}")


@attrs.define(frozen=True)
class EncodeOptions:
    """How outputs are encoded.

    ``image_quality`` applies to JPEG and lossy WebP (1..100); ``webp_lossless`` makes WebP exact;
    ``png_compress_level`` trades PNG size for speed (0..9, always lossless). ``crf``/``x264_preset`` are
    libx264's constant-quality knobs; ``video_threads`` is the encoder thread count (0 = let x264 choose,
    faster but not byte-reproducible). ``audio_bitrate`` is the AAC bit rate in bit/s. ``faststart`` moves the
    MP4 index to the front so browsers can start playback before the download ends. ``durable`` fsyncs a written
    file before the rename (survives a power cut; costs a few ms per file, which is why it is off by default —
    the rename alone already means readers never see a partial file).
    """

    image_quality: int = attrs.field(default=90, validator=_in_range(1, 100))
    webp_lossless: bool = attrs.field(default=False, validator=_bool)
    png_compress_level: int = attrs.field(default=6, validator=_in_range(0, 9))
    crf: int = attrs.field(default=18, validator=_in_range(0, 51))
    x264_preset: str = attrs.field(default="medium", validator=_preset)
    video_threads: int = attrs.field(default=1, validator=_in_range(0, 64))
    audio_bitrate: int = attrs.field(default=192_000, validator=_in_range(16_000, 512_000))
    faststart: bool = attrs.field(default=True, validator=_bool)
    durable: bool = attrs.field(default=False, validator=_bool)


DEFAULT_OPTIONS = EncodeOptions()
