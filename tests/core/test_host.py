"""Plugin host: entry-point loading, allow/deny lists, failure capture, duplicates, unknown hooks, tracing."""

from __future__ import annotations

import re
from typing import Any

import importlib_metadata
import pytest
from omnicore import hookimpl
from omnicore.config import resolve_settings
from omnicore.errors import DuplicateRegistration, PluginError, UnknownName
from omnicore.plugin_host import DISABLED, FAILED, INCOMPATIBLE, LOADED, PluginHost
from omnicore.specs import CacheMethodSpec, ModelSpec, PlatformSpec

GOOD_PLUGIN = """
from omnicore import hookimpl
from omnicore.specs import ModelSpec

@hookimpl
def omnicore_register_models(register):
    register(ModelSpec(name="{model}", impl="nowhere.pipeline:Pipe"))
"""


def host(**env: str) -> PluginHost:
    """An isolated host whose settings come from ``env`` only (never the real environment)."""
    return PluginHost(resolve_settings(env=env), autoload=False)


class FakeDist:
    def __init__(self, name: str, version: str = "1.0", requires: list[str] | None = None) -> None:
        self.name, self.version, self.requires = name, version, requires


class FakeEP:
    """Duck-typed entry point: name, value, dist and load() are all the host uses."""

    def __init__(self, name: str, obj: Any = None, *, dist: str | None = None, error: Exception | None = None,
                 requires: list[str] | None = None):
        self.name, self.value = name, f"fake_{name}.plugin"
        self.dist = FakeDist(dist or f"dist-{name}", requires=requires)
        self._obj, self._error, self.loaded = obj, error, False

    def load(self) -> Any:
        self.loaded = True
        if self._error is not None:
            raise self._error
        return self._obj


def model_plugin(model: str) -> object:
    class Plugin:
        @hookimpl
        def omnicore_register_models(self, register):
            register(ModelSpec(name=model, impl="nowhere.pipeline:Pipe"))

    return Plugin()


# ------------------------------------------------------------------------------------------- loading


def test_builtin_plugin_registers_cpu_and_sdpa_through_hooks():
    h = host()
    rec = h.records["omnicore"]
    assert rec.status == LOADED
    assert rec.registered["platform"] == ["cpu"] and rec.registered["attention_backend"] == ["sdpa"]
    for kind, names in rec.registered.items():  # everything it registered is attributed to it
        assert all(h.registries[kind].get(n).provider == "omnicore" for n in names)
    assert h.platforms.get("cpu").provider == "omnicore"
    assert h.attention_backends.get("sdpa").provider == "omnicore"
    assert "omnicore_register_platforms" in rec.hooks and "omnicore_register_attention_backends" in rec.hooks
    assert h.problems == []


def test_real_entry_points_load_and_record_import_time(make_module):
    mod = make_module(GOOD_PLUGIN.format(model="alpha"))
    ep = importlib_metadata.EntryPoint(name="alpha", value=mod, group="omnicore")
    h = host()
    h.load_entry_points([ep])
    rec = h.records["alpha"]
    assert rec.status == LOADED, rec.error
    assert rec.value == mod
    assert rec.registered == {"model": ["alpha"]}
    assert rec.import_s > 0.0
    assert h.models.get("alpha").provider == "alpha"


def test_allow_list_loads_only_listed_plugins():
    eps = [FakeEP("a", model_plugin("ma")), FakeEP("b", model_plugin("mb"))]
    h = host(OMNICORE_PLUGINS="b")
    h.load_entry_points(eps)
    assert h.records["a"].status == DISABLED and not eps[0].loaded  # never imported
    assert h.records["b"].status == LOADED
    assert h.models.names() == ["mb"]
    assert h.problems == []


def test_empty_allow_list_loads_no_third_party_plugin():
    eps = [FakeEP("a", model_plugin("ma"))]
    h = host(OMNICORE_PLUGINS="")
    h.load_entry_points(eps)
    assert h.records["a"].status == DISABLED and not eps[0].loaded
    assert h.records["omnicore"].status == LOADED  # built-ins are not entry points


