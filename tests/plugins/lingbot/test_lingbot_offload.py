"""``Engine(offload=...)`` on tiny:lingbot: outputs are bit-identical to the resident model, the offloaded
weights really leave between uses, and closing the engine puts them back."""

from __future__ import annotations

import numpy as np
import pytest
from omnicore.config import Settings
from omnicore.engine.api import Engine
from omnicore.plugin_host.host import PluginHost


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    return Settings(cache_dir=str(tmp_path_factory.mktemp("cache")))


def _generate(settings, offload):
    host = PluginHost(settings)
    engine = Engine("tiny:lingbot", host=host, settings=settings, offload=offload)
    try:
        frames = engine.generate("a red fox", height=32, width=32, num_frames=5, num_inference_steps=2,
                                 guidance_scale=2.0, seed=7)[0].frames
        return frames, engine
    finally:
        engine.close()


def _storage_bytes(module):
    return sum(p.untyped_storage().nbytes() for p in module.parameters())


@pytest.mark.parametrize("mode", ["layerwise", "model"])
def test_offloaded_generation_is_identical_to_resident(settings, mode):
    ref, _ = _generate(settings, "none")
    out, engine = _generate(settings, mode)
    assert np.array_equal(out, ref)
    # close() removed the offload: every parameter is materialised again
    assert all(p.numel() > 0 and p.untyped_storage().nbytes() > 0 for p in engine.pipeline.transformer.parameters())


def test_layerwise_offload_keeps_only_the_next_block_materialised(settings):
    host = PluginHost(settings)
    engine = Engine("tiny:lingbot", host=host, settings=settings, offload="layerwise")
    try:
        blocks = engine.pipeline.transformer.blocks
        assert _storage_bytes(blocks[0]) > 0  # ready for the first forward
        assert all(_storage_bytes(b) == 0 for b in list(blocks)[1:])  # the rest wait on the host
    finally:
        engine.close()


def test_model_offload_frees_the_transformer_between_forwards(settings):
    host = PluginHost(settings)
    engine = Engine("tiny:lingbot", host=host, settings=settings, offload="model")
    try:
        engine.generate("a red fox", height=32, width=32, num_frames=1, num_inference_steps=1, seed=1,
                        output_type="image")
        assert _storage_bytes(engine.pipeline.transformer) == 0
    finally:
        engine.close()
