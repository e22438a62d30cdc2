"""Platform, attention-backend and cache-method selection by the plugin host."""

from __future__ import annotations

import pytest
from omnicore import hookimpl
from omnicore.config import resolve_settings
from omnicore.errors import PlatformUnavailable, PluginError, UnknownName, UnsupportedFeature
from omnicore.plugin_host import PluginHost
from omnicore.specs import (
    AttentionBackendSpec,
    AttentionCapabilities,
    AttentionRequirement,
    CacheMethodSpec,
    ModelCapabilities,
    ModelSpec,
    PlatformSpec,
)

PROBES = """
calls = []

def absent():
    calls.append("absent")
    return "no driver library libfake.so"

def present():
    calls.append("present")
    return None

def explodes():
    calls.append("explodes")
    raise RuntimeError("driver crashed during probe")
"""


def host(**env: str) -> PluginHost:
    return PluginHost(resolve_settings(env=env), autoload=False)


def platform_plugin(*specs: PlatformSpec) -> object:
    class Plugin:
        @hookimpl
        def omnicore_register_platforms(self, register):
            for spec in specs:
                register(spec)

    return Plugin()


def backend_plugin(*specs: AttentionBackendSpec) -> object:
    class Plugin:
        @hookimpl
        def omnicore_register_attention_backends(self, register):
            for spec in specs:
                register(spec)

    return Plugin()


# ------------------------------------------------------------------------------------------- platforms


def test_cpu_is_selected_when_nothing_else_is_registered():
    assert host().select_platform().name == "cpu"


def test_auto_selection_picks_the_highest_priority_available_platform(make_module):
    probes = make_module(PROBES)
    h = host()
    h.add_plugin(platform_plugin(
        PlatformSpec(name="big", impl="m.x:P", device_type="cuda", priority=20, probe=f"{probes}:absent"),
        PlatformSpec(name="mid", impl="m.x:P", device_type="npu", priority=10, probe=f"{probes}:present"),
        PlatformSpec(name="low", impl="m.x:P", priority=5),
    ), "hw")
    assert h.select_platform().name == "mid"  # 'big' is unavailable, 'low' has lower priority
    assert h.problems == []


def test_explicit_unavailable_platform_fails_loudly_with_its_reason(make_module):
    probes = make_module(PROBES)
    h = host(OMNICORE_PLATFORM="big")
    h.add_plugin(platform_plugin(
        PlatformSpec(name="big", impl="m.x:P", priority=20, probe=f"{probes}:absent")), "hw")
    with pytest.raises(PlatformUnavailable) as info:
        h.select_platform()  # from settings
    assert info.value.platform == "big" and "libfake.so" in str(info.value)
    with pytest.raises(PlatformUnavailable):
        h.select_platform("big")  # explicit argument too


def test_explicit_platform_argument_overrides_settings():
    h = host(OMNICORE_PLATFORM="nonexistent")
    assert h.select_platform("cpu").name == "cpu"
    with pytest.raises(UnknownName, match="nonexistent"):
        h.select_platform()


def test_a_raising_probe_is_recorded_and_skipped_in_auto_selection(make_module):
    probes = make_module(PROBES)
    h = host()
    h.add_plugin(platform_plugin(
        PlatformSpec(name="flaky", impl="m.x:P", priority=50, probe=f"{probes}:explodes")), "flakyhw")
    assert h.select_platform().name == "cpu"
    assert h.select_platform().name == "cpu"  # selecting again reports nothing new
    assert len(h.problems) == 1
    line = h.problems[0]
    assert "'flaky'" in line and "'flakyhw'" in line and "driver crashed during probe" in line
    assert "RuntimeError" in h.probe_failures["flaky"] and "Traceback" in h.probe_failures["flaky"]


def test_explicitly_selected_platform_whose_probe_raises_aborts_naming_the_plugin(make_module):
    probes = make_module(PROBES)
    h = host()
    h.add_plugin(platform_plugin(
        PlatformSpec(name="flaky", impl="m.x:P", priority=50, probe=f"{probes}:explodes")), "flakyhw")
    with pytest.raises(PluginError) as info:
        h.select_platform("flaky")
    assert info.value.plugin == "flakyhw" and "driver crashed" in str(info.value)