def test_deny_list_blocks_named_plugins_and_star_blocks_all():
    eps = [FakeEP("a", model_plugin("ma")), FakeEP("b", model_plugin("mb"))]
    h = host(OMNICORE_DISABLE_PLUGINS=" a ,")
    h.load_entry_points(eps)
    assert (h.records["a"].status, h.records["b"].status) == (DISABLED, LOADED)
    assert not eps[0].loaded

    eps = [FakeEP("a", model_plugin("ma")), FakeEP("b", model_plugin("mb"))]
    h = host(OMNICORE_DISABLE_PLUGINS="*")
    h.load_entry_points(eps)
    assert {h.records[n].status for n in "ab"} == {DISABLED}
    assert not any(ep.loaded for ep in eps)
    assert h.problems == []


def test_deny_list_wins_over_allow_list():
    eps = [FakeEP("a", model_plugin("ma"))]
    h = host(OMNICORE_PLUGINS="a", OMNICORE_DISABLE_PLUGINS="a")
    h.load_entry_points(eps)
    assert h.records["a"].status == DISABLED


@pytest.mark.parametrize("var", ["OMNICORE_PLUGINS", "OMNICORE_DISABLE_PLUGINS"])
def test_unknown_name_in_env_list_gives_one_line_naming_it(var):
    h = host(**{var: "a,ghost"})
    h.load_entry_points([FakeEP("a", model_plugin("ma"))])
    assert len(h.problems) == 1
    line = h.problems[0]
    assert "\n" not in line
    assert var in line and "'ghost'" in line and "installed: a" in line


@pytest.mark.parametrize("target, fragment", [
    ("omnitest_no_such_module_xyz.plugin", "ModuleNotFoundError"),
    ("json:no_such_attribute", "AttributeError"),
    ("not a valid target!", "is malformed (expected 'package.module' or 'package.module:attr')"),
    ("json:", "is malformed"),
])
def test_malformed_entry_point_is_failed_with_one_error_line(target, fragment):
    good = FakeEP("good", model_plugin("fine"))
    bad = importlib_metadata.EntryPoint(name="broken", value=target, group="omnicore")
    h = host()
    h.load_entry_points([bad, good])
    rec = h.records["broken"]
    assert rec.status == FAILED
    assert "\n" not in rec.error and target in rec.error and fragment in rec.error
    if "malformed" not in fragment:  # an import was attempted: its traceback is kept
        assert rec.traceback and "Traceback" in rec.traceback
    assert h.records["good"].status == LOADED  # the rest still load
    assert [p for p in h.problems if "broken" in p] == [f"plugin 'broken' FAILED: {rec.error}"]
    assert len(h.problems) == 1


def test_lists_also_accept_normalised_distribution_names():
    eps = [FakeEP("a", model_plugin("ma"), dist="Omni-Plugin-A"), FakeEP("b", model_plugin("mb"), dist="omni-plugin-b")]
    h = host(OMNICORE_PLUGINS="omni_plugin_a,omni.plugin.b")
    h.load_entry_points(eps)
    assert (h.records["a"].status, h.records["b"].status) == (LOADED, LOADED) and h.problems == []

    eps = [FakeEP("a", model_plugin("ma"), dist="Omni-Plugin-A"), FakeEP("b", model_plugin("mb"), dist="omni-plugin-b")]
    h = host(OMNICORE_DISABLE_PLUGINS="OMNI_PLUGIN_A")
    h.load_entry_points(eps)
    assert (h.records["a"].status, h.records["b"].status) == (DISABLED, LOADED) and not eps[0].loaded


