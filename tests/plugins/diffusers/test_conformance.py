"""omnicore's conformance kit on the generic diffusers adapter: a FLUX text-to-image and a Wan text-to-video
checkpoint, each a stock diffusers pipeline class written by ``save_pretrained`` (``omni_diffusers.presets``)."""

from __future__ import annotations

import pytest
from omnicore.testing import ModelPluginConformance, PluginConformance

pytest.importorskip("diffusers")
PLUGIN = "omni_diffusers.plugin"


class TestDiffusersPlugin(PluginConformance):
    """Entry module imports no torch/diffusers, hooks are marked, plugin_info matches, lazy paths resolve."""

    plugin_module = PLUGIN
    entry_point_name = "diffusers"
    require_plugin_info = True


@pytest.mark.slow
class TestFluxThroughTheAdapter(ModelPluginConformance):
    """FluxPipeline end to end: determinism, validation, round trip, cancellation, progress, batching."""

    model = "tiny:diffusers-flux"
    plugin_module = PLUGIN
    params = {"height": 32, "width": 32, "num_inference_steps": 2}
    invalid_params = {"height": 33, "num_frames": 2, "num_inference_steps": 0, "guidance_scale": float("nan")}


@pytest.mark.slow
class TestSD3ThroughTheAdapter(ModelPluginConformance):
    """StableDiffusion3Pipeline (classifier-free guidance over three text encoders) end to end."""

    model = "tiny:diffusers-sd3"
    plugin_module = PLUGIN
    params = {"height": 32, "width": 32, "num_inference_steps": 2}
    invalid_params = {"height": 33, "num_frames": 2, "num_inference_steps": 0}


@pytest.mark.slow
class TestWanThroughTheAdapter(ModelPluginConformance):
    """WanPipeline (text to video, 5 frames) end to end."""

    model = "tiny:diffusers-wan"
    plugin_module = PLUGIN
    params = {"height": 32, "width": 32, "num_inference_steps": 2, "num_frames": 5}
    invalid_params = {"height": 40, "num_frames": 4, "num_inference_steps": 0}
