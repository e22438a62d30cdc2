"""The entry-point module: the registered spec, detection, and the omnicore conformance kit (plugin checks,
including the no-torch import of the entry module, and end-to-end model checks on both tiny presets)."""

from __future__ import annotations

from omnicore.testing import CacheMethodConformance, ModelPluginConformance, PluginConformance, isolated_host


def test_entry_point_registers_the_model():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="omnicore") if e.name == "lingbot"]
    assert ep.value == "omni_lingbot.plugin"
    host = isolated_host()
    host.add_plugin(ep.load(), "lingbot")
    spec = host.models.get("lingbot")
    assert host.models.get("LingBotVideoPipeline") is spec  # model_index.json _class_name alias
    assert host.models.get("LingBotVideoTransformer3DModel") is spec
    assert spec.impl == "omni_lingbot.pipeline:LingBotPipeline" and spec.provider == "lingbot"
    assert [p.name for p in spec.presets] == ["tiny:lingbot", "tiny:lingbot-moe"]
    caps, d = spec.capabilities, spec.defaults
    assert caps.modes == ("t2i", "t2v", "ti2v") and caps.outputs == ("image", "video")
    assert caps.max_reference_images == 1 and caps.supports_batching and caps.max_outputs_per_request == 1
    assert (d.height, d.width, d.num_frames, d.fps, d.num_inference_steps, d.guidance_scale, d.flow_shift) == \
        (480, 480, 81, 24.0, 40, 6.0, 3.0)
    from omni_lingbot.pipeline import LingBotPipeline

    assert spec.load_impl() is LingBotPipeline


def test_detect(tiny_dir, tmp_path):
    from omni_lingbot.detect import detect

    assert detect(tiny_dir)
    assert not detect(tmp_path)
    (tmp_path / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    assert not detect(tmp_path)
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text('{"_class_name": "LingBotVideoTransformer3DModel"}')
    assert detect(tmp_path)


class TestLingBotPluginConformance(PluginConformance):
    """Entry module imports no torch/diffusers/transformers (fresh interpreter), hooks are marked, plugin_info
    matches the registrations, every lazy path resolves, registration is repeatable, the entry point is installed."""

    plugin_module = "omni_lingbot.plugin"
    plugin_name = "lingbot"
    entry_point_name = "lingbot"
    require_plugin_info = True


class TestLingBotConformance(ModelPluginConformance):
    """omnicore's end-to-end conformance checks on ``tiny:lingbot`` (through the engine and the preset cache)."""

    model = "tiny:lingbot"
    plugin_module = "omni_lingbot.plugin"
    plugin_name = "lingbot"
    params = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 2.0}


class TestLingBotMoEConformance(TestLingBotConformance):
    """The same end-to-end checks on ``tiny:lingbot-moe`` (block 1 routed), with batch CFG exercised."""

    model = "tiny:lingbot-moe"
    params = {**TestLingBotConformance.params, "extra": {"batch_cfg": True}}


class TestLingBotFirstBlockCache(CacheMethodConformance):
    """The first-block cache on the DiT's blocks (both CFG branches): forced reuse really skips and is reported,
    and removing the cache restores the pipeline byte for byte."""

    cache_method = "first_block_cache"
    model = "tiny:lingbot"
    plugin_module = "omni_lingbot.plugin"
    reuse_config = {"force_hits": [2, 3]}  # random weights never look similar enough: force steps 2 and 3
    params = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 5, "guidance_scale": 2.0}
