"""What a stock diffusers pipeline can do, read from its class and its ``__call__`` signature.

``describe(pipe)`` maps the keyword arguments omnicore knows onto its request model: ``image`` becomes an input
role (``reference`` for image-to-image, ``first_frame`` for image-to-video, ``edit_source`` when the pipeline
also takes a ``mask_image``, which becomes the ``mask`` role), ``last_image`` the ``last_frame`` role, ``video`` a
video ``reference``; ``num_frames`` makes it a video pipeline. Everything else in the signature that is a plain
value (not a tensor, not a callback) may be passed through ``request.extra``, checked by name.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import attrs
from omnicore.plugin import InputRole, ModelCapabilities, ModelOption, RequestDefaults

#: keyword arguments the adapter itself sets from the request, never taken from ``extra``
MANAGED = frozenset({
    "prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2", "negative_prompt_3", "height", "width",
    "num_frames", "num_inference_steps", "guidance_scale", "generator", "latents", "output_type", "return_dict",
    "callback_on_step_end", "callback_on_step_end_tensor_inputs", "callback", "callback_steps",
    "num_images_per_prompt", "num_videos_per_prompt", "image", "mask_image", "video", "last_image",
    "timesteps", "sigmas", "attention_kwargs", "joint_attention_kwargs", "cross_attention_kwargs",
    # a modular pipeline's block inputs that the adapter or the pipeline state owns
    "resized_image", "image_latents", "output", "state",
})
#: suffixes of tensor-valued keywords (precomputed embeddings, latents): not expressible in a JSON request
TENSOR_SUFFIXES = ("_embeds", "_latents", "_mask", "_image_embeds", "_adapter_image")
#: class-name patterns of pipelines whose ``image`` / ``video`` input is required (no text-only mode)
CONDITIONED = re.compile(r"Img2Img|Inpaint|ImageToVideo|VideoToVideo|Image2Video|Video2Video")
#: pipelines whose ``image`` / ``mask_image`` lists mean one image per prompt (so rows of a batch can differ);
#: elsewhere a list may mean several references for one prompt (Kontext, Edit Plus ...), so those run alone
ONE_IMAGE_PER_PROMPT = re.compile(r"Img2Img|Inpaint")
#: keywords through which a video pipeline is told its frame rate (LTX: ``frame_rate``); the output's fps follows
FPS_KEYWORDS = ("frame_rate", "fps")


@attrs.frozen
class PipelineCard:
    """The omnicore view of one pipeline class (what ``DiffusersPipeline.spec`` narrows the generic spec to)."""

    class_name: str
    parameters: tuple[str, ...]  # every __call__ keyword
    extra_keys: tuple[str, ...]  # those a request may set through ``extra``
    video: bool
    roles: dict[str, str]  # omnicore role -> __call__ keyword
    conditioned: bool  # the image/video input is required
    batches_media: bool  # requests with different input images may share one call (one image per row)
    capabilities: ModelCapabilities
    defaults: RequestDefaults
    frame_multiple: int | None  # num_frames must be n * frame_multiple + 1 (temporal VAE compression)
    request_fields: tuple[ModelOption, ...] = ()  # the extra keys, typed, for /v1/models' model_params
    fps_keyword: str | None = None  # the __call__ keyword that takes the frame rate (the request's fps goes there)


def _field(name: str, param: inspect.Parameter) -> ModelOption:
    """A passed-through keyword as a typed request field (type from its default, else its annotation)."""
    default = None if param.default is inspect.Parameter.empty else param.default
    kind = {bool: "bool", int: "int", float: "float", str: "str"}.get(type(default))
    if kind is None:
        text = str(param.annotation)
        kind = next((t for t in ("bool", "float", "int") if t in text), "str")
    if not isinstance(default, (bool, int, float, str)):
        default = None
    return ModelOption(name, kind, default=default, help=f"`{name}` of the pipeline's __call__ (passed through)")


def call_parameters(pipe: Any) -> dict[str, inspect.Parameter]:
    """``__call__``'s keyword parameters; for a modular pipeline, its blocks' declared inputs."""
    from .modular import block_parameters, is_modular

    if is_modular(pipe):
        return block_parameters(pipe)
    params = dict(inspect.signature(type(pipe).__call__).parameters)
    params.pop("self", None)
    return params


def _default(params: dict[str, inspect.Parameter], name: str) -> Any:
    p = params.get(name)
    if p is None or p.default is inspect.Parameter.empty:
        return None
    return p.default


def _patch(pipe: Any) -> int:
    model = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    patch = getattr(getattr(model, "config", None), "patch_size", None) or 1
    if isinstance(patch, (list, tuple)):
        patch = patch[-1]
    return int(patch)


def size_multiple(pipe: Any) -> int:
    """Height and width must be multiples of the VAE's spatial factor times the (at least 2x2) latent patch."""
    vsf = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None) or 8
    return int(vsf) * max(_patch(pipe), 2) if getattr(pipe, "transformer", None) is not None else int(vsf)


