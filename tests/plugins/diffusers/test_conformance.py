"""omnicore's conformance kit on the generic diffusers adapter: FLUX text-to-image, SD3, Wan text-to-video, FLUX
inpaint (each a stock diffusers pipeline class written by ``save_pretrained``) and the modular FLUX
(``omni_diffusers.presets``)."""

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


def _inpaint_inputs() -> list:
    import numpy as np
    from omnicore.plugin import MediaInput
    from PIL import Image

    source = Image.fromarray(np.random.default_rng(2).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    mask = Image.fromarray(np.where(np.arange(32)[None, :, None] < 16, 255, 0).repeat(32, 0).repeat(3, 2)
                           .astype(np.uint8))
    return [MediaInput("image", "edit_source", source), MediaInput("image", "mask", mask)]


@pytest.mark.slow
class TestFluxInpaintThroughTheAdapter(ModelPluginConformance):
    """FluxInpaintPipeline (roles edit_source + mask) end to end; strength 1 runs every requested step (the kit
    checks that progress counts them all)."""

    model = "tiny:diffusers-flux-inpaint"
    plugin_module = PLUGIN
    params = {"height": 32, "width": 32, "num_inference_steps": 4, "inputs": _inpaint_inputs(),
              "extra": {"strength": 1.0}}
    invalid_params = {"height": 33, "num_frames": 2, "num_inference_steps": 0}


@pytest.mark.slow
class TestModularFluxThroughTheAdapter(ModelPluginConformance):
    """The modular FLUX (FluxAutoBlocks, modular_model_index.json) with the engine driving its denoise loop:
    cancelling one row of a batch shrinks the batch (select_requests) instead of computing the row to the end."""

    model = "tiny:diffusers-flux-modular"
    plugin_module = PLUGIN
    params = {"height": 32, "width": 32, "num_inference_steps": 2}
    invalid_params = {"height": 33, "num_frames": 2, "num_inference_steps": 0}
