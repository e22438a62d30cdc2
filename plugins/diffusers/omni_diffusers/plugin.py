"""Entry point (``[project.entry-points.omnicore] diffusers``): registers the generic ``diffusers`` model.

No torch or diffusers here (every ``omnicore`` command imports this module). The spec's capabilities are the
union of what the adapter can map; the loaded pipeline narrows them to the checkpoint's own ``__call__``
signature (``DiffusersPipeline.spec``), which is what the engine checks requests against and ``/v1/models``
shows. Checkpoints are claimed by ``omni_diffusers.detect:detect`` unless a dedicated plugin claims them.
"""

from __future__ import annotations

from typing import Any

from omnicore.plugin import InputRole, ModelCapabilities, ModelSpec, PresetSpec, RequestDefaults, hookimpl, model_plugin

SMALL = RequestDefaults(height=32, width=32, num_inference_steps=2, guidance_scale=3.5)


def _preset(name: str, builder: str, description: str, **defaults: Any) -> PresetSpec:
    import attrs

    return PresetSpec(name=f"tiny:diffusers-{name}", builder=f"omni_diffusers.presets:{builder}",
                      description=description, defaults=attrs.evolve(SMALL, **defaults))


MODEL_SPEC = ModelSpec(
    name="diffusers", impl="omni_diffusers.pipeline:DiffusersPipeline",
    description="any stock diffusers pipeline (model_index.json) or modular pipeline (modular_model_index.json) no "
                "dedicated plugin claims; modes, roles and defaults come from the pipeline's __call__ signature "
                "(a modular pipeline's block inputs) once loaded",
    detect="omni_diffusers.detect:detect",
    capabilities=ModelCapabilities(
        modes=("t2i", "i2i", "inpaint", "t2v", "i2v", "v2v"), outputs=("image", "video"),
        inputs=(InputRole("reference", ("image", "video"), description="`image` / `video` of the pipeline"),
                InputRole("edit_source", ("image",), description="`image` of an inpainting pipeline"),
                InputRole("first_frame", ("image",), description="`image` of an image-to-video pipeline"),
                InputRole("last_frame", ("image",), description="`last_image` of the pipeline"),
                InputRole("mask", ("image",), description="`mask_image` of an inpainting pipeline")),
        # through diffusers' own hooks (omni_diffusers.caching, omni_diffusers.hook_caches)
        cache_methods=("first_block_cache", "taylorseer_cache", "pyramid_attention_broadcast", "faster_cache",
                       "mag_cache"),
        # narrowed per loaded pipeline (omni_diffusers.attention): True where every attention module of its
        # denoisers runs omnicore's selected backend (FLUX, Wan, QwenImage ... through diffusers' dispatcher; plain
        # AttnProcessor2_0 UNets), False otherwise (SD3's joint processor calls SDPA itself)
        honours_attention_backend=True,
        # no step checkpoints: the stock pipeline's __call__ runs its own loop on a thread (omni_diffusers.stepper)
        # and keeps its sampler and latents in that call's locals, so a step's state cannot be exported or put back
        checkpointable=False),
    defaults=RequestDefaults(height=1024, width=1024, num_inference_steps=28, guidance_scale=3.5),
    presets=(
        _preset("flux", "build_flux", "random-weight FluxPipeline (1+1 layers) written by save_pretrained"),
        _preset("flux-modular", "build_flux_modular",
                "the same FLUX components as a modular pipeline (FluxAutoBlocks, modular_model_index.json)"),
        _preset("flux-img2img", "build_flux_img2img", "random-weight FluxImg2ImgPipeline (role reference)",
                num_inference_steps=4),
        _preset("flux-inpaint", "build_flux_inpaint",
                "random-weight FluxInpaintPipeline (roles edit_source + mask)", num_inference_steps=4),
        _preset("sd3", "build_sd3", "random-weight StableDiffusion3Pipeline (1 layer, 3 text encoders)",
                guidance_scale=7.0),
        _preset("wan", "build_wan", "random-weight WanPipeline (2 layers, text to video)", num_frames=5,
                guidance_scale=5.0),
    ),
)


#: plugin_info() (kind, the spec's name and presets) and the registration hook, derived from MODEL_SPEC
plugin_info, omnicore_register_models = model_plugin(MODEL_SPEC, api=">=1.7,<2")


@hookimpl
def omnicore_register_cache_methods(register: Any) -> None:
    """diffusers' other step caches, as omnicore cache methods of this adapter (omni_diffusers.hook_caches)."""
    from .hook_caches import register as register_hook_caches

    register_hook_caches(register)


@hookimpl(tryfirst=True)
def omnicore_cache(pipeline: Any, method: Any, config: Any) -> Any:
    """Caches on this adapter's pipelines go through diffusers' hooks; other pipelines are not ours (None)."""
    if type(pipeline).__module__ != "omni_diffusers.pipeline":
        return None
    from .caching import enable

    return enable(pipeline, method, config)
