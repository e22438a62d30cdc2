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
#: The text stage's fields (``extra`` only): its token budget and sampling, and ``image_size="auto"``.
TEXT_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "image_size")
#: Model-specific request fields (``GenerationRequest.extra``, HTTP ``model_params``); anything else is refused.
EXTRA_FIELDS = ("mode", *PROMPT_FIELDS, *TEXT_FIELDS)
#: What the text stage writes for each raw ``bot_task`` (``None``: no text); ``think_recaption`` keeps its own
#: meaning here (think, then a forced ``<recaption>``) although the single-stage rules alias it to ``think``.
TEXT_TASKS = {"think": "think", "recaption": "recaption", "think_recaption": "think_recaption"}
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


def text_task(value: Any) -> str | None:
    """The text stage's task for a raw ``bot_task`` (validated by :func:`normalize_bot_task` first):
    ``think``, ``recaption``, ``think_recaption`` or ``None`` (``auto``, ``image``, ``img_ratio``: no text)."""
    if not isinstance(value, str):
        return None
    return TEXT_TASKS.get(value.strip())


def wants_ratio(bot_task: str | None, image_size: Any, size_given: bool) -> bool:
    """Whether the model's ratio token chooses the bucket: ``bot_task="img_ratio"`` or ``image_size="auto"``.
    ``image_size`` takes only ``"auto"`` (an explicit size goes in ``params.height/width``), and a size the
    client set cannot be combined with it."""
    if image_size is not None and image_size != "auto":
        raise InvalidRequest("extra.image_size", f"takes only 'auto' (the model picks the ratio); set an explicit "
                                                 f"size with height/width, got {image_size!r}")
    auto = image_size == "auto" or bot_task == "img_ratio"
    if auto and size_given:
        raise InvalidRequest("params.height", "a size was set but the model is asked to choose the ratio "
                                              "(image_size='auto' or bot_task='img_ratio'); drop one of them")
    return auto


def _number(extra: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise InvalidRequest(f"extra.{key}", f"must be a number in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def text_sampling(extra: Mapping[str, Any], defaults: Mapping[str, Any], cap: int) -> tuple[int, float, int, float]:
    """``(max_new_tokens, temperature, top_k, top_p)`` of the text stage: the request's values, else the
    checkpoint's generation config, else greedy with the cap as the budget. ``temperature`` 0 is greedy; a
    budget over the server's cap is refused (never shortened silently)."""
    budget = extra.get("max_new_tokens", defaults.get("max_new_tokens") or cap)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InvalidRequest("extra.max_new_tokens", f"must be a positive integer, got {budget!r}")
    if budget > cap:
        raise InvalidRequest("extra.max_new_tokens", f"{budget} is over this server's text budget cap {cap} "
                                                     "(model option text_max_new_tokens)")
    sample = bool(defaults.get("do_sample", False))
    temperature = _number(extra, "temperature", float(defaults.get("temperature", 1.0)) if sample else 0.0, 0.0, 100.0)
    top_k = extra.get("top_k", int(defaults.get("top_k") or 0))
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise InvalidRequest("extra.top_k", f"must be a non-negative integer (0: off), got {top_k!r}")
    top_p = _number(extra, "top_p", float(defaults.get("top_p") or 1.0), 0.0, 1.0)
    if top_p == 0.0:
        raise InvalidRequest("extra.top_p", "must be in (0, 1]; use temperature 0 for greedy decoding")
    return int(budget), temperature, int(top_k), top_p