def test_explicit_platform_whose_plugin_failed_to_import_names_that_plugin():
    class FakeDist:
        name, version, requires = "omni-plugin-gpu", "0.3", None

    class BrokenEP:
        name, value, dist = "gpu", "omni_gpu.plugin", FakeDist()

        def load(self):
            raise ImportError("libcudart.so.12: cannot open shared object file")

    h = host(OMNICORE_PLATFORM="cuda")
    h.load_entry_points([BrokenEP()])
    with pytest.raises(UnknownName) as info:
        h.select_platform()
    assert str(info.value) == (
        "unknown platform 'cuda'; known: cpu (from omnicore); plugins that did not load: gpu (omni-plugin-gpu 0.3) "
        "failed: import of 'omni_gpu.plugin' failed: ImportError: libcudart.so.12: cannot open shared object file")
    with pytest.raises(UnknownName, match=r"^unknown platform 'cuda'; known: cpu \(from omnicore\)$"):
        host(OMNICORE_PLATFORM="cuda").select_platform()  # nothing failed: no hint


def test_cpu_platform_impl_resolves_lazily():
    spec = host().select_platform()
    platform = spec.load_impl()()
    assert platform.name == "cpu" and str(platform.device()) == "cpu"
    assert platform.max_memory_allocated() is None  # no window opened yet: unknown, not a lifetime peak
    platform.reset_peak_memory()
    assert platform.max_memory_allocated() >= platform.memory_allocated() > 0


# ------------------------------------------------------------------------------------------- attention

FP16_ONLY = AttentionBackendSpec(
    name="fastattn", impl="m.x:attn", priority=10,
    capabilities=AttentionCapabilities(platforms=("cpu",), dtypes=("float16",), head_dims=(16, 128)),
)


def test_attention_selection_prefers_priority_among_backends_that_meet_the_requirement():
    h = host()
    h.add_plugin(backend_plugin(FP16_ONLY), "fast")
    assert h.select_attention(AttentionRequirement(dtype="float16", head_dim=64)).name == "fastattn"
    assert h.select_attention(AttentionRequirement(dtype="float32", head_dim=64)).name == "sdpa"
    assert h.select_attention(AttentionRequirement(dtype="float16", head_dim=256)).name == "sdpa"
    assert h.select_attention(AttentionRequirement(dtype="float16", packed_varlen=True)).name == "sdpa"


def test_forced_backend_that_cannot_serve_lists_every_reason():
    h = host(OMNICORE_ATTENTION_BACKEND="fastattn")
    h.add_plugin(backend_plugin(FP16_ONLY), "fast")
    req = AttentionRequirement(platform="npu", dtype="float32", head_dim=256, packed_varlen=True, sparse=True)
    with pytest.raises(UnsupportedFeature) as info:
        h.select_attention(req)
    msg = str(info.value)
    assert "fastattn" in msg
    for reason in ("platform 'npu'", "dtype float32", "head_dim 256 outside [16, 128]",
                   "packed_varlen not supported", "sparse not supported"):
        assert reason in msg
    assert h.select_attention(AttentionRequirement(dtype="float16", head_dim=64)).name == "fastattn"


def test_forced_sdpa_wins_over_higher_priority_backends():
    h = host(OMNICORE_ATTENTION_BACKEND="sdpa")
    h.add_plugin(backend_plugin(FP16_ONLY), "fast")
    assert h.select_attention(AttentionRequirement(dtype="float16", head_dim=64)).name == "sdpa"


def test_no_backend_meets_the_requirement_names_each_backend_and_why():
    h = host()
    h.add_plugin(backend_plugin(FP16_ONLY), "fast")
    with pytest.raises(UnsupportedFeature) as info:
        h.select_attention(AttentionRequirement(platform="tpu", dtype="float16", head_dim=64, sparse=True))
    msg = str(info.value)
    assert "sdpa: platform 'tpu'" in msg and "fastattn: platform 'tpu'" in msg and "sparse not supported" in msg


def test_omnicore_attention_backend_hook_lets_a_plugin_prefer_its_kernel():
    class Chooser:
        @hookimpl(tryfirst=True)
        def omnicore_attention_backend(self, requirement, candidates):
            if requirement.head_dim == 64:
                return next(c for c in candidates if c.name == "lowprio")
            return None  # fall through to the core's default (highest priority)

    low = AttentionBackendSpec(name="lowprio", impl="m.x:attn", priority=-5,
                               capabilities=AttentionCapabilities(dtypes=("float32",)))
    h = host()
    h.add_plugin(backend_plugin(low), "lowplug")
    h.add_plugin(Chooser(), "chooser")
    assert h.select_attention(AttentionRequirement(head_dim=64)).name == "lowprio"
    assert h.select_attention(AttentionRequirement(head_dim=32)).name == "sdpa"


