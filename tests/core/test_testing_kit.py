"""The conformance kit (``omnicore.testing``): it passes the core's built-ins and the test-only toy model, and
it FAILS plugins that break each rule (run in an inner pytest session through ``pytester``)."""

from __future__ import annotations

import textwrap

import pytest
from omnicore.cache.teacache import TeaCacheConfig
from omnicore.testing import (
    AttentionBackendConformance,
    CacheMethodConformance,
    ModelPluginConformance,
    PlatformConformance,
    PlatformOpConformance,
    PluginConformance,
)

pytest_plugins = ["pytester"]


# --------------------------------------------------------------------------------- the kit on real plugins


class TestCorePluginConforms(PluginConformance):
    plugin_module = "omnicore._builtin"
    plugin_name = "omnicore"
    require_plugin_info = True
    test_entry_point_is_declared = None  # the built-in plugin is not an entry point (see test_third_party.py)


class TestSdpaReferenceConforms(AttentionBackendConformance):
    backend = "sdpa"
    dtypes = ("float32", "bfloat16")


class TestToyModelConforms(ModelPluginConformance):
    model = "tiny:toy"
    plugin_module = "toy.plugin:ToyPlugin"
    plugin_name = "toy"
    params = {"num_inference_steps": 2, "height": 32, "width": 48}


class TestCpuPlatformConforms(PlatformConformance):
    platform = "cpu"


class TestToyRmsNormOpConforms(PlatformOpConformance):
    op = "rms_norm"
    platform = "cpu"
    plugin_module = "toy.ops_backend:ToyOpsBackend"
    plugin_name = "toy-ops"


class TestToySwigluOpConforms(PlatformOpConformance):
    op = "swiglu"
    platform = "cpu"
    plugin_module = "toy.ops_backend:ToyOpsBackend"
    plugin_name = "toy-ops"


class TestTeaCacheOnToyConforms(CacheMethodConformance):
    cache_method = "teacache"
    model = "tiny:toy"
    plugin_module = "toy.plugin:ToyPlugin"
    cache_config = TeaCacheConfig(force_hits=frozenset({2, 3}))  # the method really skips steps
    params = {"num_inference_steps": 5, "height": 32, "width": 32}


def test_omnicore_host_fixture_is_isolated(omnicore_host):
    assert list(omnicore_host.records) == ["omnicore"]
    assert omnicore_host.settings.plugins is None and omnicore_host.problems == []


# --------------------------------------------------------------------------------- the kit catches violations


def run_inner(pytester: pytest.Pytester, modules: dict[str, str], test_source: str) -> dict[str, str]:
    """Write ``modules`` and a test file, run pytest in-process, return ``{test name: outcome}``."""
    for name, source in modules.items():
        pytester.makepyfile(**{name: textwrap.dedent(source)})
    pytester.makepyfile(test_inner=textwrap.dedent(test_source))
    pytester.syspathinsert()
    reprec = pytester.inline_run("-p", "no:cacheprovider")
    outcomes: dict[str, str] = {}
    for rep in reprec.getreports("pytest_runtest_logreport"):  # setup, call, teardown: the worst one wins
        if rep.when == "call" or rep.outcome != "passed":
            if outcomes.get(rep.nodeid) in (None, "passed"):
                outcomes[rep.nodeid] = rep.outcome
    return outcomes


def failing(outcomes: dict[str, str], cls: str) -> set[str]:
    """Names of the failed tests of class node ``cls`` (e.g. ``test_inner.py::TestHeavy``)."""
    return {n.rsplit("::", 1)[1] for n, o in outcomes.items() if n.startswith(cls + "::") and o == "failed"}


