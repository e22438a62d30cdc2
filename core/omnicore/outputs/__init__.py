"""Generation outputs and their writers (PNG/WebP/JPEG through Pillow, MP4 with AAC audio through PyAV).

Names load on first use so ``import omnicore.outputs`` stays cheap (PyAV and Pillow are imported lazily).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "Output": "omnicore.outputs.output",
    "EncodeOptions": "omnicore.outputs.options",
    "write_output": "omnicore.outputs.writers",
    "encode_output": "omnicore.outputs.writers",
    "SUPPORTED_SUFFIXES": "omnicore.outputs.writers",
    "write_mp4": "omnicore.outputs.mp4",
    "read_image": "omnicore.outputs.readers",
    "read_video": "omnicore.outputs.readers",
    "DecodedVideo": "omnicore.outputs.readers",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
