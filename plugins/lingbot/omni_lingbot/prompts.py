"""Prompt texts: the chat template the text encoder sees and the default negative prompts (models.md §2.1, §2.3).

The template wraps the caption in a Qwen chat turn; ``crop_start`` (the token count of everything before the
caption) is cut from the encoder output so the DiT only sees the user turn. The system wording and the default
negative prompts are our own texts; a real checkpoint may want its upstream system text, which is why the
template is a parameter of :class:`omni_lingbot.text_encoder.LingBotTextEncoder` rather than hard-wired there.
"""

from __future__ import annotations

import json

SYSTEM_TEXT = (
    "Enhanced prompt: read the structured description of a scene and picture its subjects, their look, "
    "motion, camera work, lighting and mood in detail:"
)

PROMPT_TEMPLATE = (
    "<|im_start|>system\n" + SYSTEM_TEXT + "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)

#: Placed before the user text in image-to-video; the processor expands ``<|image_pad|>`` to one token per
#: merged vision patch. Both the positive and the negative prompt get the image.
IMAGE_PROMPT_PREFIX = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD_TOKEN = "<|image_pad|>"


def compact_json(value: object) -> str:
    """The caption serialisation the model was trained on: no spaces, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


DEFAULT_NEGATIVE_PROMPT_VIDEO = compact_json({
    "quality": "blurry, out of focus, low resolution, heavy compression artefacts, noise, banding",
    "motion": "stuttering, frozen frames, jittery camera, flickering light, objects popping in or out",
    "anatomy": "deformed hands, extra fingers, extra limbs, distorted faces, melting bodies",
    "composition": "cluttered background, cropped subject, tilted horizon, watermark, logo, subtitles, text",
    "style": "oversaturated colours, overexposed, underexposed, dull grey tones, cartoonish when realism is asked",
})

DEFAULT_NEGATIVE_PROMPT_IMAGE = compact_json({
    "quality": "blurry, out of focus, low resolution, jpeg artefacts, noise, banding",
    "anatomy": "deformed hands, extra fingers, extra limbs, distorted faces",
    "composition": "cluttered background, cropped subject, tilted horizon, watermark, logo, signature, text",
    "style": "oversaturated colours, overexposed, underexposed, flat dull lighting",
})


def default_negative_prompt(mode: str) -> str:
    """Video modes share one default; text-to-image has its own (no motion terms)."""
    return DEFAULT_NEGATIVE_PROMPT_IMAGE if mode == "t2i" else DEFAULT_NEGATIVE_PROMPT_VIDEO


def split_template(template: str = PROMPT_TEMPLATE) -> tuple[str, str]:
    """``(prefix, suffix)`` around the caption slot ``{}``."""
    if template.count("{}") != 1:
        raise ValueError("a prompt template needs exactly one '{}' caption slot")
    prefix, suffix = template.split("{}")
    return prefix, suffix


def build_prompt(caption: str, *, with_image: bool, template: str = PROMPT_TEMPLATE) -> str:
    """The full text for one encoder row (image placeholder not yet expanded)."""
    prefix, suffix = split_template(template)
    return prefix + (IMAGE_PROMPT_PREFIX if with_image else "") + caption + suffix
