"""MiniMax-H3's parallel VAE decode (``--parallel``, gloo, 2 processes): the clip's native tiles are decoded
round-robin across the ranks and stitched on rank 0 by the VAE's own blend; the frames equal the single-process
tiled decode **bit for bit** (each tile is the same module on the same latent slice, in float32, and the gather moves
bits unchanged; the blend runs on rank 0 in both cases)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.mark.slow  # two spawned processes importing torch + diffusers
def test_parallel_tiles_equal_the_single_process_tiled_decode(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from _h3_vae_ranks import h3_vae_rank

    mp.spawn(h3_vae_rank, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    zero, one = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert zero["parallel"].shape == zero["single"].shape == (9, 64, 96, 3)
    assert torch.equal(zero["parallel"], zero["single"])
    assert one["sent"] > 0 and zero["sent"] == 0  # rank 1 decoded tiles and sent them to rank 0
    assert zero["restored"] and one["restored"]


def test_tiling_is_what_the_parallel_path_reproduces() -> None:
    """The tiled decode differs from an untiled one (so the equality above is about the tiles, not a no-op)."""
    from _h3_vae_ranks import latents, tiny_video_vae

    wrapper = tiny_video_vae()
    z = latents()
    tiled = wrapper.decode(z)  # type: ignore[attr-defined]
    wrapper.vae.disable_tiling()  # type: ignore[attr-defined]
    untiled = wrapper.decode(z)  # type: ignore[attr-defined]
    assert tiled.shape == untiled.shape and not torch.equal(tiled, untiled)
