"""Prompt encoding with transformers' Qwen3-VL (loaded by ``omnicore.plugin.load_qwen3_vl``).

We drive the tokenizer and the image processor ourselves instead of ``Qwen3VLProcessor``: that class insists
on a video processor, which needs torchvision, and LingBot never feeds video to the encoder. The expansion of
``<|image_pad|>`` (one token per merged vision patch) and the ``mm_token_type_ids`` the model wants for its
multimodal RoPE are the processor's documented behaviour, redone here in a few lines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omnicore.plugin import load_qwen3_vl

from .conditions import vlm_image
from .prompts import IMAGE_PAD_TOKEN, PROMPT_TEMPLATE, build_prompt, split_template

MAX_LENGTH = 37698


class LingBotTextEncoder:
    """Turns captions (and the TI2V reference image) into DiT text embeddings ``[L, text_dim]``."""

    def __init__(self, model: Any, tokenizer: Any, image_processor: Any, template: str = PROMPT_TEMPLATE) -> None:
        self.model = model  # Qwen3VLModel (the generation wrapper's inner .model; lm_head unused)
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.template = template
        vision = model.config.vision_config
        self.merge_size = int(vision.spatial_merge_size)
        self.vision_factor = int(vision.patch_size) * self.merge_size
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_PAD_TOKEN))
        prefix, _ = split_template(template)
        self.crop_start = len(tokenizer(prefix, add_special_tokens=False)["input_ids"])

    @classmethod
    def from_pretrained(cls, text_encoder_dir: Path, processor_dir: Path, *, device: torch.device,
                        dtype: torch.dtype, template: str = PROMPT_TEMPLATE) -> LingBotTextEncoder:
        model, tokenizer, image_processor = load_qwen3_vl(text_encoder_dir, processor_dir, device=device, dtype=dtype)
        return cls(model, tokenizer, image_processor, template)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def encode(self, caption: str, image: torch.Tensor | None = None) -> torch.Tensor:
        """One caption → ``[L, D]`` float32 embeddings of the user turn (template prefix cropped).

        ``image`` is the aligned TI2V pixels ``[1, 3, 1, H, W]`` in [0, 1]; it is smart-resized for the vision
        tower and its placeholder expanded to one token per merged patch.
        """
        text = build_prompt(caption, with_image=image is not None, template=self.template)
        vision: dict[str, Any] = {}
        if image is not None:
            pil = vlm_image(image, self.vision_factor)
            processed = self.image_processor(images=[pil], do_resize=False, return_tensors="pt")
            grid = processed["image_grid_thw"]
            n_tokens = int(grid[0].prod()) // (self.merge_size ** 2)
            text = text.replace(IMAGE_PAD_TOKEN, IMAGE_PAD_TOKEN * n_tokens, 1)
            vision = {"pixel_values": processed["pixel_values"].to(self.device, self.model.dtype),
                      "image_grid_thw": grid.to(self.device)}
        tokens = self.tokenizer([text], return_tensors="pt", truncation=True, max_length=MAX_LENGTH,
                                add_special_tokens=False)
        input_ids = tokens["input_ids"].to(self.device)
        mask = tokens["attention_mask"].to(self.device)
        if vision:
            vision["mm_token_type_ids"] = (input_ids == self.image_token_id).to(torch.int32)
        hidden = self.model(input_ids=input_ids, attention_mask=mask, **vision).last_hidden_state
        length = int(mask[0].sum())
        return hidden[0, self.crop_start:length].float()
