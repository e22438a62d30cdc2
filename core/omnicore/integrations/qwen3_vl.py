"""Qwen3-VL as a text encoder: loading it from a checkpoint folder, and the tiny random-weight one presets write.

LingBot and MiniMax-H3 both condition on transformers' ``Qwen3VLForConditionalGeneration`` (its inner
``Qwen3VLModel``; the LM head is never used) and both build the same tiny stand-in for their ``tiny:`` presets. The
two copies lived in the plugins; this module is the one both call (through ``omnicore.plugin``).

We read the tokenizer and the Qwen2-VL image processor on their own, never ``Qwen3VLProcessor``: that class insists
on a video processor, which needs torchvision. Needs ``transformers`` (and ``tokenizers`` for the tiny tokenizer),
imported inside the functions: the core never imports them on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..tiny_checkpoints import byte_level_tokenizer

if TYPE_CHECKING:
    import torch

#: the Qwen chat and vision special tokens the tiny tokenizer carries, in id order after the 256 byte symbols
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
)


def load_qwen3_vl(text_encoder_dir: Path, tokenizer_dir: Path, processor_dir: Path | None = None, *,
                  device: torch.device | str, dtype: torch.dtype,
                  layers: int | None = None) -> tuple[Any, Any, Any]:
    """``(model, tokenizer, image_processor)``: the checkpoint's ``Qwen3VLModel`` on ``device`` in eval mode
    without gradients, the tokenizer of ``tokenizer_dir`` and the image processor of ``processor_dir`` (default:
    ``tokenizer_dir``).

    ``layers``: build and load only the first ``layers`` decoder layers (a model that reads an inner layer's
    output never needs the later ones; their weights are skipped, not read). More than the checkpoint has is a
    ``ValueError`` naming both numbers.
    """
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    if layers is None:
        full = Qwen3VLForConditionalGeneration.from_pretrained(str(text_encoder_dir), dtype=dtype)
    else:
        config = Qwen3VLConfig.from_pretrained(str(text_encoder_dir))
        text: Any = config.text_config
        if text.num_hidden_layers < layers:
            raise ValueError(f"{text_encoder_dir}: {text.num_hidden_layers} decoder layers, {layers} asked for")
        text.num_hidden_layers = layers
        if getattr(text, "layer_types", None):
            text.layer_types = list(text.layer_types)[:layers]
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the skipped layers are reported as unused weights
        try:
            full = Qwen3VLForConditionalGeneration.from_pretrained(str(text_encoder_dir), config=config, dtype=dtype)
        finally:
            hf_logging.set_verbosity(verbosity)
    model = full.model.to(device).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    image_processor = AutoImageProcessor.from_pretrained(str(processor_dir if processor_dir is not None
                                                             else tokenizer_dir))
    return model, tokenizer, image_processor


def build_tiny_qwen3_vl(text_encoder_dir: Path, processor_dir: Path, seed: int, *, tokenizer_dir: Path | None = None,
                        hidden_size: int = 32, layers: int = 2) -> dict[str, int]:
    """Write a random-weight Qwen3-VL in the release layout and return the special tokens' ids (and
    ``"__vocab_size__"``).

    The tokenizer is a merge-free byte-level BPE (any text encodes) with :data:`QWEN_SPECIAL_TOKENS`, written to
    ``tokenizer_dir`` and copied into ``processor_dir`` when given, else written to ``processor_dir``; the image
    processor is Qwen2-VL's (patch 16, merge 2, temporal patch 2). The model: ``layers`` decoder layers of width
    ``hidden_size`` (2 heads of 16, one KV head, interleaved M-RoPE) and a 1-layer vision tower whose merged
    output is ``hidden_size`` wide, initialised under ``torch.manual_seed(seed)``. Tiny weights give noise.
    """
    from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = byte_level_tokenizer(tokenizer_dir if tokenizer_dir is not None else processor_dir, QWEN_SPECIAL_TOKENS,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ids = {**tok.special_ids, "__vocab_size__": tok.vocab_size}
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(processor_dir))
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                             image_std=[0.5] * 3).save_pretrained(str(processor_dir))
    config = Qwen3VLConfig(
        text_config={
            "hidden_size": hidden_size, "intermediate_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": tok.vocab_size,
            "max_position_embeddings": 65536,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        },
        vision_config={
            "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": hidden_size,
            "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    import torch

    torch.manual_seed(seed)
    Qwen3VLForConditionalGeneration(config).save_pretrained(str(text_encoder_dir))
    return ids
