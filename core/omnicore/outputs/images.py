"""Still-image encoding through Pillow: PNG (lossless), WebP (lossy or lossless) and JPEG."""

from __future__ import annotations

import io
from typing import BinaryIO

import numpy as np
from PIL import Image

from .options import DEFAULT_OPTIONS, EncodeOptions

IMAGE_FORMATS = ("png", "webp", "jpeg")


def encode_image(frame: np.ndarray, fmt: str, options: EncodeOptions = DEFAULT_OPTIONS) -> bytes:
    """Encode one uint8 ``[H, W, 3]`` RGB frame as ``fmt`` (one of :data:`IMAGE_FORMATS`)."""
    buf = io.BytesIO()
    save_image(frame, fmt, buf, options)
    return buf.getvalue()


def save_image(frame: np.ndarray, fmt: str, buf: BinaryIO, options: EncodeOptions = DEFAULT_OPTIONS) -> None:
    """Like :func:`encode_image` but streams into an open binary file (no extra copy of the encoded bytes)."""
    image = Image.fromarray(np.ascontiguousarray(frame))
    if fmt == "png":
        image.save(buf, format="PNG", compress_level=options.png_compress_level)
    elif fmt == "webp":
        if options.webp_lossless:
            # exact keeps every RGB value; (Pillow reads quality as compression effort when lossless.)
            image.save(buf, format="WEBP", lossless=True, exact=True)
        else:
            image.save(buf, format="WEBP", quality=options.image_quality)
    elif fmt == "jpeg":
        image.save(buf, format="JPEG", quality=options.image_quality)
    else:  # callers dispatch on IMAGE_FORMATS; reaching this is a bug, not bad input
        raise AssertionError(f"unknown image format {fmt!r}")