def describe(pipe: Any, base: ModelCapabilities, defaults: RequestDefaults) -> PipelineCard:
    """The card of ``pipe``: roles, modes, outputs, limits and request defaults from its signature."""
    params = call_parameters(pipe)
    name = type(pipe).__name__
    video = "num_frames" in params
    conditioned = bool(CONDITIONED.search(name))
    roles: dict[str, str] = {}
    declared: list[InputRole] = []
    modes: list[str] = []
    base_mode = "t2v" if video else "t2i"
    if "image" in params:
        if "mask_image" in params:
            roles.update(edit_source="image", mask="mask_image")
            declared += [InputRole("edit_source", ("image",), description="the image to edit (`image`)"),
                         InputRole("mask", ("image",), description="white = repaint (`mask_image`)")]
            modes.append("inpaint")
        else:
            role = "first_frame" if video else "reference"
            roles[role] = "image"
            declared.append(InputRole(role, ("image",), description="`image` of the pipeline"))
            modes.append("i2v" if video else "i2i")
    if "last_image" in params:
        roles["last_frame"] = "last_image"
        declared.append(InputRole("last_frame", ("image",), description="`last_image` of the pipeline"))
    if "video" in params and "reference" not in roles:
        roles["reference"] = "video"
        declared.append(InputRole("reference", ("video",), description="`video` of the pipeline"))
        modes.append("v2v")
    if not (conditioned and roles):
        modes.insert(0, base_mode)
    extra = tuple(sorted(k for k, p in params.items()
                         if k not in MANAGED and not k.endswith(TENSOR_SUFFIXES)
                         and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)))
    temporal = getattr(pipe, "vae_scale_factor_temporal", None) if video else None
    multiple = size_multiple(pipe)
    from .audio import returns_audio

    outputs = (("video", "audio") if returns_audio(type(pipe)) else ("video",)) if video else ("image",)
    caps = attrs.evolve(base, modes=tuple(modes), outputs=outputs,
                        inputs=tuple(declared), size_multiple_of=multiple,
                        max_frames=None if video else 1,
                        frame_rule=f"{temporal}n+1" if temporal else None)
    sample = getattr(pipe, "default_sample_size", None)
    vsf = getattr(pipe, "vae_scale_factor", None)
    size = int(sample * vsf) if isinstance(sample, int) and isinstance(vsf, int) else None
    derived = {"height": _default(params, "height") or size, "width": _default(params, "width") or size,
               "num_frames": _default(params, "num_frames") if video else 1,
               "num_inference_steps": _default(params, "num_inference_steps"),
               "guidance_scale": _default(params, "guidance_scale")}
    fps_keyword = next((k for k in FPS_KEYWORDS if k in params), None) if video else None
    if fps_keyword is not None:  # the pipeline's own frame rate is the request's default fps
        derived["fps"] = _default(params, fps_keyword)
    derived = {k: v for k, v in derived.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return PipelineCard(class_name=name, parameters=tuple(params), extra_keys=extra, video=video, roles=roles,
                        conditioned=conditioned and bool(roles), capabilities=caps,
                        batches_media=bool(ONE_IMAGE_PER_PROMPT.search(name)) and "video" not in roles.values(),
                        defaults=attrs.evolve(defaults, **derived), frame_multiple=temporal,
                        request_fields=tuple(_field(k, params[k]) for k in extra), fps_keyword=fps_keyword)
