"""Prompt texts: the chat template the text encoder sees and the default negative prompts.

The template wraps the caption in a Qwen chat turn; ``crop_start`` (the token count of everything before the
caption) is cut from the encoder output so the DiT only sees the user turn. The built-in system wording and
default negative prompts are our own texts, *not* the ones the checkpoint was trained with; a deployment supplies
the trained ones (:func:`load_prompt_texts`), first match wins:

1. the model options ``prompt_template``, ``negative_prompt``, ``negative_prompt_image`` (``--model-option
   KEY=VALUE``; a value ``@PATH`` is read from that file);
2. files in the checkpoint directory: ``prompt_template.txt``, ``default_negative_prompt.json`` (or ``.txt``)
   for video modes, ``default_negative_prompt_image.json`` (or ``.txt``) for text-to-image;
3. the built-in texts below.

A negative prompt file's text is used as written, surrounding whitespace stripped (a JSON negative prompt reaches
the encoder exactly as in the file); a template file is used byte for byte (its trailing newline belongs to the
assistant turn) and must hold exactly one ``{}`` caption slot.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
from omnicore.plugin import ConfigError

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


#: model option -> checkpoint files that provide it (first existing wins)
PROMPT_FILES: dict[str, tuple[str, ...]] = {
    "prompt_template": ("prompt_template.txt",),
    "negative_prompt": ("default_negative_prompt.json", "default_negative_prompt.txt"),
    "negative_prompt_image": ("default_negative_prompt_image.json", "default_negative_prompt_image.txt"),
}


@attrs.frozen
class PromptTexts:
    """The template and default negative prompts one loaded model uses, and where each came from."""

    template: str = PROMPT_TEMPLATE
    negative_video: str = DEFAULT_NEGATIVE_PROMPT_VIDEO
    negative_image: str = DEFAULT_NEGATIVE_PROMPT_IMAGE
    sources: Mapping[str, str] = attrs.field(factory=dict)  # option name -> "option" | file path | "built-in"

    def negative_prompt(self, mode: str) -> str:
        """The default negative prompt of ``mode`` (text-to-image has its own, without motion terms)."""
        return self.negative_image if mode == "t2i" else self.negative_video


def _read_text(path: Path, option: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
        return text if option == "prompt_template" else text.strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"model_options.{option}", f"cannot read {path}: {exc}") from None


def load_prompt_texts(root: Path | None, options: Mapping[str, Any] | None = None) -> PromptTexts:
    """Resolve the prompt texts of a deployment: model option, then checkpoint file, then built-in."""
    options = options or {}
    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    for name, files in PROMPT_FILES.items():
        value = options.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise ConfigError(f"model_options.{name}", f"must be a string, got {type(value).__name__}")
            if value.startswith("@"):
                values[name], sources[name] = _read_text(Path(value[1:]).expanduser(), name), value[1:]
            else:
                values[name], sources[name] = value, "option"
            continue
        found = next((root / f for f in files if root is not None and (root / f).is_file()), None)
        if found is not None:
            values[name], sources[name] = _read_text(found, name), str(found)
        else:
            sources[name] = "built-in"
    template = values.get("prompt_template", PROMPT_TEMPLATE)
    if template.count("{}") != 1:
        raise ConfigError("model_options.prompt_template",
                          f"needs exactly one '{{}}' caption slot (from {sources['prompt_template']})")
    return PromptTexts(template=template,
                       negative_video=values.get("negative_prompt", DEFAULT_NEGATIVE_PROMPT_VIDEO),
                       negative_image=values.get("negative_prompt_image", DEFAULT_NEGATIVE_PROMPT_IMAGE),
                       sources=sources)
