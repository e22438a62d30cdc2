"""Conditioning media from clients: uploaded files and data URLs, decoded safely (serving-api.md §7.2).

Formats are recognised by magic bytes, never by file name. Decoding is capped by pixel count before any
pixel data is read, which also stops decompression bombs.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any

from .errors import ApiError

_MAGIC = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpeg"))


def sniff(data: bytes) -> str | None:
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return None


def decode_image(data: bytes, *, param: str, max_pixels: int) -> Any:
    """Bytes -> RGB ``PIL.Image``; 415 for an unaccepted format, 400 for broken or oversized images."""
    from PIL import Image

    if sniff(data) is None:
        raise ApiError(415, "unsupported_media_type", f"{param}: not a PNG, JPEG or WebP image", param=param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > max_pixels:
                raise ApiError(400, "image_too_large", f"{param}: {w}x{h} has more than {max_pixels} pixels",
                               param=param)
            img.load()
    except ApiError:
        raise
    except Exception as exc:  # PIL raises many types for broken data
        raise ApiError(400, "invalid_media", f"{param}: cannot decode image ({type(exc).__name__})",
                       param=param) from None
    return img.convert("RGB")


def decode_data_url(url: str, *, param: str) -> bytes:
    """``data:<mime>;base64,<payload>`` -> bytes. Remote URLs are not fetched (no ``--allow-remote-media``)."""
    if url.startswith(("http://", "https://")):
        raise ApiError(400, "unsupported_parameter",
                       f"{param}: remote media URLs are disabled on this server; send a data URL or a file",
                       param=param)
    if not url.startswith("data:") or "," not in url:
        raise ApiError(400, "invalid_media", f"{param}: expected a data URL (data:image/png;base64,...)",
                       param=param)
    header, payload = url[5:].split(",", 1)
    if not header.endswith(";base64"):
        raise ApiError(400, "invalid_media", f"{param}: only base64 data URLs are accepted", param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "invalid_media", f"{param}: the data URL is not valid base64", param=param) from None
