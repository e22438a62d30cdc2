"""The core's size parsers: ``"WIDTHxHEIGHT"`` image sizes, returning ``(width, height)`` in that order, and byte
sizes (``"24GiB"``) for memory budgets and limits.

The HTTP server and the LingBot request rules each had a ``parse_size``, one returning ``(width, height)`` and the
other ``(height, width)``: a caller reading the wrong one swaps the sides of every non-square request. This is the
only one; its name says the order.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ConfigError, InvalidRequest

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

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


def parse_bytes(name: str, value: Any) -> int | None:
    """``"24GiB"``, ``"1.5G"``, ``"800MB"`` or a plain byte count -> bytes; ``None``/``""`` -> ``None`` (unset).

    Decimal units (``G`` = 10^9) and binary ones (``GiB`` = 2^30) as written; a bad value is a ``ConfigError``
    naming ``name`` and the accepted forms."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise ConfigError(name, f"must be a size such as 24GiB, 1.5G or 800MB, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = _BYTES.match(str(value))
        if m is None or m.group(2).lower() not in _UNITS:
            raise ConfigError(name, f"must be a size such as 24GiB, 1.5G or 800MB (units B, K/KB, M/MB, G/GB, "
                                    f"T/TB, KiB, MiB, GiB, TiB), got {value!r}")
        number, unit = float(m.group(1)), m.group(2).lower()
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ConfigError(name, f"must be more than 0 bytes, got {value!r}")
    return size


def format_bytes(n: int) -> str:
    """``1610612736`` -> ``"1.50 GiB"`` (for messages)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover
