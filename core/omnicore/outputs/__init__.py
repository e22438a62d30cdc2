"""Generation outputs and their writers (PNG/WebP/JPEG through Pillow, MP4 with AAC audio through PyAV).

Names load on first use so ``import omnicore.outputs`` stays cheap (PyAV and Pillow are imported lazily).
"""

from __future__ import annotations

from typing import Any

from .._lazy import lazy_getattr

_LAZY = {
    "Output": "omnicore.outputs.output:Output",
    "EncodeOptions": "omnicore.outputs.options:EncodeOptions",
    "write_output": "omnicore.outputs.writers:write_output",
    "encode_output": "omnicore.outputs.writers:encode_output",
    "SUPPORTED_SUFFIXES": "omnicore.outputs.writers:SUPPORTED_SUFFIXES",
    "write_mp4": "omnicore.outputs.mp4:write_mp4",
    "read_image": "omnicore.outputs.readers:read_image",
    "read_video": "omnicore.outputs.readers:read_video",
    "DecodedVideo": "omnicore.outputs.readers:DecodedVideo",
}

__all__ = sorted(_LAZY)

_lazy_attr = lazy_getattr(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    return _lazy_attr(name)