@pytest.mark.parametrize("requires, status", [
    (["omnicore>=0.1,<99"], LOADED),
    (["omnicore<0.0.1"], INCOMPATIBLE),
    (["Omnicore (>=99)"], INCOMPATIBLE),  # old-style parentheses, other spelling of the name
    (["omnicore<0.0.1; extra == 'legacy'"], LOADED),  # only with an extra: does not apply
    (["omnicore-extras<0.0.1", "torch>=2"], LOADED),  # other distributions are not our business
    (["omnicore >= nonsense"], INCOMPATIBLE),
    (None, LOADED),
])
def test_requires_dist_on_omnicore_is_checked_before_import(requires, status):
    ep = FakeEP("p", model_plugin("mp"), dist="omni-plugin-p", requires=requires)
    h = host()
    h.load_entry_points([ep])
    rec = h.records["p"]
    assert rec.status == status, rec.error
    assert ep.loaded == (status == LOADED)  # an incompatible plugin is never imported
    if status == INCOMPATIBLE:
        assert h.problems == [f"plugin 'p' INCOMPATIBLE: {rec.error}"]
        assert "omni-plugin-p 1.0" in rec.error and "\n" not in rec.error
        assert "mp" not in h.models


@pytest.mark.parametrize("api, status, fragment", [
    (">=1.0,<2", LOADED, None),
    (">=2,<3", INCOMPATIBLE, "does not admit this core's plugin API"),
    ("one point oh", INCOMPATIBLE, "is not a version range"),
])
def test_plugin_api_range_is_checked_after_import(api, status, fragment):
    class Plugin:
        @staticmethod
        def plugin_info():
            return {"kind": "model", "api": api}

        @hookimpl
        def omnicore_register_models(self, register):
            register(ModelSpec(name="api-model", impl="a.b:C"))

    h = host()
    rec = h.add_plugin(Plugin(), "apiplug")
    assert rec.status == status
    assert ("api-model" in h.models) == (status == LOADED)
    if fragment:
        assert fragment in rec.error and h.pm.get_plugin("apiplug") is None


def test_registration_hooks_reject_wrappers():
    class Wrapper:
        @hookimpl(wrapper=True)
        def omnicore_register_models(self, register):
            register(ModelSpec(name="wrapped", impl="a.b:C"))
            return (yield)

    h = host()
    rec = h.add_plugin(Wrapper(), "wrapper")
    assert rec.status == FAILED
    assert rec.error == "registration hooks take no wrappers: omnicore_register_models"
    assert "wrapped" not in h.models and h.pm.get_plugin("wrapper") is None


def test_empty_entry_point_group_is_silent(caplog):
    h = host()
    with caplog.at_level("DEBUG", logger="omnicore.plugin_host"):
        h.load_entry_points([])
    assert h.problems == []
    assert [r.levelname for r in caplog.records] == ["DEBUG"]


def test_import_that_raises_or_exits_is_captured_but_keyboard_interrupt_propagates():
    h = host()
    h.load_entry_points([FakeEP("boom", error=RuntimeError("kaput")), FakeEP("bye", error=SystemExit(3)),
                         FakeEP("ok", model_plugin("m1"))])
    assert h.records["boom"].status == FAILED and "RuntimeError: kaput" in h.records["boom"].error
    assert h.records["bye"].status == FAILED and "SystemExit" in h.records["bye"].error
    assert h.records["ok"].status == LOADED
    with pytest.raises(KeyboardInterrupt):
        host().load_entry_points([FakeEP("ctrl_c", error=KeyboardInterrupt())])


def test_duplicate_entry_point_name_names_both_distributions():
    h = host()
    h.load_entry_points([FakeEP("dup", model_plugin("m1"), dist="first-dist"),
                         FakeEP("dup", model_plugin("m2"), dist="second-dist")])
    assert h.records["dup"].status == LOADED
    assert h.records["dup@second-dist"].status == FAILED
    assert len(h.problems) == 1
    assert "first-dist" in h.problems[0] and "second-dist" in h.problems[0] and "'dup'" in h.problems[0]
    assert h.models.names() == ["m1"]


