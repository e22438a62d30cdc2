"""TI2V image conditioning: geometry alignment, smart resize, clean-prefix writes (docs/contracts-status.md C8.7)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omni_lingbot.conditions import align_image, apply_clean_prefix, load_image, smart_resize, vlm_image
from PIL import Image, ImageDraw

GREEN = (0, 255, 0)
RED = (255, 0, 0)


def _banded(width: int, height: int, band: tuple[int, int, int, int]) -> Image.Image:
    img = Image.new("RGB", (width, height), RED)
    ImageDraw.Draw(img).rectangle(band, fill=GREEN)
    return img


@pytest.mark.parametrize(("size", "band", "target"), [
    ((160, 64), (32, 0, 127, 63), (64, 96)),  # wide source, green centre columns -> 64 high x 96 wide
    ((64, 160), (0, 32, 63, 127), (96, 64)),  # tall source, green centre rows -> 96 high x 64 wide
])
def test_green_centre_band_exactly_fills_the_output(size, band, target):
    out = align_image(_banded(*size, band), *target)
    assert out.shape == (1, 3, 1, *target) and out.dtype == torch.float32
    expected = torch.tensor([0.0, 1.0, 0.0]).view(1, 3, 1, 1, 1).expand_as(out)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_cover_resize_never_stretches():
    """A circle in a 40x24 image must stay round after fitting to 32x32 (scale is the same on both axes)."""
    img = Image.new("RGB", (80, 48), (0, 0, 0))
    ImageDraw.Draw(img).ellipse((28, 12, 51, 35), fill=(255, 255, 255))  # 24x24 circle at the centre
    out = align_image(img.resize((40, 24), Image.NEAREST), 32, 32)[0, 0, 0]
    ys, xs = torch.nonzero(out > 0.5, as_tuple=True)
    height, width = int(ys.max() - ys.min() + 1), int(xs.max() - xs.min() + 1)
    assert abs(height - width) <= 1, (height, width)
    assert 0.0 <= float(out.min()) and float(out.max()) <= 1.0


def test_align_upscales_and_crops_to_target():
    out = align_image(Image.new("RGB", (40, 24), (10, 20, 30)), 48, 96)
    assert out.shape == (1, 3, 1, 48, 96)
    torch.testing.assert_close(out[0, :, 0, 0, 0], torch.tensor([10, 20, 30]) / 255.0)


def test_align_rejects_bad_input():
    with pytest.raises(TypeError):
        align_image(np.zeros((8, 8, 3), dtype=np.uint8), 16, 16)
    with pytest.raises(ValueError):
        align_image(Image.new("RGB", (8, 8)), 0, 16)


@pytest.mark.parametrize(("hw", "factor", "expected"), [
    ((64, 96), 32, (64, 96)),  # already on the grid and within bounds
    ((32, 32), 32, (64, 64)),  # below 4 * 32^2 pixels -> scaled up: beta = 2
    ((50, 70), 32, (64, 64)),  # rounded to the nearest multiples (64, 64)
    ((4096 * 2, 4096 * 2), 32, (4096, 4096)),  # above 16384 * 32^2 -> scaled down to the bound
])
def test_smart_resize(hw, factor, expected):
    assert smart_resize(*hw, factor) == expected


@pytest.mark.parametrize(("args", "gist"), [
    ((0, 32, 32), "positive"),
    ((32, 32 * 300, 32), "aspect ratio"),
])
def test_smart_resize_errors(args, gist):
    with pytest.raises(ValueError, match=gist):
        smart_resize(*args)
    with pytest.raises(ValueError, match="min_pixels"):
        smart_resize(64, 64, 32, min_pixels=10_000, max_pixels=100)


def test_vlm_image_matches_vae_input():
    src = Image.fromarray(np.random.default_rng(0).integers(0, 256, (70, 100, 3), dtype=np.uint8))
    pixels = align_image(src, 64, 96)
    pil = vlm_image(pixels, 32)
    assert pil.size == (96, 64)  # PIL size is (W, H)
    back = torch.from_numpy(np.asarray(pil, dtype=np.float32) / 255.0).permute(2, 0, 1)
    assert float((back - pixels[0, :, 0]).abs().max()) <= 1 / 255 + 1e-6


def test_apply_clean_prefix_writes_in_place():
    latents = torch.randn(2, 4, 3, 4, 4)
    before = latents.clone()
    clean = torch.randn(2, 4, 1, 4, 4)
    out = apply_clean_prefix(latents, clean)
    assert out is latents
    torch.testing.assert_close(latents[:, :, :1], clean, atol=0, rtol=0)
    torch.testing.assert_close(latents[:, :, 1:], before[:, :, 1:], atol=0, rtol=0)


@pytest.mark.parametrize(("latent", "clean", "gist"), [
    ((2, 4, 3, 4, 4), (1, 4, 1, 4, 4), "must match"),
    ((2, 4, 3, 4, 4), (2, 4, 1, 4, 2), "must match"),
    ((2, 4, 3, 4, 4), (2, 4, 4, 4, 4), "frames"),
    ((2, 4, 3, 4), (2, 4, 1, 4), "5-D"),
])
def test_apply_clean_prefix_errors(latent, clean, gist):
    with pytest.raises(ValueError, match=gist):
        apply_clean_prefix(torch.zeros(latent), torch.zeros(clean))


def test_load_image_from_path_keeps_size_and_converts(tmp_path):
    path = tmp_path / "grey.png"
    Image.new("L", (48, 32), 128).save(path)
    img = load_image(str(path))
    assert img.mode == "RGB" and img.size == (48, 32)
