"""The example plugin's tests: omnicore's conformance kit on ``tiny:pixart`` (copy this file for your plugin).

Every check is inherited; the classes only say what to run. Keep the parameters tiny: the kit runs the preset
end to end through the engine many times.
"""

from __future__ import annotations

import pytest
from omnicore.testing import CacheMethodConformance, ModelPluginConformance, PluginConformance

PLUGIN = "omni_example_pixart.plugin"


class TestPixArtPlugin(PluginConformance):
    """Entry module imports no torch, hooks are marked, plugin_info matches, lazy paths resolve, entry point."""

    plugin_module = PLUGIN
    entry_point_name = "pixart"
    require_plugin_info = True


class TestPixArtModel(ModelPluginConformance):
    """End to end: shapes, determinism, validation, weight round trip, cancellation, progress, batching, attention."""

    model = "tiny:pixart"
    plugin_module = PLUGIN
    params = {"height": 32, "width": 32, "num_inference_steps": 2}
    invalid_params = {"height": 34, "num_frames": 2, "num_inference_steps": 0}  # 34: not a multiple of 4


class TestPixArtFirstBlockCache(CacheMethodConformance):
    """The first-block cache on PixArt's blocks: forced reuse really skips, and removing it restores everything."""

    cache_method = "first_block_cache"
    model = "tiny:pixart"
    plugin_module = PLUGIN
    reuse_config = {"force_hits": [2, 3]}  # random weights never look similar enough: force steps 2 and 3
    params = {"height": 32, "width": 32, "num_inference_steps": 5}


@pytest.mark.parametrize("offload", ["layerwise", "model"])
def test_offload_keeps_the_outputs(offload: str, tmp_path) -> None:
    """The declared block loop and offload modules are enough for both offload modes (bit-identical on CPU)."""
    import omnicore
    from omnicore.config import Settings
    from omnicore.testing import add_loaded, isolated_host

    settings = Settings(cache_dir=str(tmp_path))
    outputs = []
    for mode in ("none", offload):
        host = isolated_host(settings)
        add_loaded(host, PLUGIN)  # registered as its package name, omni_example_pixart; fails unless it loaded
        with omnicore.Engine("tiny:pixart", host=host, settings=settings, offload=mode) as engine:
            [out] = engine.generate("a red fox", height=32, width=32, num_inference_steps=2, seed=3)
            outputs.append(out.frames.tobytes())
    assert outputs[0] == outputs[1]
