"""The one id helper: ``<prefix>_`` + 26 URL-safe characters, time-sortable and unguessable.

Used for engine request ids (``req_``), HTTP request ids (``req_``, when the client sent no ``X-Request-Id``)
and server job ids (``img_``, ``video_``).
"""

from __future__ import annotations

import secrets
import time

#: Crockford's base32 alphabet (no i, l, o, u), lower case.
ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"


def new_id(prefix: str) -> str:
    """``<prefix>_`` + 10 characters of millisecond time (so ids sort by creation) + 16 random ones (80 bits)."""
    ms = int(time.time() * 1000)
    head = "".join(ALPHABET[(ms >> (5 * i)) & 31] for i in reversed(range(10)))
    tail = "".join(secrets.choice(ALPHABET) for _ in range(16))
    return f"{prefix}_{head}{tail}"
