"""Rank function of the 2-process gloo test of MiniMax-H3's parallel VAE decode (spawned children import it by
name)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.context import build_groups

#: a small native tile geometry (pixels), so the tiny 64 x 96 canvas is 3 x 5 = 15 overlapping tiles per clip
TILE, OVERLAP = 32, 16
LATENT_SHAPE = (1, 24, 3, 4, 6)  # [1, C, t, h, w]: 9 frames, 64 x 96 pixels


def tiny_video_vae() -> object:
    """The tiny preset's ``AutoencoderKLMiniMaxH3`` (same seed, so the same weights on every rank), small tiles."""
    from diffusers import AutoencoderKLMiniMaxH3
    from omni_minimax_h3.presets import TINY_VAE
    from omni_minimax_h3.vae import H3VideoVAE

    torch.manual_seed(0)
    vae = AutoencoderKLMiniMaxH3(**TINY_VAE).eval().requires_grad_(False)
    vae.enable_tiling(TILE, TILE, OVERLAP, OVERLAP)
    return H3VideoVAE(vae)


def latents() -> torch.Tensor:
    return torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(1))


def h3_vae_rank(rank: int, init_file: str, out_dir: str) -> None:
    """Decode the same latents through the parallel path; rank 0 also decodes them single-process (tiled) and
    writes both; every rank writes the bytes it sent."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ctx = build_groups(ParallelConfig(ulysses=2), rank)
        wrapper = tiny_video_vae()
        z = latents()
        ctx.stats.reset()
        frames = wrapper.decode(z, parallel=ctx)  # type: ignore[attr-defined]
        record = {"sent": ctx.stats.snapshot()["sent_bytes"].get("vae_gather", 0),
                  "restored": "_decode_clip" not in vars(wrapper.vae)}  # type: ignore[attr-defined]
        if rank == 0:
            record["parallel"] = frames
            record["single"] = wrapper.decode(z)  # type: ignore[attr-defined]
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
