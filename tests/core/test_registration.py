"""``omnicore.plugin.model_plugin``: an entry module's ``plugin_info`` and registration hook, derived from its specs.

The three native model plugins and the diffusers adapter use it instead of the hand-written tail they each carried;
these tests hold it to what the host and the conformance kit expect of a hand-written one.
"""

from __future__ import annotations

import types

import pytest
from omnicore.hookspecs import PROJECT
from omnicore.plugin import ModelSpec, PresetSpec, model_plugin
from omnicore.plugin_host import INCOMPATIBLE, LOADED
from omnicore.testing.plugin import declared_registrations, isolated_host


def _spec(name: str, *presets: str) -> ModelSpec:
    return ModelSpec(name=name, impl=f"pkg_{name.replace('-', '_')}.pipeline:Pipe",
                     presets=tuple(PresetSpec(name=p, builder="pkg.presets:build") for p in presets))


def _entry_module(*specs: ModelSpec, api: str, version: str | None = None) -> types.ModuleType:
    """A module shaped like a plugin's ``plugin.py``: the two names assigned at module level."""
    module = types.ModuleType("pkg_entry")
    module.plugin_info, module.omnicore_register_models = model_plugin(*specs, api=api, version=version)
    return module


def test_plugin_info_is_derived_from_the_specs() -> None:
    one, two = _spec("alpha", "tiny:alpha", "tiny:alpha-big"), _spec("beta", "tiny:beta")
    info, _ = model_plugin(one, two, api=">=1.7,<2", version="3.1.4")
    assert info() == {"kind": "model", "api": ">=1.7,<2", "version": "3.1.4", "models": ["alpha", "beta"],
                      "presets": ["tiny:alpha", "tiny:alpha-big", "tiny:beta"]}
    bare, _ = model_plugin(one, api=">=1.0,<2")
    assert "version" not in bare()
    assert declared_registrations(info()) == {"model": ["alpha", "beta"]}


def test_the_hook_is_marked_and_registers_every_spec_in_order() -> None:
    one, two = _spec("alpha"), _spec("beta")
    _, hook = model_plugin(one, two, api=">=1.7,<2")
    assert getattr(hook, f"{PROJECT}_impl", None) is not None  # pluggy finds it only when marked
    seen: list[ModelSpec] = []
    hook(seen.append)
    assert seen == [one, two]


def test_a_host_loads_the_module_and_records_the_derived_info() -> None:
    spec = _spec("alpha", "tiny:alpha")
    module = _entry_module(spec, api=">=1.7,<2", version="0.2.0")
    host = isolated_host()
    record = host.add_plugin(module, "alpha_plugin")
    assert record.status == LOADED, record.error
    assert record.registered == {"model": ["alpha"]}
    assert record.info == module.plugin_info()
    assert host.models.get("alpha").provider == "alpha_plugin"


def test_the_api_range_is_still_checked_before_registration() -> None:
    record = isolated_host().add_plugin(_entry_module(_spec("alpha"), api=">=99,<100"), "future")
    assert record.status == INCOMPATIBLE and ">=99,<100" in (record.error or "")
    assert record.registered == {}


@pytest.mark.parametrize(("args", "kwargs", "error"), [
    ((), {"api": ">=1.7,<2"}, ValueError),
    (("alpha",), {"api": ">=1.7,<2"}, TypeError),
    ((None,), {"api": ">=1.7,<2"}, TypeError),
])
def test_refuses_what_is_not_a_list_of_specs(args: tuple[object, ...], kwargs: dict[str, str],
                                            error: type[Exception]) -> None:
    with pytest.raises(error, match="model_plugin"):
        model_plugin(*args, **kwargs)  # type: ignore[arg-type]


def test_refuses_an_empty_api_range() -> None:
    with pytest.raises(ValueError, match="version range"):
        model_plugin(_spec("alpha"), api=" ")
