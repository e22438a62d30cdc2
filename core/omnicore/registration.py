"""The entry module of a model plugin, derived from its specs: ``plugin_info`` and ``omnicore_register_models``.

Every model plugin ended its entry module with the same lines: a ``plugin_info()`` restating the kind, the
version, the spec's name and its presets, and a hook registering the spec. Written by hand, the two drift apart
(the conformance kit then fails on a renamed preset); derived from the specs they cannot, and a plugin declares
only what the core cannot know, the plugin-API range it was written against::

    plugin_info, omnicore_register_models = model_plugin(MODEL_SPEC, api=">=1.7,<2", version=__version__)

Cheap to import (records only, no torch), like the entry modules that call it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .hookspecs import hookimpl
from .specs import ModelSpec

#: what ``plugin_info`` is: the host calls it before registering anything (the ``api`` range is checked first)
PluginInfo = Callable[[], dict[str, Any]]
#: the ``omnicore_register_models`` hook: called once per host with the ``register`` callback
RegisterModels = Callable[[Callable[[ModelSpec], None]], None]


def model_plugin(*specs: ModelSpec, api: str, version: str | None = None) -> tuple[PluginInfo, RegisterModels]:
    """``(plugin_info, omnicore_register_models)`` for an entry module that registers ``specs``.

    ``plugin_info()`` returns ``kind="model"``, ``api``, the spec names (``models``), their presets' names
    (``presets``) and ``version`` when given; the hook (marked with :data:`omnicore.hookimpl`) registers each spec
    in order. Assign both at module level under exactly these names: the host finds hooks by attribute name.
    """
    if not specs:
        raise ValueError("model_plugin() needs at least one ModelSpec")
    for spec in specs:
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"model_plugin() takes ModelSpec records, got {type(spec).__name__}")
    if not isinstance(api, str) or not api.strip():
        raise ValueError("model_plugin(api=...) must be a version range such as '>=1.7,<2'")
    registered = tuple(specs)

    def plugin_info() -> dict[str, Any]:
        info: dict[str, Any] = {"kind": "model", "api": api, "models": [s.name for s in registered],
                                "presets": [p.name for s in registered for p in s.presets]}
        if version is not None:
            info["version"] = version
        return info

    @hookimpl
    def omnicore_register_models(register: Callable[[ModelSpec], None]) -> None:
        for spec in registered:
            register(spec)

    return plugin_info, omnicore_register_models
