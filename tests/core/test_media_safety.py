"""Decoding untrusted media safely (issue 28 items 1, 2, 10): channel layouts checked before resampling, image
sizes from the header under the caller's cap (not Pillow's bomb limit), video decoded only as far and as large as
asked, lazily, and header probes that let a server budget an upload before decoding it."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import wave
import zlib

import numpy as np
import pytest
from omnicore.errors import InvalidRequest
from omnicore.media import (
    LazyFrames,
    VideoClip,
    lazy_video_clip,
    load_media,
    open_image,
    probe_media,
    read_audio_clip,
    read_image_input,
    read_video_clip,
    scaled_size,
)

av = pytest.importorskip("av")


def _wav(channels: int, seconds: float = 0.5, rate: int = 8000) -> bytes:
    n = int(seconds * rate)
    pcm = np.zeros((n, channels), np.int16)
    pcm[:, 0] = 8000  # only the first channel carries signal
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def _flac(layout: str, seconds: float = 0.3, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    n = len(av.AudioLayout(layout).channels)
    with av.open(buf, "w", format="flac") as c:
        s = c.add_stream("flac", rate=rate, layout=layout)
        for _ in range(0, int(rate * seconds), 4608):
            frame = av.AudioFrame.from_ndarray(np.full((1, 4608 * n), 1000, np.int16), format="s16", layout=layout)
            frame.rate = rate
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png(width: int, height: int, rows: int | None = None) -> bytes:
    z = zlib.compressobj(9)
    row = b"\x00" + b"\x40" * (3 * width)
    body = b"".join(z.compress(row) for _ in range(height if rows is None else rows)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", body) + _png_chunk(b"IEND", b"")


def _mp4(frames: int, size: tuple[int, int] = (64, 48), fps: int = 24) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height = size
        s.pix_fmt = "yuv420p"
        s.options = {"preset": "ultrafast"}
        for i in range(frames):
            img = np.full((size[1], size[0], 3), (i * 9) % 256, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------ audio
def test_eight_channel_audio_is_downmixed_to_stereo_in_a_process_that_survives():
    """PyAV 18's planar 8-channel frames crash ``to_ndarray``; run in a child so a regression kills only it."""
    code = ("import sys; from omnicore.media import read_audio_clip; "
            "c = read_audio_clip(sys.stdin.buffer.read(), field='reference_audio'); "
            "print(c.waveform.shape[0], c.waveform.shape[1], c.sample_rate)")
    for data in (_wav(8), _flac("7.1")):
        done = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
        channels, samples, rate = map(int, done.stdout.split())
        assert channels == 2 and samples > 0 and rate in (8000, 16000)


def test_downmix_keeps_the_signal_and_mono_stays_mono():
    clip = read_audio_clip(_wav(6))
    assert clip.waveform.shape == (2, 4000) and float(np.abs(clip.waveform).max()) > 0.05
    assert read_audio_clip(_wav(1)).waveform.shape == (1, 4000)
    assert read_audio_clip(_flac("5.1")).waveform.shape[0] == 2


def test_too_many_channels_are_refused_from_the_header_naming_the_field():
    with pytest.raises(InvalidRequest) as info:
        read_audio_clip(_wav(24, seconds=0.05), field="reference_audio")
    assert info.value.field == "reference_audio" and "24 audio channels" in info.value.rule
    with pytest.raises(InvalidRequest, match="3 audio channels, more than the 2"):
        read_audio_clip(_wav(3), max_channels=2)
    probe = probe_media("audio", _wav(8))
    assert (probe.channels, probe.sample_rate) == (8, 8000) and probe.decoded_bytes() == 4000 * 2 * 4


