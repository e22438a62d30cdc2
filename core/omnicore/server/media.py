"""Conditioning media from clients: uploaded files and data URLs, decoded safely.

Formats are recognised by magic bytes, never by file name. Decoding is capped by pixel count before any
pixel data is read, which also stops decompression bombs.
"""

from __future__ import annotations

import base64
import binascii
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .errors import ApiError

if TYPE_CHECKING:
    from PIL import Image

    from .settings import ServerSettings

#: the image formats the HTTP API accepts in uploads; the core's one magic-byte table (``omnicore.media``) knows GIF
#: and BMP as well, which the CLI reads but the API refuses (415)
ACCEPTED_IMAGE_FORMATS = ("png", "jpeg", "webp")


def sniff(data: bytes) -> str | None:
    """The format of an uploaded image when the API accepts it, else ``None`` (read from the magic bytes)."""
    from ..media import image_format

    found = image_format(data[:16])
    return found if found in ACCEPTED_IMAGE_FORMATS else None


def decode_image(data: bytes, *, param: str, max_pixels: int) -> Image.Image:
    """Bytes -> RGB ``PIL.Image``; 415 for an unaccepted format, 400 ``image_too_large`` when the header's size is
    over ``max_pixels`` (read before any pixel is decoded, and the only cap: Pillow's own decompression-bomb limit
    plays no part), 400 ``invalid_media`` for broken images."""
    from ..errors import InvalidRequest
    from ..media import read_image_input

    if sniff(data) is None:
        raise ApiError(415, "unsupported_media_type", f"{param}: not a PNG, JPEG or WebP image", param=param)
    try:
        return read_image_input(data, field=param, max_pixels=max_pixels)
    except InvalidRequest as exc:
        code = "image_too_large" if exc.code == "image_too_large" else "invalid_media"
        raise ApiError(400, code, f"{param}: {exc.rule}", param=param) from None


class DecodeBudget:
    """The server-wide bound on decoded conditioning media (``--max-decode-bytes``).

    A request reserves the bytes its uploads will decode to (estimated from their headers) *before* decoding;
    the reservation moves onto the decoded objects and is returned when the last of them is garbage-collected
    (the job finished and dropped its inputs), so media held by queued jobs counts too. More than the whole
    budget in one request is 400; more than what is left now is 429 (retry when jobs finish).
    """

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.used = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, *, param: str) -> int:
        """Take ``nbytes`` (returns it, to :meth:`release` or :meth:`hold`); 400/429 when it does not fit."""
        if self.limit <= 0 or nbytes <= 0:
            return 0
        if nbytes > self.limit:
            raise ApiError(400, "decode_too_large", f"{param}: the conditioning media decode to about "
                                                    f"{_mb(nbytes)}, more than this server's --max-decode-bytes "
                                                    f"({_mb(self.limit)})", param=param)
        if self._take(nbytes):
            return nbytes
        import gc

        gc.collect()  # finished jobs whose inputs sit in reference cycles give their share back now
        if not self._take(nbytes):
            with self._lock:
                left = self.limit - self.used
                raise ApiError(429, "decode_budget_exhausted",
                               f"{param}: the conditioning media decode to about {_mb(nbytes)} but only "
                               f"{_mb(left)} of --max-decode-bytes is free (queued jobs hold the rest); retry "
                               f"later", param=param, headers={"Retry-After": "5"})
        return nbytes

    def _take(self, nbytes: int) -> bool:
        with self._lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def force(self, nbytes: int) -> int:
        """Take ``nbytes`` even beyond the limit (inputs of an already accepted job); returns it like reserve."""
        if self.limit <= 0 or nbytes <= 0:
            return 0
        with self._lock:
            self.used += nbytes
        return nbytes

    def release(self, nbytes: int) -> None:
        if nbytes:
            with self._lock:
                self.used = max(0, self.used - nbytes)

    def hold(self, objects: Sequence[object], nbytes: int) -> None:
        """Keep ``nbytes`` reserved until every one of ``objects`` is garbage-collected."""
        if not nbytes:
            return
        alive = [o for o in objects if _weakrefable(o)]
        if not alive:
            self.release(nbytes)
            return
        left = [len(alive)]
        lock = threading.Lock()

        def gone() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.release(nbytes)

        for o in alive:
            weakref.finalize(o, gone)


_BUDGETS: dict[int, tuple[object, DecodeBudget]] = {}
_BUDGETS_LOCK = threading.Lock()


def budget_for(settings: ServerSettings) -> DecodeBudget:
    """The one :class:`DecodeBudget` of a server (keyed by its settings object, which lives as long as it)."""
    with _BUDGETS_LOCK:
        entry = _BUDGETS.get(id(settings))
        if entry is None or entry[0] is not settings:
            entry = (settings, DecodeBudget(getattr(settings, "max_decode_bytes", 0)))
            _BUDGETS[id(settings)] = entry
        return entry[1]


def decode_images(raw: list[bytes], *, param: str, settings: ServerSettings) -> list[Image.Image]:
    """Several uploaded images (``/v1/images/edits``): every header checked first (415 / ``image_too_large``),
    their RGB size reserved in the server's ``--max-decode-bytes`` budget (400/429), then decoded (CPU work:
    call from a thread); the share is returned when the decoded images are garbage-collected."""
    from ..errors import InvalidRequest
    from ..media import open_image

    max_px = settings.max_input_image_pixels
    total = 0
    for data in raw:
        if sniff(data) is None:
            raise ApiError(415, "unsupported_media_type", f"{param}: not a PNG, JPEG or WebP image", param=param)
        try:
            with open_image(data, field=param, max_pixels=max_px) as img:
                total += img.size[0] * img.size[1] * 3
        except InvalidRequest as exc:
            code = "image_too_large" if exc.code == "image_too_large" else "invalid_media"
            raise ApiError(400, code, f"{param}: {exc.rule}", param=param) from None
    budget = budget_for(settings)
    reserved = budget.reserve(total, param=param)
    try:
        images = [decode_image(data, param=param, max_pixels=max_px) for data in raw]
    except BaseException:
        budget.release(reserved)
        raise
    budget.hold(images, reserved)
    return images


def _weakrefable(o: object) -> bool:
    try:
        weakref.ref(o)
    except TypeError:
        return False
    return True


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n} bytes"


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
