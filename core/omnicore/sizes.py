"""One parser for ``"WIDTHxHEIGHT"`` size strings, returning ``(width, height)`` in that order.

The HTTP server and the LingBot request rules each had a ``parse_size``, one returning ``(width, height)`` and the
other ``(height, width)``: a caller reading the wrong one swaps the sides of every non-square request. This is the
only one; its name says the order.
"""

from __future__ import annotations

import re

from .errors import InvalidRequest

#: ``832x480``, ``832X480``, ``832×480``, ``832*480``, spaces around the parts allowed
_SIZE = re.compile(r"^\s*(\d+)\s*[xX×*]\s*(\d+)\s*$")


def parse_size_wh(value: object, field: str = "size", *, minimum: int = 1) -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` -> ``(width, height)``; anything else, or a side below ``minimum``, is an
    :class:`InvalidRequest` naming ``field``."""
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise InvalidRequest(field, f"must be a 'WIDTHxHEIGHT' string such as '832x480', got {value!r}")
    width, height = int(match.group(1)), int(match.group(2))
    if width < minimum or height < minimum:
        raise InvalidRequest(field, f"each side must be at least {minimum}, got {width}x{height}")
    return width, height
