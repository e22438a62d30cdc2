"""The Qwen3-VL conditioner and MiniMax-H3's prompt presentation.

Presentation: no chat template and no special tokens; the prompt is tokenised verbatim. fl2va prepends, per
keyframe, the text ``"<Picture i>: "`` and a vision block (``<|vision_start|>``, one ``<|image_pad|>`` per merged
patch, ``<|vision_end|>``); ref2va labels its references the same way (``"<Audio j>: "`` alone for audio, which
never reaches the conditioner). Every row carries a modality tag for the DiT's AdaLN: 1 for text, 0 for the rows of
a vision block.

Readout: the hidden state *after* decoder layer ``layer - 1`` (``hidden_states[layer]`` in transformers' indexing,
default 50), before the final norm. transformers records ``hidden_states[i]`` with a forward hook on decoder layer
``i - 1`` (``_can_record_outputs``) and swaps only the *last* entry for the normed state, so with more than
``layer`` layers index ``layer`` is the raw output of layer ``layer - 1``. We load only the first ``layer`` decoder
layers (the rest and the final norm never influence the readout) and read that layer's output with the same kind of
forward hook, which also keeps the reference's order relative to DeepStack (recorded before the visual features are
added — the release adds them to the first three layers only).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from omnicore.plugin import load_qwen3_vl

DEFAULT_LAYER = 50
TEXT_TAG, VIDEO_TAG = 1, 0
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"


@attrs.frozen(eq=False)
class VideoCondition:
    """A ref2va video as the conditioner reads it: sampled frames and one timestamp per vision block."""

    frames: list[np.ndarray]
    timestamps: list[float]


class H3TextEncoder:
    """Turns a presentation (prompt + labelled images) into DiT text rows ``[L, text_dim]`` and their tags."""

    def __init__(self, model: Any, tokenizer: Any, image_processor: Any, layer: int = DEFAULT_LAYER) -> None:
        self.model = model  # transformers Qwen3VLModel (the generation wrapper's .model)
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.layer = layer
        layers = model.language_model.layers
        if len(layers) < layer:
            raise ValueError(f"the text encoder has {len(layers)} decoder layers; MiniMax-H3 reads the output of "
                             f"layer {layer - 1}")
        self.readout = layers[layer - 1]
        self.merge = int(getattr(image_processor, "merge_size", 2)) ** 2
        self.image_token_id = int(model.config.image_token_id)
        self.video_token_id = int(model.config.video_token_id)
        self._ids = {t: int(tokenizer.convert_tokens_to_ids(t))
                     for t in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}

    @classmethod
    def from_pretrained(cls, text_encoder_dir: Path, tokenizer_dir: Path, processor_dir: Path, *, device: Any,
                        dtype: torch.dtype, layer: int = DEFAULT_LAYER,
                        tp: tuple[int, int] | None = None) -> H3TextEncoder:
        """Load the conditioner with only its first ``layer`` decoder layers (the later ones' weights are skipped).

        ``tp = (rank, degree)``: only that tensor-parallel rank's shard of the decoder's attention and MLP linears
        is read (``model.tp_bytes_read``); :meth:`enable_tensor_parallel` then joins the shards up."""
        model, tokenizer, image_processor = load_qwen3_vl(text_encoder_dir, tokenizer_dir, processor_dir,
                                                          device=device, dtype=dtype, layers=layer, tp=tp,
                                                          plugin="minimax_h3")
        return cls(model, tokenizer, image_processor, layer)

    #: this rank's omnicore.parallel.ParallelContext when the decoder's linears are split (enable_tensor_parallel)
    tensor_parallel: Any = None

    def enable_tensor_parallel(self, ctx: Any) -> None:
        """Split the language model's attention (whole K/V heads per rank) and MLP linears over ``ctx.tp`` ranks
        (``qwen3_vl_tp_plan``; a head or FFN count the degree does not divide is a ConfigError naming them): an
        encoder loaded with ``tp=`` already holds its shard, a whole one is narrowed here. transformers' attention
        reshapes with ``-1`` heads and keeps the query/KV group ratio, so it runs on the local heads as is; the
        row-parallel ``o_proj`` and ``down_proj`` all-reduce, so every layer's output (and the readout) is whole
        on every rank. The vision tower and the embeddings stay replicated."""
        from omnicore.plugin import parallelize, qwen3_vl_tp_plan, shard_module

        plan = qwen3_vl_tp_plan(self.model.config.text_config)
        plan.check(ctx.tp)
        shard_module(self.model, plan, rank=ctx.tp_rank, degree=ctx.tp)  # no-op for a sharded load
        parallelize(self.model, plan, ctx.tp_mesh, stats=ctx.stats)
        self.tensor_parallel = ctx

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ------------------------------------------------------------------------------ presentation
    def text_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def vision_block(self, num_tokens: int, pad: str = IMAGE_PAD) -> list[int]:
        return [self._ids[VISION_START]] + [self._ids[pad]] * num_tokens + [self._ids[VISION_END]]

    def presentation(self, prompt: str, labels: Sequence[tuple[str, Any]]) -> tuple[list[int], list[int]]:
        """Token ids and modality tags of ``labels`` then the prompt. Each label is ``(text, vision)``: ``vision``
        None (a label alone), an int (one image block of that many tokens) or ``(tokens_per_block, timestamps)``
        (a video: one ``"<t seconds>"`` label and block per timestamp)."""
        ids: list[int] = []
        tags: list[int] = []

        def text(value: str) -> None:
            part = self.text_ids(value)
            ids.extend(part)
            tags.extend([TEXT_TAG] * len(part))

        def block(tokens: int, pad: str) -> None:
            part = self.vision_block(tokens, pad)
            ids.extend(part)
            tags.extend([VIDEO_TAG] * len(part))

        for label, vision in labels:
            text(label)
            if isinstance(vision, int):
                block(vision, IMAGE_PAD)
            elif vision is not None:
                per_block, stamps = vision
                for stamp in stamps:
                    text(f"<{stamp:.1f} seconds>")  # format() rounds half to even, like the release
                    block(per_block, VIDEO_PAD)
        text(prompt)
        return ids, tags

    # ------------------------------------------------------------------------------ encode
    @torch.no_grad()
    def encode(self, prompt: str, items: Sequence[tuple[str, Any]] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """``items``: ``(label, payload)`` in presentation order; the payload is a PIL image, a
        :class:`VideoCondition`, or None (a label without vision, e.g. ``"<Audio 1>: "``). Returns the text rows
        ``[L, text_dim]`` (the conditioner's dtype) and int64 tags ``[L]``. Images go through the image processor
        in one batch; videos through Qwen3-VL's video layout
        (:func:`~omni_minimax_h3.conditions.video_pixel_values`)."""
        from .conditions import video_pixel_values

        images = [p for _, p in items if p is not None and not isinstance(p, VideoCondition)]
        vision: dict[str, Any] = {}
        counts: list[int] = []
        if images:
            processed = self.image_processor(images=images, return_tensors="pt")
            grid = processed["image_grid_thw"]
            counts = [int(g.prod()) // self.merge for g in grid]
            vision = {"pixel_values": processed["pixel_values"].to(self.device, self.model.dtype),
                      "image_grid_thw": grid.to(self.device)}
        videos = [video_pixel_values(p.frames) for _, p in items if isinstance(p, VideoCondition)]
        if videos:
            vision["pixel_values_videos"] = torch.cat([v for v, _ in videos]).to(self.device, self.model.dtype)
            vision["video_grid_thw"] = torch.tensor([list(g) for _, g in videos], device=self.device)
        image_counts, video_grids = iter(counts), iter(g for _, g in videos)
        labels: list[tuple[str, Any]] = []
        for text, payload in items:
            if payload is None:
                labels.append((text, None))
            elif isinstance(payload, VideoCondition):
                gt, gh, gw = next(video_grids)
                if gt != len(payload.timestamps):
                    raise ValueError(f"{gt} vision blocks but {len(payload.timestamps)} timestamps")
                labels.append((text, (gh * gw // self.merge, payload.timestamps)))
            else:
                labels.append((text, next(image_counts)))
        ids, tags = self.presentation(prompt, labels)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        mm_types = (input_ids == self.image_token_id).long() + 2 * (input_ids == self.video_token_id).long()
        captured: list[torch.Tensor] = []

        def grab(module: Any, args: Any, output: Any) -> None:
            captured.append(output[0] if isinstance(output, tuple) else output)

        handle = self.readout.register_forward_hook(grab)
        try:
            self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=mm_types,
                       use_cache=False, **vision)
        finally:
            handle.remove()
        return captured[-1][0], torch.tensor(tags, dtype=torch.long)
