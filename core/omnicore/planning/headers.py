"""The safetensors header reader: the only bytes of a weight file a plan ever reads, counted so a test can prove
it. A leaf module, so both the local source and the Hub mirror use it without importing each other."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import attrs

from ..errors import InvalidRequest

#: a header above this is refused as implausible (the largest real checkpoints' headers are a few MB)
MAX_HEADER = 100 * 1024 * 1024


@attrs.define
class ByteCounter:
    """Bytes read from weight files (the test that a plan reads headers only checks this)."""

    read: int = 0
    files: int = 0


def read_safetensors_header(path: Path, counter: ByteCounter | None = None) -> dict[str, Any]:
    """The JSON header of a safetensors file: 8 bytes of length, then the header; never the tensor data."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise InvalidRequest("model", f"{path}: not a safetensors file (shorter than 8 bytes)")
        (size,) = struct.unpack("<Q", head)
        if size > MAX_HEADER:
            raise InvalidRequest("model", f"{path}: safetensors header of {size} bytes is implausibly large")
        raw = f.read(size)
    if counter is not None:
        counter.read += 8 + len(raw)
        counter.files += 1
    data = json.loads(raw)
    data.pop("__metadata__", None)
    return dict(data)
