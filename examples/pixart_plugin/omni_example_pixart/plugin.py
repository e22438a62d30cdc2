"""Entry point (``[project.entry-points.omnicore] pixart``): registers the ``pixart-sigma`` model. No torch here."""

from __future__ import annotations

from typing import Any

from omnicore.plugin import ModelCapabilities, ModelSpec, PresetSpec, RequestDefaults, hookimpl

MODEL_SPEC = ModelSpec(
    name="pixart-sigma", impl="omni_example_pixart.pipeline:PixArtPipeline",
    description="PixArt-Sigma text-to-image through diffusers' PixArtSigmaPipeline (example plugin)",
    aliases=("pixartsigmapipeline",),  # model_index.json `_class_name`: local checkpoint dirs are recognised
    capabilities=ModelCapabilities(modes=("t2i",), outputs=("image",), cache_methods=("first_block_cache",)),
    defaults=RequestDefaults(height=1024, width=1024, num_inference_steps=20, guidance_scale=4.5),
    presets=(PresetSpec(name="tiny:pixart", builder="omni_example_pixart.presets:build_tiny",
                        defaults=RequestDefaults(height=64, width=64, num_inference_steps=4, guidance_scale=4.5),
                        description="random-weight PixArt-Sigma (2 layers) in the diffusers layout"),),
)


def plugin_info() -> dict[str, Any]:
    return {"kind": "model", "api": ">=1.0,<2", "models": [MODEL_SPEC.name]}


@hookimpl
def omnicore_register_models(register: Any) -> None:
    register(MODEL_SPEC)
