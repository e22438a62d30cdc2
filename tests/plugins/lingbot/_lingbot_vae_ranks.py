"""Rank function of the 2-process gloo test of LingBot's parallel VAE decode (spawned children import it by name)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.context import build_groups

LATENT_SHAPE = (1, 4, 2, 8, 8)  # [B, z, t, h, w]: 5 frames, 64 x 64 pixels


def tiny_vae() -> object:
    """The tiny preset's ``AutoencoderKLWan`` (same seed and gain on every rank) behind ``LingBotVAE``."""
    from diffusers import AutoencoderKLWan
    from omni_lingbot.presets import TINY_VAE
    from omni_lingbot.vae import LingBotVAE

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**TINY_VAE).eval().requires_grad_(False)
    with torch.no_grad():
        for param in vae.parameters():
            if param.dim() >= 2:
                param.mul_(math.sqrt(3.0))
    return LingBotVAE(vae)


def tiling() -> object:
    """32-pixel tiles every 16 pixels: a 4 x 4 grid of overlapping tiles on the 64 x 64 frame."""
    from omni_lingbot.stage_options import VaeTiling

    return VaeTiling(32, 32, 16, 16)


def latents() -> torch.Tensor:
    return torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(1))


def lingbot_vae_rank(rank: int, init_file: str, out_dir: str) -> None:
    """Every rank decodes through the parallel path; rank 0 also decodes single-process (diffusers' own
    ``tiled_decode``) and writes both; every rank writes the bytes it sent."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ctx = build_groups(ParallelConfig(cfg=2), rank)
        wrapper = tiny_vae()
        z = latents()
        with wrapper.tiling(tiling()):  # type: ignore[attr-defined]
            assert wrapper.splits_over_ranks(z)  # type: ignore[attr-defined]
            ctx.stats.reset()
            frames = wrapper.decode_over_ranks(z, ctx)  # type: ignore[attr-defined]
            record = {"sent": ctx.stats.snapshot()["sent_bytes"].get("vae_gather", 0), "frames": frames}
            if rank == 0:
                record["single"] = wrapper.decode(z)  # type: ignore[attr-defined]
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
