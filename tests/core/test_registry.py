"""Open string-keyed registries and the spec records' validation."""

from __future__ import annotations

import pytest
from omnicore.errors import DuplicateRegistration, UnknownName
from omnicore.registry import Registry
from omnicore.specs import (
    SPEC_KINDS,
    AttentionBackendSpec,
    CacheMethodSpec,
    ModelSpec,
    PlatformSpec,
    PresetSpec,
    resolve,
)


def test_lookup_is_case_insensitive_and_aliases_resolve_to_the_record():
    reg: Registry[ModelSpec] = Registry("model")
    rec = reg.register(ModelSpec(name="lingbot", impl="a.b:C", aliases=("LingBotVideoPipeline",)), "p1")
    assert rec.provider == "p1"
    assert reg.get("LINGBOT") is rec and reg.get("lingbotvideopipeline") is rec
    assert "LingBotVideoPipeline" in reg and "other" not in reg and 3 not in reg
    assert reg.names() == ["lingbot"] and len(reg) == 1 and list(reg) == [rec]
    assert reg.providers() == {"lingbot": "p1"}


def test_duplicates_name_both_providers():
    reg: Registry[PlatformSpec] = Registry("platform")
    reg.register(PlatformSpec(name="cuda", impl="a.b:C"), "backends-cuda")
    with pytest.raises(DuplicateRegistration) as info:
        reg.register(PlatformSpec(name="cuda", impl="x.y:Z"), "impostor")
    assert "'backends-cuda'" in str(info.value) and "'impostor'" in str(info.value)
    assert reg.get("cuda").impl == "a.b:C"


def test_replace_is_explicit_and_remembered():
    reg: Registry[AttentionBackendSpec] = Registry("attention_backend")
    reg.register(AttentionBackendSpec(name="flash", impl="a.b:f"), "p1")
    reg.register(AttentionBackendSpec(name="flash", impl="c.d:g"), "p2", replace=True)
    assert reg.get("flash").impl == "c.d:g" and reg.get("flash").provider == "p2"
    assert reg.overrides == [("flash", "p1", "p2")]


def test_replace_cannot_steal_someone_elses_alias():
    reg: Registry[ModelSpec] = Registry("model")
    reg.register(ModelSpec(name="a", impl="a.b:C", aliases=("shared",)), "p1")
    with pytest.raises(DuplicateRegistration):
        reg.register(ModelSpec(name="b", impl="a.b:C", aliases=("shared",)), "p2", replace=True)


def test_unregistering_a_replacement_restores_the_replaced_record():
    reg: Registry[ModelSpec] = Registry("model")
    reg.register(ModelSpec(name="m", impl="a.b:Old", aliases=("oldalias",)), "p1")
    reg.register(ModelSpec(name="m", impl="c.d:New"), "p2", replace=True)
    assert reg.get("m").impl == "c.d:New"
    reg.unregister_provider("p2")  # p2 failed later in its registration
    assert reg.get("m").provider == "p1" and reg.get("oldalias").impl == "a.b:Old"
    assert reg.overrides == []


def test_unregister_provider_drops_records_and_aliases():
    reg: Registry[ModelSpec] = Registry("model")
    reg.register(ModelSpec(name="a", impl="a.b:C", aliases=("aa",)), "p1")
    reg.register(ModelSpec(name="b", impl="a.b:C"), "p2")
    reg.unregister_provider("p1")
    assert reg.names() == ["b"] and "aa" not in reg
    with pytest.raises(UnknownName) as info:
        reg.get("aa")
    assert info.value.known == {"b": "p2"} and "b (from p2)" in str(info.value)


def test_unknown_name_in_an_empty_registry():
    with pytest.raises(UnknownName, match="none registered"):
        Registry("cache_method").get("teacache")


@pytest.mark.parametrize("bad", ["Upper", "", "-leading", "has space", "x/y"])
def test_spec_names_must_be_lower_case_identifiers(bad):
    with pytest.raises(ValueError, match="lower-case name"):
        ModelSpec(name=bad, impl="a.b:C")


@pytest.mark.parametrize("bad", ["no_colon", "a.b:", ":attr", "a b:c", None])
def test_impl_must_be_a_lazy_path(bad):
    with pytest.raises(ValueError, match="lazy 'module:attr' path"):
        CacheMethodSpec(name="c", impl=bad)


def test_optional_paths_may_be_none_but_not_malformed():
    assert PlatformSpec(name="p", impl="a.b:C").probe is None
    with pytest.raises(ValueError, match="probe"):
        PlatformSpec(name="p", impl="a.b:C", probe="nope")
    with pytest.raises(ValueError, match="builder"):
        PresetSpec(name="tiny", builder="x")


def test_resolve_follows_dotted_attributes_and_specs_load_lazily():
    assert resolve("os.path:join") is __import__("os").path.join
    assert resolve("omnicore.specs:ModelSpec.load_impl") is ModelSpec.load_impl
    spec = AttentionBackendSpec(name="sdpa", impl="omnicore.attention.reference:sdpa_attention")
    from omnicore.attention.reference import sdpa_attention

    assert spec.load_impl() is sdpa_attention
    with pytest.raises(ModuleNotFoundError):
        ModelSpec(name="m", impl="omnitest_missing_module_q:Pipe").load_impl()


def test_spec_kinds_cover_the_five_registries():
    from omnicore.specs import OpSpec

    assert SPEC_KINDS == {"model": ModelSpec, "platform": PlatformSpec,
                          "attention_backend": AttentionBackendSpec, "cache_method": CacheMethodSpec,
                          "op": OpSpec}
