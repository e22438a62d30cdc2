"""``omnicore.parallel.vae_decode``: tile decodes shared out round-robin over the ranks and gathered in tile order.

The gloo test runs 2 processes: each decodes only its own tiles, and the tiles rank 0 (or, ``gather="all"``, every
rank) receives equal the single-process loop's bit for bit (the gather moves bits; the same module decodes the same
slice). Model-level checks (the blended frames) live in the plugins' ``test_parallel_vae.py``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omnicore.parallel.vae_decode import (
    PARALLEL_VAE_DECODE_OPTION,
    decode_tiles,
    parallel_vae_decode_enabled,
    tile_owner,
)


def test_one_rank_is_the_plain_tile_loop() -> None:
    tiles = [torch.full((2, 2), float(i)) for i in range(3)]
    seen: list[float] = []

    def decode(t: torch.Tensor) -> torch.Tensor:
        seen.append(float(t[0, 0]))
        return t * 2

    out = decode_tiles(tiles, decode, None, device="cpu")
    assert out is not None and [float(t[0, 0]) for t in out] == [0.0, 2.0, 4.0]
    assert seen == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match="gather must be"):
        decode_tiles(tiles, decode, None, device="cpu", gather="rank1")  # type: ignore[arg-type]


def test_round_robin_owner_and_the_switch() -> None:
    assert [tile_owner(i, 3) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    two = SimpleNamespace(world_size=2)
    assert PARALLEL_VAE_DECODE_OPTION.name == "parallel_vae_decode" and PARALLEL_VAE_DECODE_OPTION.default is True
    assert parallel_vae_decode_enabled(two, {}) is True  # type: ignore[arg-type]
    assert parallel_vae_decode_enabled(two, {"parallel_vae_decode": False}) is False  # type: ignore[arg-type]
    assert parallel_vae_decode_enabled(SimpleNamespace(world_size=1), {}) is False  # type: ignore[arg-type]
    assert parallel_vae_decode_enabled(None, {}) is False


@pytest.mark.slow  # two spawned processes importing torch: ~10 s on a busy host
def test_tiles_decoded_on_two_gloo_ranks_equal_the_single_process_loop(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from _parallel_vae_helpers import decode_tiles_rank

    mp.spawn(decode_tiles_rank, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True)
