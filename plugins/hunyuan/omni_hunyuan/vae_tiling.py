"""Spatially tiled decode of the HunyuanImage-3 VAE, on one rank or shared out over a worker group.

The release decodes the whole latent at once, and so do we by default. A deployment may ask for tiles instead
(``--model-option vae_tile_size=512``, optional ``vae_tile_overlap``, pixels): the latent is cut into overlapping
square tiles on a regular grid (the last tile in each direction ends at the edge, so every tile but those of a
latent smaller than one tile is full-sized), each tile is decoded on its own, and the images are blended with
linear ramps over each overlap, normalised by the summed weights. The decoder's GroupNorm statistics and its
middle attention then see one tile, not the whole image, so a tiled image is close to but not equal to the untiled
one; it is what bounds the decoder's activation memory at large sizes, and what lets ``--parallel`` share the
decode: :func:`tiled_decode` hands the tile decodes to :func:`omnicore.plugin.decode_tiles` (round-robin over the
ranks, gathered on rank 0), and the blend runs on rank 0 in the same order as on one rank, so the image is the
single-rank tiled decode's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from omnicore.plugin import ConfigError, decode_tiles

#: the VAE's spatial factor; tiles and overlaps are whole latent cells
SPATIAL_FACTOR = 16


@attrs.frozen
class VaeTiles:
    """Tile size and overlap in pixels (multiples of the VAE's 16-pixel latent cell)."""

    size: int
    overlap: int

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> VaeTiles | None:
        """``vae_tile_size`` / ``vae_tile_overlap`` model options -> tiles, or ``None`` (untiled, the default).
        The overlap defaults to a quarter of the tile, rounded down to whole cells (at least one)."""
        opts = options or {}
        size, overlap = opts.get("vae_tile_size"), opts.get("vae_tile_overlap")
        if size is None:
            if overlap is not None:
                raise ConfigError("model_options.vae_tile_overlap", "needs vae_tile_size (tiling is off without it)")
            return None
        size = int(size)
        if size < 2 * SPATIAL_FACTOR or size % SPATIAL_FACTOR:
            raise ConfigError("model_options.vae_tile_size",
                              f"must be a multiple of {SPATIAL_FACTOR} pixels and at least {2 * SPATIAL_FACTOR}, "
                              f"got {size}")
        if overlap is None:
            overlap = max(SPATIAL_FACTOR, size // 4 // SPATIAL_FACTOR * SPATIAL_FACTOR)
        overlap = int(overlap)
        if overlap < SPATIAL_FACTOR or overlap % SPATIAL_FACTOR or overlap >= size:
            raise ConfigError("model_options.vae_tile_overlap",
                              f"must be a multiple of {SPATIAL_FACTOR} pixels, at least {SPATIAL_FACTOR} and below "
                              f"vae_tile_size ({size}), got {overlap}")
        return cls(size, overlap)

    @property
    def cells(self) -> int:
        return self.size // SPATIAL_FACTOR

    @property
    def stride(self) -> int:
        """Latent cells between tile starts."""
        return (self.size - self.overlap) // SPATIAL_FACTOR

    def splits(self, latents: torch.Tensor) -> bool:
        """Whether ``latents [B, C, h, w]`` spans more than one tile (else the decode is the untiled one)."""
        return latents.shape[-2] > self.cells or latents.shape[-1] > self.cells


def tile_starts(length: int, tile: int, stride: int) -> list[int]:
    """Starts of the tiles covering ``length`` cells: every ``stride`` cells, the last one moved back to end at
    the edge (no tile past it; one tile at 0 when ``length <= tile``)."""
    if length <= tile:
        return [0]
    starts = list(range(0, length - tile, stride))
    return starts + [length - tile]


def _ramp(start: int, length: int, starts: list[int], tile: int, factor: int) -> torch.Tensor:
    """1-D blend weights (pixels) of the tile at ``start`` (cells): rising over its overlap with the previous tile,
    falling over its overlap with the next, 1 elsewhere; strictly positive."""
    weights = torch.ones(length * factor, dtype=torch.float32)
    k = starts.index(start)
    if k > 0:
        n = (starts[k - 1] + tile - start) * factor
        weights[:n] = torch.minimum(weights[:n], (torch.arange(n, dtype=torch.float32) + 0.5) / n)
    if k + 1 < len(starts):
        n = (start + tile - starts[k + 1]) * factor
        weights[-n:] = torch.minimum(weights[-n:], (torch.arange(n, 0, -1, dtype=torch.float32) - 0.5) / n)
    return weights


def tiled_decode(decode: Callable[[torch.Tensor], torch.Tensor], latents: torch.Tensor, tiles: VaeTiles,
                 parallel: Any = None) -> torch.Tensor | None:
    """``latents [B, C, h, w]`` -> ``[B, 3, H, W]`` float32 in [0, 1], decoding each tile with ``decode`` (the
    VAE's ``decode``). ``parallel`` (this rank's ``ParallelContext``; every rank calls with the same latents): the
    tiles are decoded across the ranks and rank 0 blends them; the other ranks return ``None``."""
    b, _, h, w = latents.shape
    t, f = tiles.cells, SPATIAL_FACTOR
    ys, xs = tile_starts(h, t, tiles.stride), tile_starts(w, t, tiles.stride)
    cells = [(y, x) for y in ys for x in xs]
    decoded = decode_tiles(cells, lambda c: decode(latents[..., c[0]:c[0] + t, c[1]:c[1] + t]), parallel,
                           device=latents.device)
    if decoded is None:
        return None
    out = torch.zeros(b, 3, h * f, w * f, dtype=torch.float32, device=latents.device)
    total = torch.zeros(1, 1, h * f, w * f, dtype=torch.float32, device=latents.device)
    for (y, x), image in zip(cells, decoded):
        th, tw = min(t, h - y), min(t, w - x)
        weight = (_ramp(y, th, ys, t, f)[:, None] * _ramp(x, tw, xs, t, f)[None, :]).to(latents.device)
        out[..., y * f:(y + th) * f, x * f:(x + tw) * f] += image.float() * weight
        total[..., y * f:(y + th) * f, x * f:(x + tw) * f] += weight
    return out / total


__all__ = ["SPATIAL_FACTOR", "VaeTiles", "tile_starts", "tiled_decode"]
