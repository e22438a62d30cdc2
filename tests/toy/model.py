"""The toy denoiser: a conv net on latents, modulated (AdaLN-style) by a prompt + timestep embedding.

Test-only. Its per-step cost is dominated by ``work_layers`` square ``work x work`` matmuls applied to one
conditioning vector per sample: small batches are weight-bandwidth bound (like a real DiT at batch 1 on an
accelerator), so batching several requests costs little more than one, which is what batching exploits.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn


@attrs.frozen
class ToyConfig:
    latent_channels: int = 4
    hidden: int = 16  # spatial conv width
    work: int = 64  # conditioning MLP width: the step-cost knob
    work_layers: int = 2
    vocab: int = 256
    vae_scale: int = 8  # pixels per latent cell (each side)

    def to_json(self) -> dict[str, Any]:
        return {"architectures": ["ToyDiT"], "model_type": "omnicore-toy", **attrs.asdict(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ToyConfig:
        names = {a.name for a in attrs.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def prompt_token_ids(prompt: Any, vocab: int) -> list[int]:
    """Hash each whitespace token into ``[0, vocab)``: a tokenizer-free, deterministic text encoding."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
    return [int(hashlib.sha256(tok.encode()).hexdigest()[:8], 16) % vocab for tok in text.lower().split()]


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / max(half, 1))
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return emb if dim % 2 == 0 else torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)


class ToyDenoiser(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.work)
        self.time_proj = nn.Linear(cfg.work, cfg.work)
        self.mlp = nn.ModuleList(nn.Linear(cfg.work, cfg.work) for _ in range(cfg.work_layers))
        self.modulation = nn.Linear(cfg.work, 2 * cfg.hidden)
        self.conv_in = nn.Conv2d(cfg.latent_channels, cfg.hidden, 3, padding=1)
        self.conv_out = nn.Conv2d(cfg.hidden, cfg.latent_channels, 3, padding=1)
        self.decoder = nn.Conv2d(cfg.latent_channels, 3 * cfg.vae_scale**2, 1)

    def encode_text(self, prompts: list[Any]) -> torch.Tensor:
        rows = []
        for p in prompts:
            ids = prompt_token_ids(p, self.cfg.vocab) if p else []
            rows.append(self.embed(torch.tensor(ids)).mean(0) if ids else torch.zeros(self.cfg.work))
        return torch.stack(rows)

    def forward(self, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """``x`` is ``[B, C, H, W]`` or ``[B, C, F, H, W]``; ``t`` is ``[B]``; returns the velocity, shaped like x."""
        c = text + self.time_proj(timestep_embedding(t, self.cfg.work))
        for layer in self.mlp:
            c = c + torch.nn.functional.silu(layer(c))
        scale, shift = self.modulation(c).chunk(2, dim=-1)
        video = x.dim() == 5
        if video:
            b, ch, f, h, w = x.shape
            x = x.permute(0, 2, 1, 3, 4).reshape(b * f, ch, h, w)
            scale, shift = scale.repeat_interleave(f, 0), shift.repeat_interleave(f, 0)
        hdn = torch.nn.functional.silu(self.conv_in(x))
        hdn = hdn * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
        out = self.conv_out(hdn)
        if video:
            out = out.reshape(b, f, ch, h, w).permute(0, 2, 1, 3, 4)
        return out

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, F, h, w]`` -> pixels in [-1, 1] ``[B, F, H, W, 3]``."""
        b, ch, f, h, w = latents.shape
        flat = latents.permute(0, 2, 1, 3, 4).reshape(b * f, ch, h, w)
        pix = torch.nn.functional.pixel_shuffle(self.decoder(flat), self.cfg.vae_scale)
        pix = torch.tanh(pix).reshape(b, f, 3, h * self.cfg.vae_scale, w * self.cfg.vae_scale)
        return pix.permute(0, 1, 3, 4, 2)
