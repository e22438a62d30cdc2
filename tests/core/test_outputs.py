"""Image outputs, format dispatch by suffix, atomic writes and the errors bad inputs get.

PNG/WebP decoding goes through Pillow directly (an independent reader), not only through our readers.
"""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
import pytest
from omnicore.errors import ConfigError, InvalidRequest
from omnicore.outputs.checks import check_audio, fps_fraction
from omnicore.outputs.options import EncodeOptions
from omnicore.outputs.output import Output
from omnicore.outputs.readers import read_image
from omnicore.outputs.writers import SUPPORTED_SUFFIXES, encode_output, write_output
from PIL import Image


def _noise_image(h: int = 37, w: int = 53, seed: int = 0) -> np.ndarray:
    # Random pixels: the worst case for lossy codecs, so an exact round trip really means lossless.
    return np.random.default_rng(seed).integers(0, 256, size=(1, h, w, 3), dtype=np.uint8)


def _smooth_image(h: int = 64, w: int = 96) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    rgb = np.stack([128 + 100 * np.sin(x / 15), 128 + 100 * np.cos(y / 11), 128 + 90 * np.sin((x + y) / 20)], -1)
    return rgb.round().astype(np.uint8)[None]


def _pillow_decode(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def test_png_round_trip_is_exact(tmp_path):
    frames = _noise_image()
    path = Output(kind="image", frames=frames).save(tmp_path / "a.png")
    assert path == tmp_path / "a.png"
    np.testing.assert_array_equal(_pillow_decode(path.read_bytes()), frames[0])
    np.testing.assert_array_equal(read_image(path), frames[0])


def test_webp_lossless_round_trip_is_exact(tmp_path):
    frames = _noise_image(seed=1)
    out = Output(kind="image", frames=frames)
    path = write_output(out, tmp_path / "a.webp", EncodeOptions(webp_lossless=True))
    np.testing.assert_array_equal(_pillow_decode(path.read_bytes()), frames[0])
    np.testing.assert_array_equal(read_image(encode_output(out, "webp", EncodeOptions(webp_lossless=True))), frames[0])


def test_lossy_webp_and_jpeg_are_close_and_quality_matters():
    frames = _smooth_image()
    out = Output(kind="image", frames=frames)
    for fmt in ("webp", "jpeg"):
        hi = encode_output(out, fmt, EncodeOptions(image_quality=95))
        lo = encode_output(out, fmt, EncodeOptions(image_quality=10))
        err_hi = np.abs(_pillow_decode(hi).astype(int) - frames[0]).mean()
        err_lo = np.abs(_pillow_decode(lo).astype(int) - frames[0]).mean()
        assert err_hi < 2.0, (fmt, err_hi)
        assert err_lo > err_hi and len(lo) < len(hi), (fmt, err_lo, err_hi)
    # A lossy WebP of random noise is not exact; the lossless switch is what makes it exact.
    noise = Output(kind="image", frames=_noise_image(seed=2))
    assert not np.array_equal(_pillow_decode(encode_output(noise, "webp")), noise.frames[0])


@pytest.mark.parametrize(
    ("suffix", "magic"),
    [(".png", b"\x89PNG"), (".PNG", b"\x89PNG"), (".webp", b"RIFF"), (".jpg", b"\xff\xd8\xff"), (".jpeg", b"\xff\xd8")],
)
def test_save_picks_image_format_by_suffix(tmp_path, suffix, magic):
    path = Output(kind="image", frames=_smooth_image()).save(tmp_path / f"x{suffix}")
    data = path.read_bytes()
    assert data.startswith(magic)
    expected = {"png": "PNG", "webp": "WEBP", "jpg": "JPEG", "jpeg": "JPEG"}[suffix.lower().lstrip(".")]
    with Image.open(path) as im:
        assert im.format == expected and im.size == (96, 64)


def test_save_mp4_suffix_writes_an_mp4(tmp_path):
    frames = np.repeat(_smooth_image(), 2, axis=0)
    path = Output(kind="video", frames=frames, fps=8).save(tmp_path / "clip.mp4")
    assert path.read_bytes()[4:8] == b"ftyp"


def test_save_and_encode_give_the_same_bytes(tmp_path):
    out = Output(kind="image", frames=_noise_image(seed=3))
    assert out.save(tmp_path / "a.png").read_bytes() == out.to_bytes("png") == encode_output(out, ".PNG")


def test_single_frame_video_saves_as_image_but_multi_frame_does_not(tmp_path):
    one = Output(kind="video", frames=_noise_image(seed=4), fps=24)
    np.testing.assert_array_equal(read_image(one.save(tmp_path / "one.png")), one.frames[0])
    many = Output(kind="video", frames=np.repeat(_noise_image(seed=4), 3, axis=0), fps=24)
    with pytest.raises(InvalidRequest) as err:
        many.save(tmp_path / "many.png")
    assert err.value.field == "frames" and "3 frames" in str(err.value) and ".mp4" in str(err.value)
    assert not (tmp_path / "many.png").exists()


@pytest.mark.parametrize("name", ["out.gif", "out", "out.mp3"])
def test_unknown_suffix_lists_supported_ones(tmp_path, name):
    out = Output(kind="image", frames=_noise_image())
    with pytest.raises(InvalidRequest) as err:
        out.save(tmp_path / name)
    assert err.value.field == "path"
    for suffix in (".png", ".webp", ".jpg", ".jpeg", ".mp4"):
        assert suffix in str(err.value)
    assert set(SUPPORTED_SUFFIXES) == {".png", ".webp", ".jpg", ".jpeg", ".mp4"}
    with pytest.raises(InvalidRequest) as err:
        out.to_bytes("gif")
    assert err.value.field == "format"


def test_frames_replaced_after_construction_are_checked_at_write(tmp_path):
    out = Output(kind="image", frames=_noise_image())
    out.frames = out.frames.astype(np.float32)  # the record is mutable; the writer must not trust it
    with pytest.raises(InvalidRequest) as err:
        out.save(tmp_path / "a.png")
    assert err.value.field == "frames" and "uint8" in str(err.value)


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    target = tmp_path / "sub" / "a.png"  # missing folders are created
    out = Output(kind="image", frames=_noise_image())
    out.save(target)
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.png"]
    # A failing write (odd size for MP4) leaves an existing file untouched and no temp file behind.
    mp4 = tmp_path / "sub" / "v.mp4"
    mp4.write_bytes(b"previous")
    odd = Output(kind="video", frames=np.zeros((2, 15, 16, 3), np.uint8), fps=24)
    with pytest.raises(InvalidRequest):
        odd.save(mp4)
    assert mp4.read_bytes() == b"previous"
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.png", "v.mp4"]


def test_written_file_has_ordinary_permissions(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        path = Output(kind="image", frames=_noise_image()).save(tmp_path / "p.png")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (23.976, Fraction(24000, 1001)),
        (29.97, Fraction(30000, 1001)),
        (59.94, Fraction(60000, 1001)),
        (24, Fraction(24)),
        (12.5, Fraction(25, 2)),
        (Fraction(30000, 1001), Fraction(30000, 1001)),
    ],
)
def test_fps_fraction(value, expected):
    assert fps_fraction(value) == expected