# ------------------------------------------------------------------------------------------------ images
def test_image_size_comes_from_the_header_and_the_callers_cap_is_the_only_cap():
    from PIL import Image

    bomb = _png(30000, 30000, rows=1)  # promises 900 MP; holds one row
    with pytest.raises(InvalidRequest) as info:
        read_image_input(bomb, field="input_reference", max_pixels=50_000_000)
    assert info.value.code == "image_too_large" and "30000x30000" in info.value.rule
    assert info.value.field == "input_reference"
    # above Pillow's own limit (~89 MP, ~179 MP is its hard error) the caller's larger cap still decides
    assert 12000 * 16000 > 2 * Image.MAX_IMAGE_PIXELS
    with open_image(_png(12000, 16000, rows=1), max_pixels=200_000_000) as img:
        assert img.size == (12000, 16000)  # lazy: no pixels decoded, no DecompressionBombError
    assert probe_media("image", _png(640, 480)).decoded_bytes() == 640 * 480 * 3
    img = read_image_input(_png(40, 30))
    assert img.mode == "RGB" and img.size == (40, 30) and img.getpixel((0, 0)) == (64, 64, 64)
    broken = _png(400, 300)
    broken = broken[:60] + bytes(range(256)) * 4 + broken[60 + 1024:]  # pixel data overwritten with garbage
    with pytest.raises(InvalidRequest, match="cannot decode the image"):
        read_image_input(broken)  # an error naming the field, not a crash


# ------------------------------------------------------------------------------------------------ video
def test_video_decoding_stops_after_the_frames_kept_and_scales_while_decoding():
    data = _mp4(40, (64, 48))
    clip = read_video_clip(data, keep_frames=10, scale_to_pixels=32 * 24)
    assert clip.frames.shape == (10, 24, 32, 3) and clip.fps == 24.0
    with pytest.raises(InvalidRequest, match="more than 20 frames"):
        read_video_clip(data, max_frames=20)  # the header's count: refused before a frame is decoded
    assert read_video_clip(data, max_frames=20, keep_frames=20).num_frames == 20
    assert scaled_size(1920, 1080, 1920 * 1080) == (1920, 1080) and scaled_size(1000, 500, 5000) == (100, 50)


def test_lazy_clip_checks_the_header_and_decodes_only_when_read():
    data = _mp4(30, (64, 48))
    clip = lazy_video_clip(data, field="reference_video", scale_to_pixels=32 * 24)
    assert isinstance(clip, VideoClip) and isinstance(clip.frames, LazyFrames)
    assert clip.frames.shape == (30, 24, 32, 3) and not clip.frames.decoded
    assert clip.num_frames == 30 and abs(clip.duration_s - 1.25) < 1e-6  # from the header: nothing decoded
    assert load_media("video", clip) is clip and not clip.frames.decoded
    arr = np.asarray(clip.frames)
    assert clip.frames.decoded and arr.shape == (30, 24, 32, 3) and arr.dtype == np.uint8
    assert clip.frames[3].shape == (24, 32, 3) and float(clip.frames.astype(np.float32).mean()) > 0
    with pytest.raises(InvalidRequest, match="more than 10 frames"):
        lazy_video_clip(data, max_frames=10)
    with pytest.raises(InvalidRequest, match="longer than the limit of 1 s"):
        lazy_video_clip(data, max_duration_s=1.0)
    with pytest.raises(InvalidRequest, match="more than 1000 pixels in all"):
        lazy_video_clip(data, max_total_pixels=1000)
    probe = probe_media("video", data)
    assert (probe.width, probe.height, probe.frames, probe.fps) == (64, 48, 30, 24.0)
    assert probe.decoded_bytes(keep_frames=5, max_pixels=32 * 24) == 5 * 32 * 24 * 3


def test_a_leading_slice_of_lazy_frames_decodes_only_that_many():
    data = _mp4(40, (64, 48))
    clip = lazy_video_clip(data)
    head = clip.frames[:7]
    assert isinstance(head, np.ndarray) and head.shape == (7, 48, 64, 3) and not clip.frames.decoded
    assert np.array_equal(head, np.asarray(clip.frames)[:7])


@pytest.mark.parametrize("fps", [12, 24, 30])
def test_h3_reads_the_same_reference_frames_from_the_decoded_prefix(fps):
    """MiniMax-H3 slices a reference video to the source frames its generated length reaches (so a lazily
    decoded upload decodes no more); the 24 fps frames it conditions on are unchanged by the slice."""
    conditions = pytest.importorskip("omni_minimax_h3.conditions")
    frames = np.stack([np.full((8, 8, 3), i, np.uint8) for i in range(90)])
    for num_frames in (22, 39, 56):
        needed = int(np.ceil(num_frames * fps / 24.0)) + 1
        full = conditions.video_at_24fps(frames, float(fps), num_frames, (8, 8))
        sliced = conditions.video_at_24fps(frames[:needed], float(fps), num_frames, (8, 8))
        assert np.array_equal(full, sliced), (fps, num_frames)