BAD_PLUGINS = {
    "plug_heavy": """
        import decimal  # stands in for torch: the test class declares it heavy
        from omnicore import hookimpl
        from omnicore.plugin import ModelSpec

        @hookimpl
        def omnicore_register_models(register):
            register(ModelSpec(name="heavy", impl="decimal:Decimal"))
    """,
    "plug_misspelled": """
        import pluggy
        from omnicore.plugin import ModelSpec

        hookimpl = pluggy.HookimplMarker("omnicor")

        @hookimpl
        def omnicore_register_models(register):
            register(ModelSpec(name="typo", impl="decimal:Decimal"))
    """,
    "plug_info_lies": """
        from omnicore import hookimpl
        from omnicore.plugin import ModelSpec

        def plugin_info():
            return {"kind": "model", "api": ">=1.0,<2", "models": ["real", "imaginary"]}

        @hookimpl
        def omnicore_register_models(register):
            register(ModelSpec(name="real", impl="decimal:Decimal"))
    """,
    "plug_future_api": """
        from omnicore import hookimpl
        from omnicore.plugin import ModelSpec

        def plugin_info():
            return {"kind": "model", "api": ">=2,<3", "models": ["future"]}

        @hookimpl
        def omnicore_register_models(register):
            register(ModelSpec(name="future", impl="decimal:Decimal"))
    """,
    "plug_dangling": """
        from omnicore import hookimpl
        from omnicore.plugin import ModelSpec, PresetSpec

        @hookimpl
        def omnicore_register_models(register):
            register(ModelSpec(name="dangling", impl="omnitest_nowhere_xyz.pipeline:Pipe",
                               presets=(PresetSpec(name="tiny", builder="decimal:NoSuchBuilder"),)))
    """,
    "plug_once": """
        from omnicore import hookimpl
        from omnicore.plugin import ModelSpec

        _done = []

        @hookimpl
        def omnicore_register_models(register):
            if not _done:  # module state: a second process / host would see nothing
                register(ModelSpec(name="once", impl="decimal:Decimal"))
            _done.append(1)
    """,
    "plug_internal": """
        from omnicore import hookimpl
        from omnicore.plugin import ModelSpec

        def engine_for(name):
            from omnicore.engine.api import Engine  # internal: renamed or moved in any release
            return Engine(name)

        @hookimpl
        def omnicore_register_models(register):
            register(ModelSpec(name="internal", impl="decimal:Decimal"))
    """,
    "plug_good": """
        from omnicore import hookimpl
        from omnicore.plugin import ModelSpec

        def plugin_info():
            return {"kind": "model", "api": ">=1.0,<2", "registers": {"model": ["good"]}}

        @hookimpl
        def omnicore_register_models(register):
            register(ModelSpec(name="good", impl="decimal:Decimal"))
    """,
}

BAD_PLUGIN_TESTS = """
    from omnicore.testing import PluginConformance

    class TestHeavy(PluginConformance):
        plugin_module = "plug_heavy"
        heavy_modules = ("decimal",)

    class TestMisspelled(PluginConformance):
        plugin_module = "plug_misspelled"

    class TestInfoLies(PluginConformance):
        plugin_module = "plug_info_lies"

    class TestFutureApi(PluginConformance):
        plugin_module = "plug_future_api"

    class TestDangling(PluginConformance):
        plugin_module = "plug_dangling"

    class TestOnce(PluginConformance):
        plugin_module = "plug_once"

    class TestInternal(PluginConformance):
        plugin_module = "plug_internal"

    class TestGood(PluginConformance):
        plugin_module = "plug_good"
        require_plugin_info = True
        heavy_modules = ("decimal",)

    def test_fixture_from_the_pytest11_plugin(omnicore_host):
        assert omnicore_host.platforms.get("cpu").provider == "omnicore"
"""


def test_plugin_conformance_fails_each_broken_plugin(pytester):
    out = run_inner(pytester, BAD_PLUGINS, BAD_PLUGIN_TESTS)
    assert failing(out, "test_inner.py::TestHeavy") == {"test_entry_module_is_import_cheap"}
    assert failing(out, "test_inner.py::TestMisspelled") == {
        "test_loads_and_registers_cleanly", "test_every_hook_function_is_marked_and_has_a_spec"}
    assert failing(out, "test_inner.py::TestInfoLies") == {"test_plugin_info_matches_registrations"}
    assert failing(out, "test_inner.py::TestFutureApi") == {  # the host refuses it: status incompatible
        "test_loads_and_registers_cleanly", "test_plugin_info_matches_registrations", "test_registration_is_repeatable"}
    assert failing(out, "test_inner.py::TestDangling") == {"test_every_lazy_path_resolves"}
    assert failing(out, "test_inner.py::TestOnce") == {"test_registration_is_repeatable"}
    assert failing(out, "test_inner.py::TestInternal") == {"test_imports_only_public_omnicore_modules"}
    assert failing(out, "test_inner.py::TestGood") == set()
    assert out["test_inner.py::TestGood::test_plugin_info_matches_registrations"] == "passed"
    assert out["test_inner.py::test_fixture_from_the_pytest11_plugin"] == "passed"


LEAKY_BACKEND = {
    "plug_leaky": """
        from omnicore import hookimpl
        from omnicore.specs import AttentionBackendSpec, AttentionCapabilities

        def leaky(q, k, v, *, metadata=None, **kwargs):
            # claims packed support but attends across the whole packed sequence
            from omnicore.attention.reference import sdpa_attention
            if metadata is None:
                return sdpa_attention(q, k, v, **kwargs)
            return sdpa_attention(q[None], k[None], v[None])[0]

        @hookimpl
        def omnicore_register_attention_backends(register):
            register(AttentionBackendSpec(name="leaky", impl="plug_leaky:leaky", priority=5,
                     capabilities=AttentionCapabilities(dtypes=("float32",), head_dims=(8, 64),
                                                        packed_varlen=True)))
    """,
}