def test_entry_point_may_not_take_the_core_name():
    h = host()
    h.load_entry_points([FakeEP("omnicore", model_plugin("evil"), dist="impostor")])
    assert h.records["omnicore"].dist == "omnicore"  # the built-in record is untouched
    assert len(h.problems) == 1 and "impostor" in h.problems[0]
    assert "evil" not in h.models


def test_duplicate_registration_names_both_providers_and_rolls_back_the_failing_plugin():
    class First:
        @hookimpl
        def omnicore_register_platforms(self, register):
            register(PlatformSpec(name="gizmo", impl="a.b:C"))

    class Second:
        @hookimpl
        def omnicore_register_models(self, register):
            register(ModelSpec(name="second-model", impl="a.b:C"))  # registered before the clash

        @hookimpl
        def omnicore_register_platforms(self, register):
            register(PlatformSpec(name="gizmo", impl="x.y:Z"))

    h = host()
    h.add_plugin(First(), "first")
    rec = h.add_plugin(Second(), "second")
    assert rec.status == FAILED
    assert rec.error == "DuplicateRegistration: platform 'gizmo' is already registered by plugin 'first'"
    assert "second-model" not in h.models  # rolled back
    assert rec.registered == {}
    assert h.platforms.get("gizmo").provider == "first"
    assert h.pm.get_plugin("second") is None  # its hooks no longer run
    assert len(h.problems) == 1 and "'first'" in h.problems[0] and "'second'" in h.problems[0]


def test_duplicate_alias_is_rejected_like_a_name():
    class A:
        @hookimpl
        def omnicore_register_models(self, register):
            register(ModelSpec(name="m-a", impl="a.b:C", aliases=("SharedPipeline",)))

    class B:
        @hookimpl
        def omnicore_register_models(self, register):
            register(ModelSpec(name="m-b", impl="a.b:C", aliases=("sharedpipeline",)))

    h = host()
    h.add_plugin(A(), "a")
    rec = h.add_plugin(B(), "b")
    assert rec.status == FAILED and "'a'" in rec.error and "sharedpipeline" in rec.error
    assert h.problems == [f"plugin 'b' FAILED: {rec.error}"]
    assert h.models.get("SharedPipeline").name == "m-a"


def test_register_rejects_the_wrong_record_type():
    class Wrong:
        @hookimpl
        def omnicore_register_models(self, register):
            register(PlatformSpec(name="oops", impl="a.b:C"))

    rec = host().add_plugin(Wrong(), "wrong")
    assert rec.status == FAILED and "ModelSpec" in rec.error and "PlatformSpec" in rec.error


def test_registration_hook_that_raises_is_attributed_to_its_plugin():
    class Raises:
        @hookimpl
        def omnicore_register_cache_methods(self, register):
            raise ZeroDivisionError("bad math")

    h = host()
    rec = h.add_plugin(Raises(), "raiser")
    assert rec.status == FAILED
    assert rec.error == "omnicore_register_cache_methods raised ZeroDivisionError: bad math"
    assert "ZeroDivisionError" in rec.traceback
    with pytest.raises(PluginError, match="raiser"):
        h.require_loaded("raiser")
    h.require_loaded("omnicore")  # a loaded plugin passes


def test_plugin_implementing_unknown_hook_is_incompatible_and_unregistered():
    class FromTheFuture:
        @hookimpl
        def omnicore_register_models(self, register):
            register(ModelSpec(name="future", impl="a.b:C"))

        @hookimpl
        def omnicore_register_teleporters(self, register):
            pass

    h = host()
    rec = h.add_plugin(FromTheFuture(), "future")
    assert rec.status == INCOMPATIBLE
    assert "omnicore_register_teleporters" in rec.error
    assert "future" not in h.models
    assert h.pm.get_plugin("future") is None
    assert len(h.problems) == 1 and "'future'" in h.problems[0]


