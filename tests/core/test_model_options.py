"""Model options (typed, checked at load), ``vae_decode_precision``, per-preset request defaults and the model's
default seed, through ``Engine`` (issue 8 items 2, 7, 8; issue 15 per-preset defaults)."""

from __future__ import annotations

import numpy as np
import pytest
from omnicore.config import Settings
from omnicore.engine.api import Engine
from omnicore.engine.model_options import coerce_option, resolve_model_options
from omnicore.errors import ConfigError
from omnicore.specs import ModelOption
from toy import TOY_SPEC, ToyPlugin, toy_host
from toy.media import TOY_MEDIA_PRESET_DEFAULTS, TOY_MEDIA_SPEC


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("options-cache")


def media_engine(cache, model="tiny:toy-media", **kw):
    settings = Settings(cache_dir=str(cache))
    return Engine(model, host=toy_host(settings, plugin=ToyPlugin(TOY_MEDIA_SPEC)), settings=settings, **kw)


@pytest.mark.parametrize(("option", "raw", "value"), [
    (ModelOption("a", "bool"), "yes", True), (ModelOption("a", "bool"), "0", False),
    (ModelOption("a", "bool"), True, True),
    (ModelOption("a", "int"), "12", 12), (ModelOption("a", "int"), 7, 7),
    (ModelOption("a", "float"), "0.25", 0.25), (ModelOption("a", "float"), 2, 2.0),
    (ModelOption("a", "path"), "/x/y", "/x/y"), (ModelOption("a", "str", choices=("k", "v")), "v", "v"),
    (ModelOption("a", "int", choices=(1, 2)), "2", 2),
])
def test_values_are_converted_to_the_declared_type(option, raw, value):
    out = coerce_option(option, raw)
    assert out == value and type(out) is type(value)


@pytest.mark.parametrize(("option", "raw", "words"), [
    (ModelOption("a", "bool"), "maybe", "must be a boolean (true/false), got 'maybe'"),
    (ModelOption("a", "int"), "1.5", "must be of type int, got '1.5'"),
    (ModelOption("a", "int"), True, "must be of type int, got True"),
    (ModelOption("a", "float"), "nan", "must be of type float"),
    (ModelOption("a", "str"), 3, "must be of type str, got 3"),
    (ModelOption("a", "str", choices=("k", "v")), "x", "must be one of 'k', 'v', got 'x'"),
])
def test_bad_values_name_the_option_and_what_is_allowed(option, raw, words):
    with pytest.raises(ConfigError) as info:
        coerce_option(option, raw)
    assert info.value.name == "model_options.a" and words in info.value.rule


def test_every_declared_option_is_present_with_defaults_filled():
    assert resolve_model_options(TOY_MEDIA_SPEC, {"variant": "large"}) == {
        "conditioning_shift": 0.0, "variant": "large", "revise_prompt": False}
    assert resolve_model_options(TOY_SPEC, None) == {}
    with pytest.raises(ConfigError, match="declares no options"):
        resolve_model_options(TOY_SPEC, {"x": 1})


def test_engine_passes_checked_options_to_the_loader(cache):
    with media_engine(cache, model_options={"conditioning_shift": "0.5", "revise_prompt": "on"}) as e:
        assert e.pipeline.options.model_options == {"conditioning_shift": 0.5, "variant": "base",
                                                    "revise_prompt": True}
        assert e.model_options == e.pipeline.options.model_options
        [out] = e.generate("a kite", seed=1)
        assert out.text == "revised: a kite"
    with media_engine(cache) as plain:
        [ref] = plain.generate("a kite", seed=1)
        assert ref.text is None and not np.array_equal(ref.frames, out.frames)  # the shift reached the model


@pytest.mark.parametrize(("options", "name"), [({"variant": "huge"}, "model_options.variant"),
                                               ({"colour": "red"}, "model_options.colour")])
def test_engine_rejects_bad_options_before_loading(cache, monkeypatch, options, name):
    from toy.media import ToyMediaPipeline

    def never(*a, **k):
        raise AssertionError("the pipeline was loaded despite a bad option")

    monkeypatch.setattr(ToyMediaPipeline, "from_pretrained", classmethod(never))
    with pytest.raises(ConfigError) as info:
        media_engine(cache, model_options=options)
    assert info.value.name == name


def test_vae_decode_precision_is_checked_and_passed(cache):
    with pytest.raises(ConfigError) as info:
        media_engine(cache, vae_decode_precision="fp8")
    assert info.value.name == "vae_decode_precision"
    assert info.value.rule == "must be one of {'fp32', 'fp16', 'bf16'} or None, got 'fp8'"  # docs/contracts-status.md C7.4
    with media_engine(cache, vae_decode_precision="BF16") as e:
        assert e.pipeline.options.vae_decode_precision == "bf16"


def test_preset_defaults_and_the_default_seed(cache):
    with media_engine(cache) as e:
        assert e.spec.defaults == TOY_MEDIA_PRESET_DEFAULTS  # the preset's, not the model's
        a, b = e.generate("a kite")[0], e.generate("a kite")[0]
        assert a.seed == b.seed == 1234 and np.array_equal(a.frames, b.frames)
        assert (a.width, a.height) == (16, 16)
        assert e.generate("a kite", seed=9)[0].seed == 9  # an explicit seed wins
        path = e.resolved.path
    # the same checkpoint loaded as a directory (not through the preset): the model's defaults, random seeds
    with media_engine(cache, model=str(path)) as d:
        assert d.spec.defaults == TOY_MEDIA_SPEC.defaults and d.spec.defaults.seed is None
        seeds = {d.generate("a kite")[0].seed for _ in range(3)}
        out = d.generate("a kite", seed=1)[0]
    assert len(seeds) > 1 and (out.width, out.height) == (32, 32)
