"""Rank function of the 2-process gloo test of HunyuanImage-3's parallel VAE decode (spawned children import it by
name)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.context import build_groups

LATENT_SHAPE = (1, 4, 5, 6)  # [B, C, h, w]: 80 x 96 pixels


def tiny_vae() -> torch.nn.Module:
    """The tiny preset's VAE (same seed, so the same weights on every rank)."""
    from omni_hunyuan.presets import TINY_VAE
    from omni_hunyuan.vae import AutoencoderKLConv3D

    torch.manual_seed(0)
    return AutoencoderKLConv3D(TINY_VAE).eval().requires_grad_(False)


def tiles() -> object:
    """32-pixel tiles overlapping by 16: a 4 x 5 grid on the 5 x 6 latent."""
    from omni_hunyuan.vae_tiling import VaeTiles

    return VaeTiles(32, 16)


def latents() -> torch.Tensor:
    return torch.randn(LATENT_SHAPE, generator=torch.Generator().manual_seed(1))


def hunyuan_vae_rank(rank: int, init_file: str, out_dir: str) -> None:
    """Every rank decodes through the parallel path; rank 0 also decodes on one rank and writes both."""
    from omni_hunyuan.vae_tiling import tiled_decode

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ctx = build_groups(ParallelConfig(tp=2), rank)
        vae, z = tiny_vae(), latents()
        ctx.stats.reset()
        with torch.no_grad():
            image = tiled_decode(vae.decode, z, tiles(), ctx)  # type: ignore[arg-type]
            record = {"sent": ctx.stats.snapshot()["sent_bytes"].get("vae_gather", 0), "image": image}
            if rank == 0:
                record["single"] = tiled_decode(vae.decode, z, tiles())  # type: ignore[arg-type]
        torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