LEAKY_TESTS = """
    from omnicore.testing import AttentionBackendConformance

    class TestLeaky(AttentionBackendConformance):
        backend = "leaky"
        plugin_module = "plug_leaky"
        head_dim = 16
"""


def test_attention_conformance_catches_a_backend_that_leaks_across_documents(pytester):
    out = run_inner(pytester, LEAKY_BACKEND, LEAKY_TESTS)
    failed = failing(out, "test_inner.py::TestLeaky")
    assert failed == {"test_packed_matches_reference", "test_packed_cross_attention_matches_reference",
                      "test_packed_documents_are_isolated", "test_padding_never_leaks_into_real_rows",
                      "test_rejects_inconsistent_inputs", "test_packed_causal_matches_reference",
                      "test_packed_gqa_matches_reference"}
    assert out["test_inner.py::TestLeaky::test_dense_matches_reference"] == "passed"
    assert out["test_inner.py::TestLeaky::test_selection_honours_the_declaration"] == "passed"


NOISY_MODEL_TESTS = """
    import numpy as np
    from omnicore import hookimpl
    from omnicore.testing import ModelPluginConformance

    class NoisyOutputs:
        @hookimpl(wrapper=True)
        def omnicore_postprocess(self, request, output):
            out = yield
            rng = np.random.default_rng()  # unseeded: breaks determinism
            out.frames = (out.frames ^ rng.integers(0, 2, out.frames.shape, dtype=np.uint8))
            return out

    class TestNoisyToy(ModelPluginConformance):
        model = "tiny:toy"
        plugin_module = "toy.plugin:ToyPlugin"
        plugin_name = "toy"
        params = {"num_inference_steps": 1, "height": 16, "width": 16}
        invalid_params = {"height": 3}

        @classmethod
        def make_host(cls, settings):
            host = super().make_host(settings)
            host.add_plugin(NoisyOutputs(), "noisy")
            return host
"""


def test_model_conformance_catches_nondeterministic_outputs(pytester):
    out = run_inner(pytester, {}, NOISY_MODEL_TESTS)
    failed = failing(out, "test_inner.py::TestNoisyToy")
    assert failed == {"test_same_seed_gives_identical_bytes", "test_weight_round_trip_gives_identical_outputs"}
    assert out["test_inner.py::TestNoisyToy::test_output_shape_and_type"] == "passed"
    assert out["test_inner.py::TestNoisyToy::test_invalid_requests_name_the_field"] == "passed"


BAD_PLATFORM_AND_CACHE = {
    "plug_bad_platform": """
        import os
        from omnicore import hookimpl
        from omnicore.specs import PlatformSpec

        def probe():
            os.environ["OMNITEST_PROBED"] = "1"  # a side effect
            return None

        @hookimpl
        def omnicore_register_platforms(register):
            register(PlatformSpec(name="sloppy", impl="omnicore.platforms.cpu:CpuPlatform", probe="plug_bad_platform:probe",
                                  attention_preference=("no_such_backend",)))
    """,
    "plug_bad_cache": """
        from omnicore import hookimpl
        from omnicore.specs import CacheMethodSpec

        class Handle:
            def remove(self):
                pass  # forgets to undo what apply did

        def apply(pipeline, config):
            import torch
            with torch.no_grad():
                for p in pipeline.model.parameters():
                    p.mul_(1.01)
            return Handle()

        @hookimpl
        def omnicore_register_cache_methods(register):
            register(CacheMethodSpec(name="teacache", impl="plug_bad_cache:apply"), replace=True)
    """,
}

BAD_PLATFORM_AND_CACHE_TESTS = """
    from omnicore.testing import CacheMethodConformance, PlatformConformance

    class TestSloppyPlatform(PlatformConformance):
        platform = "sloppy"
        plugin_module = "plug_bad_platform"

    class TestLeakyCache(CacheMethodConformance):
        cache_method = "teacache"
        model = "tiny:toy"
        plugin_module = "toy.plugin:ToyPlugin"
        cache_plugin_module = "plug_bad_cache"
        params = {"num_inference_steps": 2, "height": 32, "width": 32}
"""


def test_platform_and_cache_kits_catch_broken_plugins(pytester, monkeypatch):
    monkeypatch.setenv("OMNITEST_PROBED", "")  # restored (to unset) afterwards, whatever the probe does
    out = run_inner(pytester, BAD_PLATFORM_AND_CACHE, BAD_PLATFORM_AND_CACHE_TESTS)
    assert failing(out, "test_inner.py::TestSloppyPlatform") == {
        "test_spec_is_well_formed", "test_probe_is_fast_stable_and_side_effect_free"}
    assert failing(out, "test_inner.py::TestLeakyCache") == {"test_apply_then_remove_leaves_the_pipeline_unchanged",
                                                             "test_reuse_happens_and_is_reported"}  # skips nothing
