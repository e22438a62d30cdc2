"""Release version and the plugin-API version (they move independently)."""

__version__ = "0.1.0"

#: Version of the plugin contract (hookspecs, spec records, ``omnicore.testing``). Plugins declare a
#: compatible range in ``plugin_info()``; it changes only when that contract changes.
PLUGIN_API_VERSION = "1.7"