def test_a_hook_choosing_a_backend_that_cannot_serve_is_rejected_naming_it():
    class BadChooser:
        @hookimpl(tryfirst=True)
        def omnicore_attention_backend(self, requirement, candidates):
            return FP16_ONLY  # ignores the candidates: cannot do float32

    h = host()
    h.add_plugin(backend_plugin(FP16_ONLY), "fast")
    h.add_plugin(BadChooser(), "chooser")
    with pytest.raises(UnsupportedFeature, match=r"'fastattn' \(chosen by the omnicore_attention_backend hook\).*"
                                                 r"dtype float32"):
        h.select_attention(AttentionRequirement(dtype="float32", head_dim=64))


def test_requirement_unmet_by_is_empty_exactly_when_every_constraint_holds():
    caps = AttentionCapabilities(platforms=("cpu", "cuda"), dtypes=("bfloat16",), head_dims=(32, 64),
                                 packed_varlen=True)
    assert AttentionRequirement(platform="cuda", dtype="bfloat16", head_dim=32, packed_varlen=True).unmet_by(caps) == []
    assert AttentionRequirement(platform="cuda", dtype="bfloat16", head_dim=64).unmet_by(caps) == []
    assert len(AttentionRequirement(platform="cuda", dtype="bfloat16", head_dim=65).unmet_by(caps)) == 1
    assert len(AttentionRequirement(platform="cuda", dtype="bfloat16", head_dim=31).unmet_by(caps)) == 1
    assert len(AttentionRequirement(dtype="bfloat16", head_dim=32, packed_mask_free=True).unmet_by(caps)) == 1


# ------------------------------------------------------------------------------------------- cache methods

CACHE_IMPL = """
applied = []

class Handle:
    def __init__(self, pipeline, config):
        self.pipeline, self.config = pipeline, config

    def remove(self):
        applied.remove(self)

def apply(pipeline, config):
    handle = Handle(pipeline, config)
    applied.append(handle)
    return handle
"""


def cache_plugin(impl_module: str) -> object:
    class Plugin:
        @hookimpl
        def omnicore_register_cache_methods(self, register):
            register(CacheMethodSpec(name="xcache", impl=f"{impl_module}:apply", conflicts=("ycache",)))
            register(CacheMethodSpec(name="ycache", impl=f"{impl_module}:apply"))
            register(CacheMethodSpec(name="zcache", impl=f"{impl_module}:apply"))

    return Plugin()


def test_mutually_exclusive_cache_methods_are_rejected_at_configuration(make_module):
    h = host()
    h.add_plugin(cache_plugin(make_module(CACHE_IMPL)), "caches")
    for names in (["xcache", "ycache"], ["ycache", "xcache"]):  # declared on one side only
        with pytest.raises(UnsupportedFeature) as info:
            h.check_cache_methods(names)
        assert "'xcache' and 'ycache' are mutually exclusive" in str(info.value) or \
            "'ycache' and 'xcache' are mutually exclusive" in str(info.value)
    assert [s.name for s in h.check_cache_methods(["xcache", "zcache"])] == ["xcache", "zcache"]
    with pytest.raises(UnknownName, match="nocache"):
        h.check_cache_methods(["nocache"])


def test_cache_methods_the_model_does_not_support_are_rejected(make_module):
    h = host()
    h.add_plugin(cache_plugin(make_module(CACHE_IMPL)), "caches")
    model = ModelSpec(name="m", impl="a.b:C", capabilities=ModelCapabilities(cache_methods=("xcache",)))
    assert [s.name for s in h.check_cache_methods(["xcache"], model)] == ["xcache"]
    with pytest.raises(UnsupportedFeature) as info:
        h.check_cache_methods(["xcache", "zcache", "ycache"], model)
    msg = str(info.value)
    assert "does not support cache method 'zcache'" in msg and "mutually exclusive" in msg
    assert "supported: xcache" in msg


def test_omnicore_cache_default_applies_the_method_impl_and_a_plugin_can_override(make_module):
    impl = make_module(CACHE_IMPL)
    h = host()
    h.add_plugin(cache_plugin(impl), "caches")
    pipe = object()
    handle = h.enable_cache(pipeline=pipe, method=h.cache_methods.get("xcache"), config={"thresh": 0.1})
    applied = __import__(impl).applied
    assert applied == [handle] and handle.pipeline is pipe and handle.config == {"thresh": 0.1}
    handle.remove()
    assert applied == []

    class ModelSpecific:
        @hookimpl(tryfirst=True)
        def omnicore_cache(self, pipeline, method, config):
            return ("model-variant", method.name) if method.name == "xcache" else None

    h.add_plugin(ModelSpecific(), "variant")
    assert h.enable_cache(pipeline=pipe, method=h.cache_methods.get("xcache"), config=None) == \
        ("model-variant", "xcache")
    fallback = h.enable_cache(pipeline=pipe, method=h.cache_methods.get("zcache"), config=None)
    assert applied == [fallback]