@pytest.mark.parametrize("value", [None, 0, -1, float("nan"), float("inf"), "24", True, 5000])
def test_bad_fps_names_the_field(value):
    with pytest.raises(InvalidRequest) as err:
        fps_fraction(value)
    assert err.value.field == "fps"


def test_audio_checks():
    sine = np.sin(np.linspace(0, 10, 480)).astype(np.float32)
    pcm, rate = check_audio(sine, 48000)  # 1-D means mono
    assert pcm.shape == (1, 480) and pcm.dtype == np.float32 and rate == 48000
    loud, _ = check_audio(np.array([[2.0, -3.0, 0.5]]), 16000)  # float64 accepted, clipped
    np.testing.assert_array_equal(loud, np.array([[1.0, -1.0, 0.5]], np.float32))
    cases = [
        ((np.zeros((1, 10), np.int16), 48000), "audio", "int16"),
        ((np.zeros((480, 2), np.float32), 48000), "audio", "transpose"),
        ((np.zeros((3, 480), np.float32), 48000), "audio", "1 or 2 channels"),
        ((np.full((1, 4), np.nan, np.float32), 48000), "audio", "NaN"),
        ((np.zeros((1, 0), np.float32), 48000), "audio", "at least one sample"),
        ((np.zeros((1, 4), np.float32), None), "sample_rate", "required"),
        ((np.zeros((1, 4), np.float32), 44000), "sample_rate", "44100"),
        ((np.zeros((1, 4), np.float32), 48000.0), "sample_rate", "integer"),
    ]
    for args, field, text in cases:
        with pytest.raises(InvalidRequest) as err:
            check_audio(*args)
        assert err.value.field == field and text in str(err.value), (args, str(err.value))


@pytest.mark.parametrize(
    "kwargs", [{"image_quality": 0}, {"crf": 52}, {"x264_preset": "warp"}, {"video_threads": -1}, {"faststart": 1}]
)
def test_bad_encode_options(kwargs):
    with pytest.raises(ConfigError) as err:
        EncodeOptions(**kwargs)
    assert err.value.name == f"EncodeOptions.{next(iter(kwargs))}"


def test_read_image_handles_alpha_and_palette(tmp_path):
    rgba = np.random.default_rng(5).integers(0, 256, size=(9, 7, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    np.testing.assert_array_equal(read_image(tmp_path / "a.png"), rgba[..., :3])
    pal = Image.fromarray(rgba[..., :3]).convert("P")
    pal.save(tmp_path / "p.png")
    np.testing.assert_array_equal(read_image((tmp_path / "p.png").read_bytes()), np.asarray(pal.convert("RGB")))
