"""MP4 encoding through PyAV: H.264 video (yuv420p, BT.709 tags) plus AAC audio when there is any.

Rules worth knowing:

* yuv420p stores chroma at half resolution, so width and height must be even. Odd sizes are **rejected**
  (``InvalidRequest("frames", ...)``) rather than padded: padding would silently change the output size the
  request asked for. Models that can produce odd sizes should round their request sizes instead.
* The frame rate is exact: the stream time base is ``1/fps`` as a :class:`~fractions.Fraction`, and NTSC
  floats (23.976, 29.97, 59.94) map to ``k*1000/1001`` (see :func:`.checks.fps_fraction`).
* Audio is muxed as it is given (not trimmed or padded to the video length); AAC rounds the tail up to a
  1024-sample frame, so a decoder returns at most 1023 extra samples of silence at the end.
* Packets are interleaved by time (audio up to the end of each video frame is encoded after it), so the file
  plays progressively and the muxer never buffers the whole stream.
* Bytes are reproducible for identical input with a fixed ``video_threads`` (the default is 1; 0 = auto makes
  the bytes depend on the core count). On CPUs with AVX-512, libx264's AVX-512 code made identical input encode
  to different bytes from run to run (measured: x264 core 165 in PyAV 18.1), so it is switched off there
  (:func:`x264_asm_flags`); the AVX2 path gives the same bytes as x264's plain C path.
"""

from __future__ import annotations

import functools
import os
from fractions import Fraction
from typing import Any

import av
import numpy as np
from av.video.reformatter import ColorRange, Colorspace, VideoReformatter

from ..errors import InvalidRequest
from .checks import check_audio, check_frames, fps_fraction
from .options import DEFAULT_OPTIONS, EncodeOptions

# AVCOL_* values written into the H.264 VUI so players convert back with the matrix we encoded with.
_AVCOL_PRI_BT709 = 1
_AVCOL_TRC_BT709 = 1
_AVCOL_SPC_BT709 = 1

# Rough bits per pixel per frame when the encoder is not libx264 (no CRF there); x264 ignores this.
_FALLBACK_BITS_PER_PIXEL = 0.15


@functools.cache
def h264_encoder() -> str:
    """The H.264 encoder to use: ``libx264`` when this FFmpeg build has it, else whatever ``h264`` names."""
    for name in ("libx264", "h264"):
        try:
            return av.codec.Codec(name, "w").name
        except Exception:  # av raises UnknownCodecError / ValueError depending on version
            continue
    raise InvalidRequest("format", "this PyAV/FFmpeg build has no H.264 encoder; MP4 output is unavailable")


# Every x86 CPU with AVX-512 also has these (x264 cpu names); used to keep x264 on its AVX2 code.
_X264_AVX2_LEVEL = "MMX2,SSE2Fast,SSE3,SSSE3,SSE4.1,SSE4.2,AVX,FMA3,BMI1,BMI2,AVX2,LZCNT,Cache64"


@functools.cache
def x264_asm_flags() -> str | None:
    """x264 ``asm`` setting: the AVX2 feature set where the CPU has AVX-512 (Linux only), else ``None`` (auto).

    x264 takes the listed features as given rather than intersecting them with what it detects, which is why
    this only ever narrows a CPU that is known (from ``/proc/cpuinfo``) to have all of them.
    """
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return None
    return _X264_AVX2_LEVEL if "avx512f" in flags and "avx2" in flags else None


def video_codec_options(options: EncodeOptions) -> dict[str, str]:
    """Encoder options for :func:`h264_encoder` (crf/preset/asm only mean something to libx264)."""
    opts = {"threads": str(options.video_threads)}
    if h264_encoder() == "libx264":
        opts.update(crf=str(options.crf), preset=options.x264_preset)
        asm = x264_asm_flags()
        if asm is not None:
            opts["x264-params"] = f"asm={asm}"
    return opts


def container_options(options: EncodeOptions) -> dict[str, str]:
    return {"movflags": "+faststart"} if options.faststart else {}


