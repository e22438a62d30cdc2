"""The entry-point module, its registrations, and omnicore's conformance kit on ``tiny:hunyuan-image3``."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from omnicore.testing import ModelPluginConformance, PluginConformance, isolated_host


def test_entry_point_registers_the_model():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="omnicore") if e.name == "hunyuan"]
    assert ep.value == "omni_hunyuan.plugin"
    host = isolated_host()
    host.add_plugin(ep.load(), "hunyuan")
    spec = host.models.get("hunyuan-image3")
    assert host.models.get("HunyuanImage3ForCausalMM") is spec
    assert spec.impl == "omni_hunyuan.pipeline:HunyuanImage3Pipeline" and spec.provider == "hunyuan"
    assert [p.name for p in spec.presets] == ["tiny:hunyuan-image3"]
    assert spec.capabilities.modes == ("t2i", "edit") and spec.capabilities.max_reference_images >= 1
    assert spec.defaults.guidance_scale == 5.0 and spec.defaults.num_inference_steps == 50
    kv = {o.name: o for o in spec.options}["kv_mode"]
    assert kv.default == "dense_legacy" and set(kv.choices) == {"dense_legacy", "paged_scheduler",
                                                                  "paged_worker_local"}
    from omni_hunyuan.pipeline import HunyuanImage3Pipeline

    assert spec.load_impl() is HunyuanImage3Pipeline


def test_server_serves_generation_and_edits():
    from omni_hunyuan.plugin import MODEL_SPEC
    from omnicore.server.translate import ServedModel

    assert ServedModel.from_spec(MODEL_SPEC).tasks == ("image.generate", "image.edit")


class TestHunyuanPluginConformance(PluginConformance):
    """Entry module imports no torch/transformers (fresh interpreter), hooks are marked, plugin_info matches the
    registrations, every lazy path resolves, registration is repeatable, the entry point is installed."""

    plugin_module = "omni_hunyuan.plugin"
    plugin_name = "hunyuan"
    entry_point_name = "hunyuan"
    require_plugin_info = True


@pytest.mark.slow
class TestHunyuanConformance(ModelPluginConformance):
    """omnicore's end-to-end checks on ``tiny:hunyuan-image3`` (through the engine and the preset cache)."""

    model = "tiny:hunyuan-image3"
    plugin_module = "omni_hunyuan.plugin"
    plugin_name = "hunyuan"
    params: ClassVar[dict[str, Any]] = {"height": 256, "width": 256, "num_inference_steps": 2, "guidance_scale": 3.0}
    runtime_steps = 3
