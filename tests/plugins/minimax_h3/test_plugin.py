"""The entry-point module: the registered spec, detection, and the omnicore conformance kit (plugin checks,
including the no-torch import of the entry module, and end-to-end model checks on both tiny presets)."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from omnicore.testing import ModelPluginConformance, PluginConformance, isolated_host


def test_entry_point_registers_the_model():
    from importlib.metadata import entry_points

    (ep,) = [e for e in entry_points(group="omnicore") if e.name == "minimax_h3"]
    assert ep.value == "omni_minimax_h3.plugin"
    host = isolated_host()
    host.add_plugin(ep.load(), "minimax_h3")
    spec = host.models.get("minimax-h3")
    assert host.models.get("MiniMaxH3ModularPipeline") is spec
    assert host.models.get("MiniMaxH3Transformer3DModel") is spec
    assert [p.name for p in spec.presets] == ["tiny:minimax-h3", "tiny:minimax-h3-ref2va"]
    caps, d = spec.capabilities, spec.defaults
    assert caps.modes == ("t2va", "fl2va", "ref2va") and caps.outputs == ("video", "audio")
    assert [(r.role, r.kinds, r.max_count) for r in caps.inputs] == [
        ("first_frame", ("image",), 1), ("last_frame", ("image",), 1), ("reference", ("image", "video", "audio"), 12)]
    assert caps.default_role("image").role == "first_frame" and caps.default_role("audio").role == "reference"
    assert set(caps.cache_methods) == {"teacache", "adaln_schedule"} and caps.needs_packed_varlen
    assert (d.fps, d.num_frames, d.num_inference_steps, d.seed, d.flow_shift) == (24.0, 209, 49, 42, 12.0)
    from omni_minimax_h3.pipeline import MiniMaxH3Pipeline

    assert spec.load_impl() is MiniMaxH3Pipeline


def test_detect(tiny_dir, tmp_path):
    from omni_minimax_h3.detect import detect

    assert detect(tiny_dir)
    assert not detect(tmp_path)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    assert not detect(tmp_path)
    official = tmp_path / "FL2VA"
    official.mkdir()
    (official / "model_index.json").write_text(json.dumps({"_minimax_h3": {"partition": "fl2va"}}))
    assert detect(tmp_path)


class TestMiniMaxH3PluginConformance(PluginConformance):
    """Entry module imports no torch/diffusers/transformers (fresh interpreter), hooks are marked, plugin_info
    matches the registrations, every lazy path resolves, registration is repeatable, the entry point is installed."""

    plugin_module = "omni_minimax_h3.plugin"
    plugin_name = "minimax_h3"
    entry_point_name = "minimax_h3"
    require_plugin_info = True


class TestMiniMaxH3Conformance(ModelPluginConformance):
    """omnicore's end-to-end conformance checks on ``tiny:minimax-h3`` (t2va through the engine)."""

    model = "tiny:minimax-h3"
    plugin_module = "omni_minimax_h3.plugin"
    plugin_name = "minimax_h3"
    params: ClassVar[dict[str, Any]] = {"num_inference_steps": 2, "height": 64, "width": 64, "num_frames": 107,
                                        "extra": {"aspect_ratio": "1:1"}}


def _reference_image():
    import numpy as np
    from omnicore.engine.request import MediaInput

    pixels = np.random.default_rng(0).integers(0, 256, (256, 320, 3), dtype=np.uint8)
    return (MediaInput("image", "reference", pixels),)


class TestMiniMaxH3Ref2VAConformance(TestMiniMaxH3Conformance):
    """The same checks on ``tiny:minimax-h3-ref2va`` with an image reference."""

    model = "tiny:minimax-h3-ref2va"
    params: ClassVar[dict[str, Any]] = {"num_inference_steps": 2, "height": 64, "width": 64, "num_frames": 107,
                                        "extra": {}, "inputs": _reference_image()}
