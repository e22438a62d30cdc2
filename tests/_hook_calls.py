"""pytest plugin (``-p _hook_calls``) recording which omnicore hooks each test really gets called.

Used by ``test_meta.py::test_every_hook_is_really_called_by_a_test``: a hook counts for a test when the plugin
host invoked it, during that test, with an implementation from a plugin other than the core's built-in one (so a
test's own plugin code ran). Pipeline hooks are seen through pluggy's call monitoring; registration hooks are
called one implementation at a time by the host, so ``_run_registration`` is wrapped. The result is written as
JSON ``{nodeid: [hook, ...]}`` to the path in ``OMNICORE_HOOK_CALLS``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from omnicore.plugin_host import host as host_module

CALLS: dict[str, set[str]] = {}
_current: list[str] = []


def _record(hook_name: str, plugin_names: list[str]) -> None:
    if _current and any(name != host_module.BUILTIN_NAME for name in plugin_names):
        CALLS.setdefault(_current[-1], set()).add(hook_name)


_original_init = host_module.PluginHost.__init__
_original_registration = host_module.PluginHost._run_registration


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    self.pm.add_hookcall_monitoring(
        lambda hook_name, impls, kwargs: _record(hook_name, [impl.plugin_name for impl in impls]),
        lambda outcome, hook_name, impls, kwargs: None)


def _registration(self: Any, plugin: object, record: Any) -> None:
    for hook_name in host_module._REGISTRATION_KINDS:
        if any(impl.plugin is plugin for impl in getattr(self.pm.hook, hook_name).get_hookimpls()):
            _record(hook_name, [record.name])
    _original_registration(self, plugin, record)


host_module.PluginHost.__init__ = _init  # type: ignore[method-assign]
host_module.PluginHost._run_registration = _registration  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    _current.append(item.nodeid)
    try:
        return (yield)
    finally:
        _current.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:  # fixtures build hosts and run registrations too
    _current.append(item.nodeid)
    try:
        return (yield)
    finally:
        _current.pop()


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("OMNICORE_HOOK_CALLS")
    if path:
        with open(path, "w") as fh:
            json.dump({k: sorted(v) for k, v in CALLS.items()}, fh)
