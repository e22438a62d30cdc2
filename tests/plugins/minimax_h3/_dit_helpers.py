"""Helpers for the MiniMax-H3 DiT tests: a diffusers reference DiT on identical weights, and packed layouts
built with diffusers' own layout builders (imported by name; pytest puts this folder on sys.path)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from omni_minimax_h3.transformer.config import MiniMaxH3TransformerConfig
from omni_minimax_h3.transformer.layout import RequestLayout

PATCH = (1, 2, 2)


def tiny_config(**overrides: Any) -> MiniMaxH3TransformerConfig:
    return MiniMaxH3TransformerConfig.tiny(**overrides)


def build_reference(config: MiniMaxH3TransformerConfig, seed: int = 0) -> Any:
    """A diffusers ``MiniMaxH3Transformer3DModel`` with random (visible) weights, fp32, eval."""
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = MiniMaxH3Transformer3DModel(**config.to_dict())
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") or ".norm" in name and name.endswith("weight") and p.dim() == 1:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.05))
    return model.float().eval()


def save_reference(model: Any, target: Path) -> Path:
    model.save_pretrained(str(target), safe_serialization=True)
    return Path(target)


def text_tags(n: int, vision: tuple[int, int] | None = None) -> torch.Tensor:
    """``n`` text tags (1), with rows ``[a, b)`` tagged 0 like a presentation vision block."""
    tags = torch.ones(n, dtype=torch.long)
    if vision is not None:
        tags[vision[0]:vision[1]] = 0
    return tags


def fl2va_layout(num_text: int = 7, frames: int = 3, lh: int = 4, lw: int = 6, audio_latents: int = 9,
                 anchors: tuple[str, ...] = (), vision: tuple[int, int] | None = None) -> dict[str, Any]:
    """t2va (no anchors) / fl2va layout from diffusers' builder, as a dict of its outputs."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    pos, tags, vid, aud, txt, ncv, nca = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_tags(num_text, vision), frames, lh, lw, audio_latents, PATCH, 2, 2, 0, anchors)
    return {"position_ids": pos, "token_tags": tags, "video_indices": vid, "audio_indices": aud, "text_indices": txt,
            "num_condition_video_rows": ncv, "num_condition_audio_rows": nca}


def ref2va_layout(num_text: int = 9, frames: int = 2, lh: int = 4, lw: int = 4,
                  audio_latents: int = 8) -> dict[str, Any]:
    """ref2va layout: an image reference, a video reference with a soundtrack, a standalone audio reference."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3Ref2VAPrepareLayoutStep

    refs: list[Any] = [SimpleNamespace(kind="image", has_audio=False), SimpleNamespace(kind="video", has_audio=True),
            SimpleNamespace(kind="audio", has_audio=True)]
    cond = [torch.zeros(1, 24, 1, 6, 4), torch.zeros(1, 24, 2, 4, 4)]
    cond_audio = [torch.zeros(2 * 5, 32), torch.zeros(2 * 3, 32)]
    pos, tags, vid, aud, txt, ncv, nca = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(
        text_tags(num_text, (2, 5)), refs, cond, cond_audio, frames, lh, lw, audio_latents, PATCH, 2, 2, 0)
    return {"position_ids": pos, "token_tags": tags, "video_indices": vid, "audio_indices": aud, "text_indices": txt,
            "num_condition_video_rows": ncv, "num_condition_audio_rows": nca}


def to_layout(raw: dict[str, Any], **kwargs: Any) -> RequestLayout:
    return RequestLayout.build(raw["position_ids"], raw["token_tags"], raw["video_indices"], raw["audio_indices"],
                               raw["text_indices"], raw["num_condition_video_rows"], raw["num_condition_audio_rows"],
                               **kwargs)


def request_inputs(raw: dict[str, Any], config: MiniMaxH3TransformerConfig, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "video": torch.randn(raw["video_indices"].numel(), config.video_patch_dim, generator=g),
        "audio": torch.randn(raw["audio_indices"].numel(), config.audio_in_channels, generator=g),
        "text": torch.randn(raw["text_indices"].numel(), config.text_dim, generator=g),
    }


def row_timesteps(raw: dict[str, Any], t_video: float, t_audio: float, cond_video: float = 0.999,
                  cond_audio: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' per-row timestep reduction (its own static method)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    return MiniMaxH3SetTimestepsStep.build_row_timesteps(
        raw["video_indices"], raw["audio_indices"], raw["num_condition_video_rows"],
        raw["num_condition_audio_rows"], raw["text_indices"].numel(), t_video, t_audio,
        max(t_video, cond_video), cond_audio)


@torch.no_grad()
def reference_forward(ref: Any, raw: dict[str, Any], inputs: dict[str, torch.Tensor], unique: torch.Tensor,
                      inverse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    v, a = ref(hidden_states=inputs["video"][None], audio_hidden_states=inputs["audio"][None],
               encoder_hidden_states=inputs["text"][None], timestep=unique, timestep_indices=inverse,
               token_tags=raw["token_tags"], position_ids=raw["position_ids"], video_indices=raw["video_indices"],
               audio_indices=raw["audio_indices"], text_indices=raw["text_indices"], return_dict=False)
    return v[0], a[0]
