"""Conformance kit for omnicore plugins (a pytest plugin, entry point ``pytest11``).

Subclass a base class in your plugin's tests and set a few attributes; see ``README.md`` next to this file.
Importing this package is cheap: torch is imported only inside the checks that need it.
"""

from __future__ import annotations

from typing import Any

from .._lazy import lazy_getattr

_LAZY = {
    "PluginConformance": "omnicore.testing.plugin:PluginConformance",
    "AttentionBackendConformance": "omnicore.testing.attention:AttentionBackendConformance",
    "ModelPluginConformance": "omnicore.testing.model:ModelPluginConformance",
    "PlatformConformance": "omnicore.testing.platform:PlatformConformance",
    "CacheMethodConformance": "omnicore.testing.cache:CacheMethodConformance",
    "PlatformOpConformance": "omnicore.testing.ops:PlatformOpConformance",
    "isolated_host": "omnicore.testing.plugin:isolated_host",
    "add_loaded": "omnicore.testing.plugin:add_loaded",
    "check_step_checkpoints": "omnicore.testing.step_checkpoint:check_step_checkpoints",
}


_lazy_attr = lazy_getattr(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    return _lazy_attr(name)


__all__ = list(_LAZY)
