"""Rank function of the 2-process gloo test of ``omnicore.parallel.vae_decode`` (spawned children import it by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.context import build_groups
from omnicore.parallel.vae_decode import decode_tiles


def _tiles(n: int) -> list[torch.Tensor]:
    """``n`` latent tiles of uneven widths (an edge tile is narrower), the same on every rank."""
    g = torch.Generator().manual_seed(n)
    return [torch.randn(1, 4, 2, 3, 3 + (i % 3), generator=g) for i in range(n)]


def _decoder() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv3d(4, 8, 3, padding=1), torch.nn.SiLU(),
                               torch.nn.ConvTranspose3d(8, 3, (1, 2, 2), stride=(1, 2, 2)))


def decode_tiles_rank(rank: int, init_file: str) -> None:
    """Each rank decodes only tiles ``rank, rank + 2, ...``; what rank 0 (or every rank) receives equals the
    single-process loop bit for bit; rank 1 gets ``None`` or shape-only zeros; the bytes sent are counted."""
    config = ParallelConfig(ulysses=2)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ctx = build_groups(config, rank)
        decoder = _decoder().eval()
        with torch.no_grad():
            for n in (5, 4, 1, 0):
                tiles = _tiles(n)
                expected = [decoder(t) for t in tiles]  # the single-process tiled loop
                calls: list[int] = []

                def decode(t: torch.Tensor, calls: list[int] = calls,
                           tiles: list[torch.Tensor] = tiles) -> torch.Tensor:
                    calls.append(next(i for i, x in enumerate(tiles) if x is t))
                    return decoder(t)

                ctx.stats.reset()
                got = decode_tiles(tiles, decode, ctx, device="cpu")
                assert calls == list(range(rank, n, 2)), (rank, n, calls)
                mine_bytes = sum(expected[i].numel() * 4 for i in range(rank, n, 2))
                sent = ctx.stats.snapshot()["sent_bytes"].get("vae_gather", 0)
                if rank == 0:
                    assert got is not None and len(got) == n
                    for g, e in zip(got, expected):
                        assert g.shape == e.shape and torch.equal(g, e)
                    assert sent == 0
                else:
                    assert got is None
                    assert sent == mine_bytes or (n == 0 and sent == 0), (sent, mine_bytes)

                held = decode_tiles(tiles, decoder, ctx, device="cpu", placeholders=True)
                assert held is not None and [t.shape for t in held] == [e.shape for e in expected]
                if rank == 1:
                    assert all(not t.any() for t in held)

                everywhere = decode_tiles(tiles, decoder, ctx, device="cpu", gather="all")
                assert everywhere is not None and len(everywhere) == n
                assert all(torch.equal(g, e) for g, e in zip(everywhere, expected))
    finally:
        dist.destroy_process_group()