def _layout(channels: int) -> str:
    return "mono" if channels == 1 else "stereo"


def write_mp4(
    dest: str | os.PathLike[str],
    frames: np.ndarray,
    fps: float | Fraction | None,
    audio: np.ndarray | None = None,
    sample_rate: int | None = None,
    options: EncodeOptions = DEFAULT_OPTIONS,
) -> None:
    """Encode ``frames`` (uint8 ``[F, H, W, 3]``) and optional ``audio`` (float ``[C, N]``) into an MP4 file.

    ``dest`` must be a real file path (``faststart`` rewrites the file after the index is known). Not atomic:
    :func:`omnicore.outputs.writers.write_output` wraps this with a temp file and rename.
    """
    frames = check_frames(frames)
    rate = fps_fraction(fps)
    num_frames, height, width, _ = frames.shape
    if width % 2 or height % 2:
        raise InvalidRequest(
            "frames", f"H.264 yuv420p needs an even width and height, got {width}x{height} (round the request size)"
        )
    audio_track: tuple[np.ndarray, int] | None = None
    if audio is not None:
        audio_track = check_audio(audio, sample_rate)

    with av.open(os.fspath(dest), "w", format="mp4", options=container_options(options)) as container:
        vstream = container.add_stream(h264_encoder(), rate=rate, options=video_codec_options(options))
        assert isinstance(vstream, av.VideoStream)
        vctx = vstream.codec_context
        vctx.width, vctx.height, vctx.pix_fmt = width, height, "yuv420p"
        vctx.time_base = 1 / rate
        vctx.color_range = int(ColorRange.MPEG)
        vctx.colorspace, vctx.color_primaries, vctx.color_trc = _AVCOL_SPC_BT709, _AVCOL_PRI_BT709, _AVCOL_TRC_BT709
        if h264_encoder() != "libx264":
            vctx.bit_rate = int(width * height * float(rate) * _FALLBACK_BITS_PER_PIXEL)

        astream: av.AudioStream | None = None
        if audio_track is not None:
            pcm, sample_rate_hz = audio_track
            astream = container.add_stream("aac", rate=sample_rate_hz, layout=_layout(pcm.shape[0]), format="fltp")
            astream.codec_context.bit_rate = options.audio_bitrate

        reformatter = VideoReformatter()  # one swscale context for the whole clip
        sent = 0  # audio samples handed to the encoder so far
        for i in range(num_frames):
            rgb = av.VideoFrame.from_ndarray(frames[i], format="rgb24")
            yuv = reformatter.reformat(
                rgb, format="yuv420p", dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG
            )
            yuv.pts, yuv.time_base = i, vctx.time_base
            container.mux(vstream.encode(yuv))
            if astream is not None and audio_track is not None:
                # Audio covering [0, (i+1)/fps): keeps audio and video packets close together in the file.
                pcm, sample_rate_hz = audio_track
                upto = min(pcm.shape[1], round((i + 1) * sample_rate_hz / rate))
                sent = _encode_audio(container, astream, pcm, sample_rate_hz, sent, upto)
        container.mux(vstream.encode(None))
        if astream is not None and audio_track is not None:
            pcm, sample_rate_hz = audio_track
            _encode_audio(container, astream, pcm, sample_rate_hz, sent, pcm.shape[1])
            container.mux(astream.encode(None))


def _encode_audio(container: Any, astream: Any, pcm: np.ndarray, sample_rate: int, start: int, stop: int) -> int:
    """Encode samples ``[start, stop)``; PyAV re-chunks them into the encoder's 1024-sample frames."""
    if stop <= start:
        return start
    chunk = np.ascontiguousarray(pcm[:, start:stop])
    frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=_layout(pcm.shape[0]))
    frame.sample_rate = sample_rate
    frame.pts, frame.time_base = start, Fraction(1, sample_rate)
    container.mux(astream.encode(frame))
    return stop
