"""MP4 output (H.264 + AAC through PyAV): counts, sizes, exact frame rates, colour fidelity, audio, determinism.

Stream facts (frame count, rate, sample rate, channels) are read with PyAV's demuxer directly, independently of
our ``read_video``; pixel and sample comparisons are against the arrays we encoded.
"""

from __future__ import annotations

import hashlib
from fractions import Fraction

import av
import numpy as np
import pytest
from omnicore.errors import InvalidRequest
from omnicore.outputs.mp4 import write_mp4, x264_asm_flags
from omnicore.outputs.options import EncodeOptions
from omnicore.outputs.output import Output
from omnicore.outputs.readers import read_video


def smooth_clip(num_frames: int = 9, height: int = 96, width: int = 160) -> np.ndarray:
    """Slowly moving smooth colour waves: something H.264 can encode well, so errors stay small."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    frames = []
    for t in range(num_frames):
        r = 128 + 90 * np.sin((x + 3 * t) / 40)
        g = 128 + 90 * np.cos((y - 2 * t) / 30)
        b = 128 + 80 * np.sin((x + y + 4 * t) / 50)
        frames.append(np.stack([r, g, b], -1))
    return np.stack(frames).round().astype(np.uint8)


def sine(freqs: tuple[float, ...], seconds: float, rate: int) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    return np.stack([0.5 * np.sin(2 * np.pi * f * t) for f in freqs]).astype(np.float32)


def probe(path) -> dict:
    with av.open(str(path)) as c:
        v = c.streams.video[0]
        info = {
            "codec": v.codec_context.name,
            "pix_fmt": v.codec_context.pix_fmt,
            "size": (v.codec_context.width, v.codec_context.height),
            "rate": v.average_rate,
            "frames": sum(1 for _ in c.decode(v)),
        }
    with av.open(str(path)) as c:
        if c.streams.audio:
            a = c.streams.audio[0]
            info.update(audio_codec=a.codec_context.name, sample_rate=a.rate, channels=a.channels)
    return info


@pytest.mark.parametrize("fps", [24, 23.976, 12.5])
def test_video_stream_facts(tmp_path, fps):
    frames = smooth_clip()
    path = Output(kind="video", frames=frames, fps=fps).save(tmp_path / "v.mp4")
    info = probe(path)
    assert info["codec"] == "h264" and info["pix_fmt"] == "yuv420p"
    assert info["size"] == (160, 96) and info["frames"] == 9
    expected = Fraction(24000, 1001) if fps == 23.976 else Fraction(fps)
    assert info["rate"] == expected
    assert "audio_codec" not in info
    decoded = read_video(path)
    assert decoded.audio is None and decoded.sample_rate is None
    assert decoded.fps == pytest.approx(float(expected), abs=1e-9)


def test_frames_close_to_input(tmp_path):
    frames = smooth_clip()
    decoded = read_video(Output(kind="video", frames=frames, fps=24).save(tmp_path / "v.mp4"))
    assert decoded.frames.shape == frames.shape and decoded.frames.dtype == np.uint8
    err = np.abs(decoded.frames.astype(np.int16) - frames)
    # 8-bit limited-range YUV alone costs ~1.3 levels on average (measured on flat colours: 219 luma steps and
    # chroma quantisation spread over R/G/B); H.264 at crf 18 adds little on a smooth clip (measured 1.47).
    assert err.mean() < 2.0, err.mean()
    # Every frame is close, not just the average (a dropped, duplicated or reordered frame would fail here).
    per_frame = err.reshape(9, -1).mean(axis=1)
    assert per_frame.max() < 2.5, per_frame


def test_colour_matrix_round_trips_for_saturated_colours(tmp_path):
    # Wrong BT.601/709 handling shifts saturated colours by tens of levels; flat patches isolate that error.
    frames = np.zeros((2, 64, 64, 3), np.uint8)
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (30, 200, 220), (128, 128, 128)]
    for k, colour in enumerate(colours):
        frames[:, (k // 2) * 16 : (k // 2) * 16 + 16, (k % 2) * 32 : (k % 2) * 32 + 32] = colour
    decoded = read_video(Output(kind="video", frames=frames, fps=24).save(tmp_path / "c.mp4")).frames
    for k, colour in enumerate(colours):
        r0, c0 = (k // 2) * 16 + 4, (k % 2) * 32 + 8
        patch = decoded[1, r0 : r0 + 8, c0 : c0 + 16].reshape(-1, 3).astype(int)
        assert np.abs(patch - np.array(colour)).max() <= 4, (colour, patch.mean(axis=0))


@pytest.mark.parametrize(("fps", "channels"), [(24, 2), (23.976, 1)])
def test_audio_stream_and_duration(tmp_path, fps, channels):
    frames = smooth_clip(num_frames=12)
    rate = 48000
    seconds = 12 / fps
    audio = sine((440.0, 660.0)[:channels], seconds, rate)
    path = Output(kind="video", frames=frames, fps=fps, audio=audio, sample_rate=rate).save(tmp_path / "av.mp4")
    info = probe(path)
    assert info["audio_codec"] == "aac" and info["sample_rate"] == rate and info["channels"] == channels
    assert info["frames"] == 12
    decoded = read_video(path)
    assert decoded.sample_rate == rate and decoded.audio.shape[0] == channels and decoded.audio.dtype == np.float32
    n_in, n_out = audio.shape[1], decoded.audio.shape[1]
    assert n_in <= n_out < n_in + 1024  # AAC pads the tail to a 1024-sample frame, nothing more
    assert abs(n_out / rate - seconds) <= 1 / fps


def test_aac_round_trip_correlates_with_the_input_sine(tmp_path):
    rate = 44100
    audio = sine((440.0, 1000.0), 0.5, rate)
    out = Output(kind="video", frames=smooth_clip(num_frames=12), fps=24, audio=audio, sample_rate=rate)
    decoded = read_video(out.to_bytes("mp4"))
    got = decoded.audio[:, : audio.shape[1]]
    for ch in range(2):
        corr = np.corrcoef(got[ch], audio[ch])[0, 1]
        assert corr > 0.99, (ch, corr)
    # The two channels are not swapped or mixed: each correlates poorly with the other's tone.
    assert abs(np.corrcoef(got[0], audio[1])[0, 1]) < 0.1
    # Level preserved (RMS of a 0.5-amplitude sine is 0.354).
    assert np.sqrt(np.mean(got**2)) == pytest.approx(0.5 / np.sqrt(2), rel=0.05)


def test_audio_longer_than_video_is_kept(tmp_path):
    rate = 16000
    audio = sine((300.0,), 1.0, rate)  # video lasts 0.25 s
    out = Output(kind="video", frames=smooth_clip(num_frames=6), fps=24, audio=audio, sample_rate=rate)
    decoded = read_video(out.to_bytes("mp4"))
    assert audio.shape[1] <= decoded.audio.shape[1] < audio.shape[1] + 1024


def test_encoding_is_deterministic():
    out = Output(kind="video", frames=smooth_clip(), fps=23.976, audio=sine((440.0, 550.0), 9 / 23.976, 48000),
                 sample_rate=48000)
    digests = {hashlib.sha256(out.to_bytes("mp4")).hexdigest() for _ in range(4)}
    assert len(digests) == 1
    # Explicit fixed thread counts are deterministic too (the bytes differ from the 1-thread ones).
    opts = EncodeOptions(video_threads=2)
    assert len({hashlib.sha256(out.to_bytes("mp4", opts)).hexdigest() for _ in range(3)}) == 1


def test_x264_asm_flags_only_narrow_avx512_cpus():
    with open("/proc/cpuinfo") as fh:
        has_avx512 = any(line.startswith("flags") and " avx512f" in line for line in fh)
    flags = x264_asm_flags()
    assert (flags is not None) == has_avx512
    if flags is not None:
        assert "AVX2" in flags.split(",") and "AVX512" not in flags


def test_odd_size_is_rejected_with_the_reason(tmp_path):
    for shape in ((3, 64, 63, 3), (3, 63, 64, 3)):
        with pytest.raises(InvalidRequest) as err:
            write_mp4(tmp_path / "o.mp4", np.zeros(shape, np.uint8), 24)
        assert err.value.field == "frames" and "even" in str(err.value)


def test_bad_inputs_name_the_field(tmp_path):
    frames = smooth_clip(num_frames=2)
    cases = [
        (dict(frames=frames.astype(np.float32), fps=24), "frames", "uint8"),
        (dict(frames=frames[..., :2], fps=24), "frames", "[F, H, W, 3]"),
        (dict(frames=frames, fps=None), "fps", "frame rate"),
        (dict(frames=frames, fps=24, audio=np.zeros((1, 100), np.int16), sample_rate=48000), "audio", "float32"),
        (dict(frames=frames, fps=24, audio=np.zeros((1, 100), np.float32)), "sample_rate", "required"),
        (dict(frames=frames, fps=24, audio=np.zeros((1, 100), np.float32), sample_rate=12345), "sample_rate", "AAC"),
    ]
    for kwargs, field, text in cases:
        with pytest.raises(InvalidRequest) as err:
            write_mp4(tmp_path / "bad.mp4", **kwargs)
        assert err.value.field == field and text in str(err.value), (field, str(err.value))
    # An image output has no frame rate, so it cannot become an MP4.
    with pytest.raises(InvalidRequest) as err:
        Output(kind="image", frames=frames[:1]).save(tmp_path / "img.mp4")
    assert err.value.field == "fps"
    assert not (tmp_path / "img.mp4").exists()


def test_faststart_puts_the_index_first(tmp_path):
    out = Output(kind="video", frames=smooth_clip(num_frames=3), fps=24)

    def top_level_boxes(data: bytes) -> list[str]:
        boxes, pos = [], 0
        while pos + 8 <= len(data):
            size = int.from_bytes(data[pos : pos + 4], "big")
            boxes.append(data[pos + 4 : pos + 8].decode("latin-1"))
            if size < 8:
                break
            pos += size
        return boxes

    fast = top_level_boxes(out.to_bytes("mp4"))
    slow = top_level_boxes(out.to_bytes("mp4", EncodeOptions(faststart=False)))
    assert fast.index("moov") < fast.index("mdat")
    assert slow.index("moov") > slow.index("mdat")
