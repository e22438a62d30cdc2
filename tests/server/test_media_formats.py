"""The server's image formats come from the core's one magic-byte table (``omnicore.media.image_format``).

There were two tables that disagreed (the core's knew GIF and BMP, the server's did not); the server now keeps only
the list of formats its API accepts and reads the format with the core's function.
"""

from __future__ import annotations

import io

import pytest
from omnicore.media import image_format
from omnicore.server.media import ACCEPTED_IMAGE_FORMATS, sniff
from PIL import Image


def _encoded(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (10, 20, 30)).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize(("pil_format", "name"), [("PNG", "png"), ("JPEG", "jpeg"), ("WEBP", "webp"),
                                                  ("GIF", "gif"), ("BMP", "bmp")])
def test_the_server_accepts_what_the_core_recognises_and_the_api_lists(pil_format: str, name: str) -> None:
    data = _encoded(pil_format)
    assert image_format(data) == name  # one table knows every format
    assert sniff(data) == (name if name in ACCEPTED_IMAGE_FORMATS else None)


def test_the_api_lists_png_jpeg_webp_and_refuses_the_rest() -> None:
    assert ACCEPTED_IMAGE_FORMATS == ("png", "jpeg", "webp")
    assert sniff(b"GIF89a....") is None and sniff(b"not an image") is None and sniff(b"") is None
