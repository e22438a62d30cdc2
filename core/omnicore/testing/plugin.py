"""Checks every plugin passes, whatever it registers: :class:`PluginConformance`.

A plugin's test module subclasses it and names its entry-point target::

    class TestMine(PluginConformance):
        plugin_module = "omni_lingbot.plugin"
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from .. import hookspecs
from ..config import Settings
from ..plugin_host._compat import api_mismatch
from ..plugin_host.host import PluginHost
from ..plugin_host.records import LOADED, PluginRecord
from ..specs import SPEC_KINDS, resolve
from .imports import internal_imports

HEAVY_MODULES = ("torch", "diffusers", "transformers")
REGISTRY_KINDS = tuple(SPEC_KINDS)  # model, platform, attention_backend, cache_method, op
_KNOWN_HOOKS = frozenset(name for name in dir(hookspecs) if name.startswith("omnicore_"))
_LAZY_FIELDS = ("impl", "probe", "detect", "applies")


def isolated_host(settings: Settings | None = None) -> PluginHost:
    """A host with only the core's built-ins: no entry points, settings from defaults (never the environment)."""
    return PluginHost(settings if settings is not None else Settings(), autoload=False)


def load_plugin_object(target: str) -> object:
    """What an entry point ``target`` (``"module"`` or ``"module:attr"``) registers; classes are instantiated."""
    obj = resolve(target) if ":" in target else importlib.import_module(target)
    return obj() if inspect.isclass(obj) else obj


def add_to_host(host: PluginHost, target: str, name: str) -> PluginRecord:
    """Register ``target`` under ``name`` (or find its record when it is already registered, e.g. built-ins)."""
    obj = load_plugin_object(target)
    registered = host.pm.get_name(obj) if host.pm.is_registered(obj) else None
    if registered is None and name in host.records:
        # The same module registered as another object: an earlier test re-imported it (sys.modules purge).
        same = getattr(host.pm.get_plugin(name), "__name__", None) == getattr(obj, "__name__", object())
        registered = name if same else None
    if registered is not None:
        return host.records[registered]
    return host.add_plugin(obj, name, value=target)


def default_plugin_name(target: str) -> str:
    """The name the kits register ``target`` under by default: its top-level package."""
    return target.split(":")[0].split(".")[0]


def add_loaded(host: PluginHost, target: str, name: str | None = None) -> PluginRecord:
    """:func:`add_to_host` under ``name`` (default :func:`default_plugin_name`), asserting that the plugin loaded."""
    record = add_to_host(host, target, name or default_plugin_name(target))
    assert record.status == "loaded", f"{record.name}: {record.error}\n{record.traceback}"
    return record


def _run_fresh(code: str, timeout: float = 120.0) -> Any:
    """Run ``code`` in a fresh interpreter that can import what this one can; return its last line as JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"a fresh interpreter running\n{code}\nfailed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def heavy_modules_after_import(target: str, heavy: tuple[str, ...] = HEAVY_MODULES) -> list[str]:
    """Import ``target``'s module in a fresh interpreter; return the heavy top-level packages it pulled in."""
    module = target.partition(":")[0]
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(heavy)!r}))))\n"
    )
    return list(_run_fresh(code))


def declared_registrations(info: dict[str, Any]) -> dict[str, list[str]]:
    """What ``plugin_info()`` says the plugin registers: a ``registers`` mapping (kind -> names) and/or
    top-level plural keys (``models``, ``platforms``, ``attention_backends``, ``cache_methods``)."""
    declared: dict[str, list[str]] = {}
    registers = info.get("registers")
    if isinstance(registers, dict):
        for kind, names in registers.items():
            declared[kind] = sorted(names)
    for kind in REGISTRY_KINDS:
        names = info.get(kind + "s")
        if names is not None:
            declared[kind] = sorted(names.keys() if isinstance(names, dict) else names)
    return declared


