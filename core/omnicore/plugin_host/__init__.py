"""Plugin discovery and registries. See :class:`PluginHost`."""

from .host import BUILTIN_NAME, ENTRY_POINT_GROUP, PluginHost, default_host, reset_default_host
from .records import DISABLED, FAILED, INCOMPATIBLE, LOADED, PluginRecord

__all__ = [
    "BUILTIN_NAME", "DISABLED", "ENTRY_POINT_GROUP", "FAILED", "INCOMPATIBLE", "LOADED",
    "PluginHost", "PluginRecord", "default_host", "reset_default_host",
]