def test_optional_unknown_hook_is_tolerated():
    class Optional:
        @hookimpl(optionalhook=True)
        def omnicore_register_teleporters(self, register):
            pass

    assert host().add_plugin(Optional(), "opt").status == LOADED


def test_impl_with_arguments_outside_the_spec_fails_validation():
    class BadArgs:
        @hookimpl
        def omnicore_register_models(self, register, extra_thing):
            pass

    rec = host().add_plugin(BadArgs(), "badargs")
    assert rec.status == FAILED and "hook validation failed" in rec.error and "extra_thing" in rec.error


def test_plugin_info_is_recorded_and_a_raising_one_fails_the_plugin():
    class WithInfo:
        @staticmethod
        def plugin_info():
            return {"kind": "model", "api": ">=1.0,<2"}

    class BrokenInfo:
        @staticmethod
        def plugin_info():
            raise ValueError("no info")

    h = host()
    assert h.add_plugin(WithInfo(), "info").info == {"kind": "model", "api": ">=1.0,<2"}
    rec = h.add_plugin(BrokenInfo(), "broken_info")
    assert rec.status == FAILED and "ValueError: no info" in rec.error


def test_unknown_registry_name_lists_the_known_ones_and_their_providers():
    with pytest.raises(UnknownName) as info:
        host().platforms.get("quantum")
    assert str(info.value) == "unknown platform 'quantum'; known: cpu (from omnicore)"


# ------------------------------------------------------------------------------------------- tracing

TRACE_LINE = re.compile(r"omnicore\.trace: (\S+) plugins=\[([^\]]*)\] (\d+\.\d{3}) ms (ok|raised \w+)")


def test_trace_logs_each_hook_call_with_plugins_and_duration(capsys):
    class Observer:
        @hookimpl(wrapper=True)
        def omnicore_postprocess(self, request, output):
            result = yield
            return result + "!"

    h = PluginHost(resolve_settings(env={"OMNICORE_TRACE_PLUGINS": "1"}), autoload=False)
    h.add_plugin(Observer(), "observer")
    assert h.postprocess(request="req", output="img") == "img!"
    lines = [TRACE_LINE.match(line) for line in capsys.readouterr().err.splitlines()]
    calls = {(m.group(1), m.group(2)) for m in lines if m}
    assert ("omnicore_register_platforms", "omnicore") in calls
    assert ("omnicore_register_attention_backends", "omnicore") in calls
    post = [m for m in lines if m and m.group(1) == "omnicore_postprocess"]
    assert len(post) == 1
    assert set(post[0].group(2).split(",")) == {"omnicore", "observer"}
    assert float(post[0].group(3)) >= 0.0 and post[0].group(4) == "ok"


def test_trace_reports_a_raising_hook(capsys):
    class Raises:
        @hookimpl(tryfirst=True)
        def omnicore_postprocess(self, request, output):
            raise RuntimeError("filter crashed")

    h = PluginHost(resolve_settings(env={"OMNICORE_TRACE_PLUGINS": "true"}), autoload=False)
    h.add_plugin(Raises(), "crasher")
    with pytest.raises(RuntimeError):
        h.postprocess(request=None, output=1)
    err = capsys.readouterr().err
    assert re.search(r"omnicore_postprocess plugins=\[[^\]]*crasher[^\]]*\] \d+\.\d{3} ms raised RuntimeError", err)


def test_no_trace_output_unless_enabled(capsys):
    h = host()
    h.postprocess(request=None, output=1)
    assert "omnicore.trace" not in capsys.readouterr().err


def test_duplicate_registration_error_type_carries_both_providers():
    reg_host = host()
    spec = CacheMethodSpec(name="c1", impl="a.b:c")
    reg_host.cache_methods.register(spec, "p1")
    with pytest.raises(DuplicateRegistration) as info:
        reg_host.cache_methods.register(spec, "p2")
    err = info.value
    assert (err.plugin, err.existing, err.kind, err.name) == ("p2", "p1", "cache_method", "c1")
