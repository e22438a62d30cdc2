"""What the host knows about each plugin, for ``omnicore plugins`` and for error reports."""

from __future__ import annotations

import attrs

LOADED = "loaded"
FAILED = "failed"
DISABLED = "disabled"
INCOMPATIBLE = "incompatible"


@attrs.define
class PluginRecord:
    """One plugin (an entry point of group ``omnicore``, or the core's built-in plugin)."""

    name: str
    dist: str | None = None
    version: str | None = None
    value: str | None = None  # the entry point's target, e.g. "omni_lingbot.plugin"
    status: str = LOADED
    error: str | None = None  # one line; ``traceback`` has the detail
    traceback: str | None = None
    import_s: float = 0.0
    registered: dict[str, list[str]] = attrs.Factory(dict)  # kind -> names
    hooks: list[str] = attrs.Factory(list)
    info: dict[str, object] | None = None  # what the module's plugin_info() returned

    def to_json(self) -> dict[str, object]:
        data = attrs.asdict(self)
        data["import_ms"] = round(self.import_s * 1000.0, 3)
        del data["import_s"]
        return data
