"""Request rules: ``bot_task``, CoT text, guidance, sizes,
KV mode, the accepted model-specific fields. Pure functions raising typed errors that name the field.

Nothing a client set is changed or dropped silently: a model-specific field this model does not know is refused
(``unknown_parameter``), and an explicit size that is not one of the model's resolution buckets is refused naming
the nearest buckets (the reference snaps it to the nearest-ratio bucket without saying so). Only a size the client
left out (the base size, or an edit's input image size) is snapped; the size used is reported with the result.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnicore.plugin import ConfigError, InvalidRequest, UnsupportedFeature

from .buckets import Bucket, ResolutionGroup

BOT_TASKS = ("auto", "image", "think", "recaption", "img_ratio")
BOT_TASK_ALIASES = {"think_recaption": "think", "vanilla": "image"}
DEFAULT_GUIDANCE = 5.0

#: Fields a prompt mapping may carry besides ``prompt`` (the request's ``extra`` wins when both set one).
PROMPT_FIELDS = ("bot_task", "use_system_prompt", "system_prompt", "ar_generated_text", "sequence_template",
                 "drop_think", "guidance_rescale")
#: Model-specific request fields (``GenerationRequest.extra``, HTTP ``model_params``); anything else is refused.
EXTRA_FIELDS = ("mode", *PROMPT_FIELDS)
UNKNOWN = "unknown_parameter"  # the HTTP error code of a field this model does not take

KV_MODES = ("dense_legacy", "paged_worker_local", "paged_scheduler")
KV_MODE_RESERVED = "paged_worker_local"

#: Our own short system prompts for the ``use_system_prompt`` names (checkpoints may ship longer ones; pass
#: ``extra.system_prompt`` to use exact text).
SYSTEM_PROMPTS = {
    "en_vanilla": "You are an assistant that draws images from descriptions.",
    "en_recaption": "You are an assistant that rewrites a description in detail, then draws it.",
    "en_unified": "You are a multimodal assistant: you understand images and text, think when useful, "
                  "and draw or edit images as asked.",
}


def normalize_bot_task(value: Any, field: str = "extra.bot_task") -> str | None:
    """``None`` -> ``auto``; ``"none"`` (any case) -> ``None``; aliases ``think_recaption`` -> ``think``,
    ``vanilla`` -> ``image``; anything else outside :data:`BOT_TASKS` is an error."""
    if value is None:
        return "auto"
    if not isinstance(value, str):
        raise InvalidRequest(field, f"must be a string, got {type(value).__name__}")
    text = value.strip()
    if text.lower() == "none":
        return None
    text = BOT_TASK_ALIASES.get(text, text)
    if text not in BOT_TASKS:
        raise InvalidRequest(field, f"Unsupported HunyuanImage3 single-stage bot_task {value!r}; expected one of "
                                    f"{', '.join(BOT_TASKS)} (or think_recaption, vanilla, none)")
    return text


def normalize_cot(text: Any, field: str = "extra.ar_generated_text") -> str | None:
    """AR-stage text: prepend ``<think>``/``<recaption>`` when only the closing tag is present."""
    if text is None or text == "":
        return None
    if not isinstance(text, str):
        raise InvalidRequest(field, f"must be a string, got {type(text).__name__}")
    for open_tag, close_tag in (("<think>", "</think>"), ("<recaption>", "</recaption>")):
        if close_tag in text and open_tag not in text:
            text = open_tag + text
    return text


def resolve_guidance(explicit: float | None, cfg_distilled: bool) -> tuple[float, int]:
    """``(guidance, cfg_factor)``: the request's scale when given, else 5.0; two rows only when guidance > 1
    and the checkpoint is not CFG-distilled (a distilled one embeds the scale as the ``<guidance>`` token)."""
    guidance = DEFAULT_GUIDANCE if explicit is None else float(explicit)
    return guidance, 1 + int(guidance > 1.0 and not cfg_distilled)


def resolve_system_prompt(extra: Mapping[str, Any], default_name: str | None) -> str | None:
    if extra.get("system_prompt") is not None:
        text = extra["system_prompt"]
        if not isinstance(text, str):
            raise InvalidRequest("extra.system_prompt", f"must be a string, got {type(text).__name__}")
        return text or None
    name = extra.get("use_system_prompt", default_name)
    if name is None or (isinstance(name, str) and name.lower() == "none"):
        return None
    if name not in SYSTEM_PROMPTS:
        raise InvalidRequest("extra.use_system_prompt", f"must be one of {sorted(SYSTEM_PROMPTS)} or None, "
                                                        f"got {name!r}")
    return SYSTEM_PROMPTS[name]


def check_extra(extra: Mapping[str, Any]) -> None:
    """Refuse a model-specific field this model does not take (it would otherwise be dropped silently)."""
    unknown = sorted(set(extra) - set(EXTRA_FIELDS))
    if unknown:
        raise InvalidRequest(f"extra.{unknown[0]}", f"unknown HunyuanImage-3 field {unknown[0]!r}; accepted: "
                                                    f"{', '.join(EXTRA_FIELDS)}", code=UNKNOWN)


def check_prompt_mapping(prompt: Mapping[str, Any]) -> None:
    """A prompt mapping holds ``prompt`` and the :data:`PROMPT_FIELDS`; any other key is refused."""
    unknown = sorted(set(prompt) - {"prompt", *PROMPT_FIELDS})
    if unknown:
        raise InvalidRequest(f"prompt.{unknown[0]}", f"unknown key {unknown[0]!r} in the prompt mapping; accepted: "
                                                     f"prompt, {', '.join(PROMPT_FIELDS)}", code=UNKNOWN)


def nearest_sizes(height: int, width: int, buckets: ResolutionGroup, factor: int = 16, count: int = 3) -> list[Bucket]:
    """Up to ``count`` usable buckets (sides divisible by ``factor``) closest to ``height/width`` in ratio, then
    in area."""
    ratio, area = height / width, height * width
    usable = [b for b in buckets.buckets if not (b.height % factor or b.width % factor)]
    return sorted(usable, key=lambda b: (abs(b.ratio - ratio), abs(b.height * b.width - area), b.index))[:count]


def snap_size(height: int, width: int, buckets: ResolutionGroup, factor: int = 16, *,
              explicit: bool = False) -> Bucket:
    """The nearest-ratio bucket; a ratio beyond the most extreme buckets, or a bucket the latent grid cannot
    tile, is an error naming ``params.height``. With ``explicit`` (the client set the size) the size must *be* a
    bucket: anything else is refused naming the nearest buckets, never resized silently."""
    lo, hi = buckets.ratio_range
    ratio = height / width
    if not lo - 1e-9 <= ratio <= hi + 1e-9:
        raise InvalidRequest("params.height", f"{width}x{height} (height/width {ratio:.3f}) is outside the model's "
                                              f"resolution buckets (height/width from {lo:.3f} to {hi:.3f})")
    bucket = buckets.nearest(height, width)
    if explicit and (bucket.height, bucket.width) != (height, width):
        near = " or ".join(f"{b.width}x{b.height}" for b in nearest_sizes(height, width, buckets, factor))
        raise InvalidRequest("params.height", f"{width}x{height} is not one of this model's sizes (HunyuanImage-3 "
                                              f"generates at {len(buckets)} fixed resolution buckets of base "
                                              f"{buckets.base_size}); nearest: {near}")
    if bucket.height % factor or bucket.width % factor:
        raise InvalidRequest("params.height", f"{width}x{height} snaps to bucket {bucket.width}x{bucket.height}, "
                                              f"which is not a multiple of {factor}; this checkpoint's base size "
                                              f"{buckets.base_size} supports only buckets divisible by {factor}")
    return bucket


def parse_kv_mode(value: Any) -> str:
    """The deployment's diffusion-KV mode. Unknown values list the valid ones; the reserved worker-local
    mode is rejected as not implemented."""
    text = getattr(value, "value", value)
    if text is None:
        return "dense_legacy"
    if not isinstance(text, str) or text not in KV_MODES:
        raise ConfigError("kv_mode", f"Unsupported Diffusion KV diffusion_kv_mode {text!r}; expected one of: "
                                     f"{', '.join(KV_MODES)}")
    if text == KV_MODE_RESERVED:
        raise UnsupportedFeature("kv_mode", f"{KV_MODE_RESERVED!r} is reserved but not implemented; use "
                                            "'dense_legacy' or 'paged_scheduler'")
    return text
