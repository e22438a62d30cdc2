"""diffusers' ``MiniMaxH3ModularPipeline`` on the components of one of our tiny repositories (the parity peer;
shared by the end-to-end parity tests and ``benchmarks/minimax_h3_e2e.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class VideoProcessorShim:
    """Stands in for ``Qwen3VLVideoProcessor`` (torchvision-only in transformers) with the plugin's own pixel
    layout, so a video-reference parity run checks everything around the pixels (sampling, timestamps,
    presentation, 24 fps normalisation, VAE and audio encodes, layout) against diffusers."""

    temporal_patch_size = 2

    def __call__(self, videos: list[Any], **kwargs: Any) -> dict[str, Any]:
        from omni_minimax_h3.conditions import video_pixel_values

        out = [video_pixel_values(list(v)) for v in videos]
        return {"pixel_values_videos": torch.cat([p for p, _ in out]),
                "video_grid_thw": torch.tensor([list(g) for _, g in out])}


class ProcessorShim:
    """What diffusers' blocks read from a ``Qwen3VLProcessor`` (transformers builds the real one only with
    torchvision installed): its image and video processors and the per-token modality ids."""

    def __init__(self, image_processor: Any, image_token_id: int, video_token_id: int) -> None:
        self.image_processor = image_processor
        self.video_processor = VideoProcessorShim()
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id

    def create_mm_token_type_ids(self, input_ids: list[list[int]]) -> list[list[int]]:
        return [[1 if t == self.image_token_id else 2 if t == self.video_token_id else 0 for t in ids]
                for ids in input_ids]


def _strict(cls: Any, folder: Path) -> Any:
    from safetensors.torch import load_file

    model = cls.from_config(cls.load_config(str(folder)))
    model.load_state_dict(load_file(str(folder / "diffusion_pytorch_model.safetensors")), strict=True)
    return model.float().eval()


def peer_pipeline(root: Path, partition: str = "fl2va") -> Any:
    """A ready diffusers modular pipeline over ``root``'s transformer (``transformer_ref`` for ref2va)."""
    import json

    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

    root = Path(root)
    meta = json.loads((root / "model_index.json").read_text())["_minimax_h3"]
    text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(str(root / "text_encoder"),
                                                                   dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
    processor = ProcessorShim(AutoImageProcessor.from_pretrained(str(root / "processor")),
                              text_encoder.config.image_token_id, text_encoder.config.video_token_id)
    pipe = MiniMaxH3Blocks().init_pipeline()
    components: dict[str, Any] = {
        "text_encoder": text_encoder, "tokenizer": tokenizer, "processor": processor,
        "vae": _strict(AutoencoderKLMiniMaxH3, root / "vae"),
        "audio_vae": _strict(AutoencoderKLMiniMaxH3Audio, root / "audio_vae"),
        "scheduler": MiniMaxH3Scheduler(shift=12.0), "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
    }
    folder = "transformer" if partition == "fl2va" else "transformer_ref"
    components[folder] = _strict(MiniMaxH3Transformer3DModel, root / folder)
    pipe.update_components(**components)
    pipe.register_to_config(canvas_short_edge=meta["canvas_short_edge"], canvas_max_pixels=meta["canvas_max_pixels"],
                            reference_image_short_edge=meta["reference_image_short_edge"])
    return pipe
