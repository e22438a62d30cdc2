"""omnicore: plugin-based serving of diffusion models.

Importing ``omnicore`` is cheap (no torch). The engine, requests and outputs are loaded on first use.
"""

from __future__ import annotations

from typing import Any

from ._lazy import lazy_getattr
from ._version import PLUGIN_API_VERSION, __version__
from .hookspecs import hookimpl

_LAZY = {
    "Engine": "omnicore.engine.api:Engine",
    "AsyncEngine": "omnicore.engine.api:AsyncEngine",
    "GenerationRequest": "omnicore.engine.request:GenerationRequest",
    "SamplingParams": "omnicore.engine.request:SamplingParams",
    "MediaInput": "omnicore.engine.request:MediaInput",
    "LoRA": "omnicore.lora.records:LoRA",
    "Output": "omnicore.outputs.output:Output",
    "ModelPool": "omnicore.pool.pool:ModelPool",  # several engines under one memory budget
    "ModelEntry": "omnicore.pool.entries:ModelEntry",
}


_lazy_attr = lazy_getattr(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    return _lazy_attr(name)


__all__ = ["PLUGIN_API_VERSION", "__version__", "hookimpl", *_LAZY]
