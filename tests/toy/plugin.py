"""The toy model's registration: an inline plugin object (never an installed entry point)."""

from __future__ import annotations

from collections.abc import Callable

from omnicore.hookspecs import hookimpl
from omnicore.specs import ModelCapabilities, ModelSpec, PresetSpec, RequestDefaults

TOY_SPEC = ModelSpec(
    name="toy",
    impl="toy.pipeline:ToyPipeline",
    description="Test-only toy diffusion model (conv denoiser, flow-matching Euler).",
    aliases=("toydit",),
    detect="toy.pipeline:detect",
    capabilities=ModelCapabilities(
        modes=("t2i", "t2v"), outputs=("image", "video"), supports_batching=True, max_outputs_per_request=4,
        cache_methods=("teacache",), size_multiple_of=8, max_pixels=1024 * 1024, max_frames=64,
        honours_attention_backend=False,  # a conv net: no attention to route
        checkpointable=True,  # Euler: the latents are the whole step state
    ),
    defaults=RequestDefaults(height=32, width=32, num_frames=1, fps=8.0, num_inference_steps=4,
                             guidance_scale=1.0, flow_shift=None),
    presets=(PresetSpec(name="toy", builder="toy.pipeline:build_tiny", description="tiny toy checkpoint"),),
)


class ToyPlugin:
    """Registers :data:`TOY_SPEC`; pass ``spec=`` to register a variant (e.g. without batching)."""

    def __init__(self, spec: ModelSpec = TOY_SPEC) -> None:
        self.spec = spec

    @hookimpl
    def omnicore_register_models(self, register: Callable[[ModelSpec], None]) -> None:
        register(self.spec)
