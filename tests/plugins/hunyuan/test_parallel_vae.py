"""HunyuanImage-3's tiled VAE decode and its parallel form (``--parallel``, gloo, 2 processes).

The release decodes untiled, and so does the plugin unless ``vae_tile_size`` is set. With tiles, ``--parallel``
decodes them round-robin across the ranks and rank 0 blends them in the single-rank order: the image equals the
single-rank tiled decode **bit for bit** (each tile: the same VAE on the same latent slice in float32; the gather
moves bits; the weighted blend runs on rank 0 in the same order). Through the engine (``tp=2``), the image with the
parallel decode equals the one with ``parallel_vae_decode=false`` bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omnicore.engine.api import Engine, make_request
from omnicore.errors import ConfigError


def test_tile_options_are_checked_naming_the_option() -> None:
    from omni_hunyuan.vae_tiling import VaeTiles

    assert VaeTiles.from_options({}) is None
    assert VaeTiles.from_options({"vae_tile_size": 512}) == VaeTiles(512, 128)
    assert VaeTiles.from_options({"vae_tile_size": 32}) == VaeTiles(32, 16)
    with pytest.raises(ConfigError, match="vae_tile_size.*multiple of 16"):
        VaeTiles.from_options({"vae_tile_size": 40})
    with pytest.raises(ConfigError, match=r"vae_tile_overlap.*below vae_tile_size \(64\)"):
        VaeTiles.from_options({"vae_tile_size": 64, "vae_tile_overlap": 64})
    with pytest.raises(ConfigError, match="vae_tile_overlap.*needs vae_tile_size"):
        VaeTiles.from_options({"vae_tile_overlap": 16})


def test_tile_grid_covers_the_latent_and_the_blend_keeps_a_flat_image_flat() -> None:
    from omni_hunyuan.vae_tiling import VaeTiles, tile_starts, tiled_decode

    assert tile_starts(5, 2, 1) == [0, 1, 2, 3] and tile_starts(8, 4, 3) == [0, 3, 4] and tile_starts(2, 2, 1) == [0]
    seen: list[tuple[int, ...]] = []

    def flat(z: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(z.shape))
        return torch.full((z.shape[0], 3, z.shape[-2] * 16, z.shape[-1] * 16), 0.25)

    image = tiled_decode(flat, torch.zeros(1, 4, 5, 7), VaeTiles(48, 16))
    assert image is not None and image.shape == (1, 3, 80, 112)
    assert torch.allclose(image, torch.full_like(image, 0.25), rtol=0, atol=1e-6)
    assert len(seen) == 2 * 3 and set(seen) == {(1, 4, 3, 3)}  # full tiles only; the last ones end at the edge


def test_a_tiled_decode_is_close_to_but_not_the_untiled_one() -> None:
    from _hunyuan_vae_ranks import latents, tiles, tiny_vae
    from omni_hunyuan.vae_tiling import tiled_decode

    vae, z = tiny_vae(), latents()
    with torch.no_grad():
        tiled, untiled = tiled_decode(vae.decode, z, tiles()), vae.decode(z)  # type: ignore[arg-type, operator]
    assert tiled is not None and tiled.shape == untiled.shape == (1, 3, 80, 96)
    assert not torch.equal(tiled, untiled)


@pytest.mark.slow  # two spawned processes importing torch
def test_parallel_tiles_equal_the_single_rank_tiled_decode(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from _hunyuan_vae_ranks import hunyuan_vae_rank

    mp.spawn(hunyuan_vae_rank, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    zero, one = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert zero["image"].shape == zero["single"].shape == (1, 3, 80, 96)
    assert torch.equal(zero["image"], zero["single"])
    assert one["image"] is None and one["sent"] > 0 and zero["sent"] == 0


def _image(engine: Engine) -> np.ndarray:
    job = engine.submit(make_request("a lighthouse at dusk", seed=7, height=64, width=64, num_inference_steps=2,
                                     guidance_scale=4.0))
    return job.result(600)[0].frames


@pytest.mark.slow  # two 2-process engines
def test_engine_image_with_the_parallel_decode_equals_rank_0_decoding_alone(micro_dir: Path) -> None:
    tiled = {"vae_tile_size": 32, "vae_tile_overlap": 16}  # 64 x 64 pixels: a 3 x 3 grid of tiles
    with Engine(str(micro_dir), parallel="tp=2", model_options=tiled) as engine:
        assert engine.pipeline.decode_on_every_rank
        engine.group.ctx.stats.reset()
        shared = _image(engine)
        assert engine.group.ctx.stats.snapshot()["calls"].get("vae_gather") == 1
    with Engine(str(micro_dir), parallel="tp=2", model_options={**tiled, "parallel_vae_decode": False}) as engine:
        assert not engine.pipeline.decode_on_every_rank
        alone = _image(engine)
    assert shared.shape == alone.shape == (1, 64, 64, 3) and np.array_equal(shared, alone)
