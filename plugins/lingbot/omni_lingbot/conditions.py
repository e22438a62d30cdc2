"""Image-to-video conditioning.

The reference image is fitted to the output geometry without distortion (cover-resize, then centre crop); the
same pixels feed both the VAE (clean first latent frame) and the text encoder's vision tower (after a Qwen-VL
smart resize). The clean latent prefix is re-written into the noisy latents around every model call.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omnicore.plugin import InvalidRequest
from PIL import Image


def align_image(image: Any, height: int, width: int) -> torch.Tensor:
    """Cover-resize ``image`` (bilinear, no corner alignment) and centre-crop to ``height × width``.

    Returns float32 ``[1, 3, 1, H, W]`` in [0, 1]. The scale is the larger of the two side ratios and each
    side is ``max(ceil(old * scale), target)``, so the crop never needs to stretch.
    """
    if not isinstance(image, Image.Image):
        raise TypeError(f"align_image expects a PIL image, got {type(image).__name__}")
    if height <= 0 or width <= 0:
        raise ValueError(f"target size must be positive, got {height}x{width}")
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    pixels = torch.from_numpy(rgb).permute(2, 0, 1)[None]  # [1, 3, h0, w0]
    h0, w0 = pixels.shape[-2:]
    scale = max(height / h0, width / w0)
    nh, nw = max(math.ceil(h0 * scale), height), max(math.ceil(w0 * scale), width)
    if (nh, nw) != (h0, w0):
        pixels = F.interpolate(pixels, size=(nh, nw), mode="bilinear", align_corners=False)
    top, left = round((nh - height) / 2), round((nw - width) / 2)
    pixels = pixels[..., top:top + height, left:left + width].clamp(0.0, 1.0)
    return pixels.unsqueeze(2).contiguous()


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int | None = None, max_pixels: int | None = None,
    max_ratio: float = 200.0,
) -> tuple[int, int]:
    """Qwen-VL style: sides rounded to multiples of ``factor``, area kept in ``[min_pixels, max_pixels]``
    (defaults 4·factor² and 16384·factor²), aspect ratio below ``max_ratio``. Returns ``(height, width)``."""
    min_pixels = 4 * factor * factor if min_pixels is None else min_pixels
    max_pixels = 16384 * factor * factor if max_pixels is None else max_pixels
    if height <= 0 or width <= 0:
        raise ValueError(f"image sides must be positive, got {height}x{width}")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) must not exceed max_pixels ({max_pixels})")
    if max(height, width) / min(height, width) >= max_ratio:
        raise ValueError(f"aspect ratio must be below {max_ratio}, got {max(height, width) / min(height, width):.1f}")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_pil(pixels: torch.Tensor) -> Image.Image:
    """``[1, 3, 1, H, W]`` (or ``[3, H, W]``) in [0, 1] → RGB PIL image."""
    chw = pixels.reshape(3, *pixels.shape[-2:])
    hwc = (chw.clamp(0, 1) * 255.0).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(hwc, mode="RGB")


def vlm_image(pixels: torch.Tensor, factor: int) -> Image.Image:
    """The aligned pixels as the vision tower sees them: PIL, smart-resized to multiples of ``factor``."""
    img = to_pil(pixels)
    h, w = smart_resize(img.height, img.width, factor)
    return img if (h, w) == (img.height, img.width) else img.resize((w, h), Image.Resampling.BICUBIC)


def apply_clean_prefix(latents: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
    """Write ``clean`` into the first latent frames of ``latents`` in place and return ``latents``."""
    if latents.dim() != 5 or clean.dim() != 5:
        raise ValueError(f"latents and clean prefix must be 5-D [B, C, T, H, W], got {tuple(latents.shape)} "
                         f"and {tuple(clean.shape)}")
    b, c, t, h, w = latents.shape
    if (clean.shape[0], clean.shape[1], clean.shape[3], clean.shape[4]) != (b, c, h, w):
        raise ValueError(f"clean prefix shape must match the latents in B, C, H, W: {tuple(clean.shape)} vs "
                         f"{tuple(latents.shape)}")
    if clean.shape[2] > t:
        raise ValueError(f"clean prefix has {clean.shape[2]} frames but the latents only {t}")
    latents[:, :, : clean.shape[2]] = clean.to(latents.dtype)
    return latents


def load_image(value: Any, index: int = 0) -> Image.Image:
    """A reference image as RGB PIL, keeping its size; paths are opened here (once, at admission)."""
    field = f"images[{index}]"
    if isinstance(value, Image.Image):
        return value if value.mode == "RGB" else value.convert("RGB")
    if isinstance(value, (str, bytes)) or hasattr(value, "__fspath__"):
        try:
            with Image.open(value) as img:
                img.load()
                return img.convert("RGB")
        except (OSError, ValueError) as exc:
            raise InvalidRequest(field, f"could not read the image: {exc}") from None
    raise InvalidRequest(field, f"must be a PIL image or a file path, got {type(value).__name__}")