def lazy_paths(spec: object) -> Iterator[tuple[str, str]]:
    """``(field, "module:attr")`` for every lazy path a registry record carries."""
    for field in _LAZY_FIELDS:
        value = getattr(spec, field, None)
        if value:
            yield field, value
    for preset in getattr(spec, "presets", ()):
        yield f"presets[{preset.name}].builder", preset.builder


class PluginConformance:
    """Conformance checks for any omnicore plugin.

    Attributes to set:
      ``plugin_module``: the entry-point target (``"pkg.plugin"`` or ``"pkg.plugin:obj"``). Required.
      ``plugin_name``: the entry-point name (default: the target's top-level package).
      ``entry_point_name``: when set, the installed distribution must declare this name in group ``omnicore``
      pointing at ``plugin_module``.
      ``require_plugin_info``: fail when the module has no ``plugin_info()`` (default ``False``).
      ``heavy_modules``: packages the entry module must not import (torch, diffusers, transformers).
    """

    plugin_module: str = ""
    plugin_name: str | None = None
    entry_point_name: str | None = None
    require_plugin_info: bool = False
    heavy_modules: tuple[str, ...] = HEAVY_MODULES

    # ------------------------------------------------------------------ fixtures
    def _name(self) -> str:
        if not self.plugin_module:
            pytest.fail(f"{type(self).__name__}: set `plugin_module` to your entry-point target")
        return self.plugin_name or default_plugin_name(self.plugin_module)

    @pytest.fixture
    def plugin_host(self) -> PluginHost:
        host = isolated_host()
        add_to_host(host, self.plugin_module, self._name())
        return host

    @pytest.fixture
    def plugin_record(self, plugin_host: PluginHost) -> PluginRecord:
        obj = load_plugin_object(self.plugin_module)
        name = plugin_host.pm.get_name(obj) if plugin_host.pm.is_registered(obj) else None
        return plugin_host.records[name if name is not None else self._name()]

    # ------------------------------------------------------------------ checks
    def test_entry_module_is_import_cheap(self) -> None:
        self._name()
        heavy = heavy_modules_after_import(self.plugin_module, tuple(self.heavy_modules))
        assert heavy == [], (
            f"importing {self.plugin_module!r} imports {heavy}; the entry module must stay light so "
            "`omnicore plugins` and `--help` never load the GPU stack. Name implementations by lazy "
            "'module:attr' paths and import heavy packages inside them."
        )

    def test_imports_only_public_omnicore_modules(self) -> None:
        """The plugin's package imports ``omnicore.plugin`` / ``omnicore.testing`` only (internal modules change
        between releases); the source is read, not imported, so imports inside functions count too."""
        package = self.plugin_module.partition(":")[0].split(".")[0]
        found = internal_imports([package])
        assert not found, (
            f"{package} imports internal omnicore modules (import their names from omnicore.plugin instead; "
            "a name it lacks is a request for the public API):\n" + "\n".join(found))

    def test_loads_and_registers_cleanly(self, plugin_record: PluginRecord) -> None:
        assert plugin_record.status == LOADED, f"{plugin_record.name}: {plugin_record.error}\n{plugin_record.traceback}"
        assert plugin_record.hooks, (
            f"{self.plugin_module!r} implements no omnicore hook: are its functions marked with "
            "`omnicore.hookimpl` (not a marker of another project name)?"
        )

    def test_every_hook_function_is_marked_and_has_a_spec(self) -> None:
        obj = load_plugin_object(self.plugin_module)
        problems = []
        for attr in dir(obj):
            value = getattr(obj, attr, None)
            if not callable(value):
                continue
            opts = getattr(value, f"{hookspecs.PROJECT}_impl", None)
            foreign = [a for a in dir(value) if a.endswith("_impl") and a != f"{hookspecs.PROJECT}_impl"
                       and isinstance(getattr(value, a, None), dict) and "tryfirst" in getattr(value, a)]
            if foreign:
                problems.append(f"{attr}: marked with a hookimpl of another project ({foreign[0][:-5]!r}); "
                                "use `from omnicore import hookimpl`")
            if attr.startswith("omnicore_") and opts is None and not foreign:
                problems.append(f"{attr}: looks like a hook but is not marked with `omnicore.hookimpl`")
            if opts is not None:
                hook = opts.get("specname") or attr
                if hook not in _KNOWN_HOOKS and not opts.get("optionalhook"):
                    problems.append(f"{attr}: implements {hook!r}, which omnicore.hookspecs does not define")
        assert not problems, "\n".join(problems)

    def test_plugin_info_matches_registrations(self, plugin_record: PluginRecord) -> None:
        obj = load_plugin_object(self.plugin_module)
        info_fn = getattr(obj, "plugin_info", None)
        if info_fn is None:
            assert not self.require_plugin_info, f"{self.plugin_module!r} has no plugin_info()"
            pytest.skip(f"{self.plugin_module!r} has no plugin_info() (optional)")
        info = info_fn()
        assert isinstance(info, dict), f"plugin_info() must return a dict, got {type(info).__name__}"
        api = info.get("api")
        if api is not None or self.require_plugin_info:
            assert isinstance(api, str), "plugin_info()['api'] must be a version range such as '>=1.0,<2'"
            mismatch = api_mismatch(api)
            assert mismatch is None, mismatch
        registered = {k: sorted(v) for k, v in plugin_record.registered.items()}
        for kind, names in declared_registrations(info).items():
            assert kind in REGISTRY_KINDS, f"plugin_info() declares unknown registry kind {kind!r}"
            assert names == registered.get(kind, []), (
                f"plugin_info() says it registers {kind}s {names}, but registration produced "
                f"{registered.get(kind, [])}")

    def test_every_lazy_path_resolves(self, plugin_host: PluginHost, plugin_record: PluginRecord) -> None:
        problems = []
        for kind, names in plugin_record.registered.items():
            for name in names:
                spec = plugin_host.registries[kind].get(name)
                for field, path in lazy_paths(spec):
                    try:
                        target = resolve(path)
                    except Exception as exc:
                        problems.append(f"{kind} {name!r} {field} = {path!r}: {type(exc).__name__}: {exc}")
                        continue
                    if not callable(target):
                        problems.append(f"{kind} {name!r} {field} = {path!r} is not callable")
        assert not problems, "\n".join(problems)

    def test_registration_is_repeatable(self, plugin_record: PluginRecord) -> None:
        """Worker processes load plugins again: in a fresh interpreter, two hosts must see the same
        registrations (and the same as this process), so module-level "already registered" state is a bug."""
        code = (
            "import json\n"
            "from omnicore.testing.plugin import add_to_host, isolated_host\n"
            f"records = [add_to_host(isolated_host(), {self.plugin_module!r}, {plugin_record.name!r})"
            f" for _ in (1, 2)]\n"
            "print(json.dumps([[r.status, r.error, r.registered] for r in records]))\n"
        )
        first, second = _run_fresh(code)
        assert first[0] == LOADED, first[1]
        assert first == second, f"first host registered {first[2]}, a second one in the same process {second[2]}"
        assert first[2] == plugin_record.registered

    def test_entry_point_is_declared(self) -> None:
        if self.entry_point_name is None:
            pytest.skip("set `entry_point_name` to check the installed entry point")
        import importlib_metadata

        eps = [ep for ep in importlib_metadata.entry_points(group="omnicore") if ep.name == self.entry_point_name]
        assert eps, f"no installed distribution declares entry point {self.entry_point_name!r} in group 'omnicore'"
        assert [ep.value for ep in eps] == [self.plugin_module], (
            f"entry point {self.entry_point_name!r} points at {[ep.value for ep in eps]}, "
            f"expected [{self.plugin_module!r}]")
