"""Compatibility checks on plugin metadata.

Before import: the distribution's ``Requires-Dist`` on ``omnicore`` must admit the running core. After import:
the ``plugin_info()["api"]`` range must admit :data:`omnicore.PLUGIN_API_VERSION`. ``packaging`` is imported
only when a check has something to parse, so listing plugins stays cheap.
"""

from __future__ import annotations

import re
from typing import Protocol

from .._version import PLUGIN_API_VERSION, __version__


def core_version() -> str:
    return __version__


def normalise(name: str) -> str:
    """PEP 503 normalisation, so ``omni_plugin_x``, ``Omni-Plugin-X`` and ``omni.plugin.x`` compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


class _Distribution(Protocol):
    """What the checks read of an ``importlib_metadata.Distribution``."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...


def dist_name_version(ep: object) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    return (dist.name, dist.version) if dist is not None else (None, None)


#: what ``EntryPoint.load`` accepts: ``module.path`` or ``module.path:attr.path`` (optionally with ``[extras]``)
EP_VALUE = re.compile(r"^\s*[A-Za-z_][\w.]*\s*(:\s*[A-Za-z_][\w.]*\s*)?(\[[^\]]*\])?\s*$")
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def core_requirement_conflict(dist: _Distribution | None) -> str | None:
    """Why ``dist``'s ``Requires-Dist`` on ``omnicore`` excludes the running core (``None`` when it admits it
    or says nothing). Read from metadata only, before anything of the plugin is imported."""
    requires = getattr(dist, "requires", None) or []
    ours = [r for r in requires if (m := _REQ_NAME.match(r)) and normalise(m.group(1)) == "omnicore"]
    if dist is None or not ours:
        return None
    from packaging.requirements import InvalidRequirement, Requirement

    core = core_version()
    for text in ours:
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return f"{dist.name} {dist.version} declares an unparsable requirement {text!r}: {reason}"
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # applies only with an extra or on another platform
        if not req.specifier.contains(core, prereleases=True):
            return f"{dist.name} {dist.version} requires {req} but this core is omnicore {core}; not imported"
    return None


def api_mismatch(api: object) -> str | None:
    """Why a ``plugin_info()["api"]`` range excludes this core's plugin API (``None`` when absent or admitted)."""
    if api is None:
        return None
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        admitted = PLUGIN_API_VERSION in SpecifierSet(str(api))
    except InvalidSpecifier:
        return f"plugin_info()['api'] = {api!r} is not a version range such as '>=1.0,<2'"
    if not admitted:
        return f"plugin_info()['api'] = {api!r} does not admit this core's plugin API {PLUGIN_API_VERSION}"
    return None
