"""``diffusers:<dir or repo id>``: the adapter serves the checkpoint by name, with no layout detection (the same
``<model name>:`` prefix works for every registered model)."""

from __future__ import annotations

import numpy as np
import pytest
from _diffusers_helpers import make_engine


def _image(engine) -> np.ndarray:
    out = engine.generate("a red fox", height=64, width=64, num_inference_steps=2, seed=3)[0]
    return np.asarray(out.frames)


def test_the_prefix_names_the_model_that_serves_a_directory(settings):
    from omnicore.engine.loading import resolve_model
    from omnicore.plugin_host.host import PluginHost

    host = PluginHost(settings)
    preset = resolve_model("tiny:diffusers-flux", host, settings)
    explicit = resolve_model(f"diffusers:{preset.path}", host, settings)
    assert (explicit.spec.name, explicit.path, explicit.source) == ("diffusers", preset.path, "local")
    with make_engine("tiny:diffusers-flux", settings) as a, make_engine(f"diffusers:{preset.path}", settings) as b:
        assert np.array_equal(_image(a), _image(b))


def test_a_prefix_without_a_checkpoint_is_refused_naming_it(settings, tmp_path):
    from omnicore.cli.checks import resolve_before_load
    from omnicore.engine.loading import resolve_model
    from omnicore.errors import InvalidRequest
    from omnicore.plugin_host.host import PluginHost

    host = PluginHost(settings)
    missing = tmp_path / "nowhere" / "x"
    with pytest.raises(InvalidRequest, match="neither a checkpoint directory nor a Hugging Face repo id"):
        resolve_model(f"diffusers:{missing}", host, settings)
    with pytest.raises(InvalidRequest, match="neither a checkpoint directory nor a Hugging Face repo id"):
        resolve_before_load(f"diffusers:{missing}", host)
    spec, preset = resolve_before_load(f"diffusers:{tmp_path}", host)
    assert spec.name == "diffusers" and preset is None
