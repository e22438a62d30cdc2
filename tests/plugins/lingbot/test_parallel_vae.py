"""LingBot's parallel VAE decode (``--parallel``, gloo, 2 processes).

A request that asks for a tiled decode (``extra.vae_tiling``) has its Wan VAE tiles decoded round-robin across the
ranks and blended on rank 0 with the VAE's own ``blend_v``/``blend_h``. The frames equal diffusers' single-process
``tiled_decode`` **bit for bit** (each tile: the same decoder, the same latent slice, the causal cache cleared per
tile, in float32; the gather moves bits; the blend runs on rank 0 in both cases). Through the engine, the frames of
``--parallel cfg=2`` with the parallel decode equal those with ``parallel_vae_decode=false`` (rank 0 decoding alone)
bit for bit. Untiled requests decode on rank 0 alone (a tiled decode is not the untiled one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omnicore.engine.api import Engine, make_request

TILED = {"vae_tile_sample_min_height": 16, "vae_tile_sample_min_width": 16, "vae_tile_sample_stride_height": 8,
         "vae_tile_sample_stride_width": 8}  # a 4 x 4 grid of tiles on the 32 x 32 frame


@pytest.mark.slow  # two spawned processes importing torch + diffusers
def test_parallel_tiles_equal_diffusers_single_process_tiled_decode(tmp_path: Path) -> None:
    import torch.multiprocessing as mp
    from _lingbot_vae_ranks import lingbot_vae_rank

    mp.spawn(lingbot_vae_rank, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    zero, one = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert zero["frames"].shape == zero["single"].shape == (1, 5, 64, 64, 3)
    assert torch.equal(zero["frames"], zero["single"])
    assert one["frames"] is None and one["sent"] > 0 and zero["sent"] == 0


def test_the_tile_grid_decides_whether_a_decode_is_shared() -> None:
    from _lingbot_vae_ranks import latents, tiling, tiny_vae

    wrapper = tiny_vae()
    z = latents()
    assert not wrapper.splits_over_ranks(z)  # type: ignore[attr-defined]  # untiled by default
    with wrapper.tiling(tiling()):  # type: ignore[attr-defined]
        assert wrapper.splits_over_ranks(z)  # type: ignore[attr-defined]
        tiled = wrapper.decode(z)  # type: ignore[attr-defined]
        # one rank (no worker group): the parallel path is the plain tiled decode
        assert torch.equal(wrapper.decode_over_ranks(z, None), tiled)  # type: ignore[attr-defined]
        assert not wrapper.splits_over_ranks(z[..., :4, :4])  # type: ignore[attr-defined]  # one tile only
    assert not torch.equal(wrapper.decode(z), tiled)  # type: ignore[attr-defined]


def _frames(engine: Engine, extra: dict[str, int]) -> np.ndarray:
    job = engine.submit(make_request("a red fox", guidance_scale=3.0, seed=11, height=32, width=32, num_frames=5,
                                     num_inference_steps=2, extra=dict(extra)))
    return job.result(600)[0].frames


@pytest.mark.slow  # two 2-process engines
def test_engine_frames_with_the_parallel_decode_equal_rank_0_decoding_alone(tiny_dir: Path) -> None:
    with Engine(str(tiny_dir), parallel="cfg=2") as engine:
        assert engine.pipeline.decode_on_every_rank
        engine.group.ctx.stats.reset()
        shared = _frames(engine, TILED)
        assert engine.group.ctx.stats.snapshot()["calls"].get("vae_gather") == 1
        untiled = _frames(engine, {})  # decoded by rank 0 alone: no gather
        assert engine.group.ctx.stats.snapshot()["calls"].get("vae_gather") == 1
    with Engine(str(tiny_dir), parallel="cfg=2", model_options={"parallel_vae_decode": False}) as engine:
        assert not engine.pipeline.decode_on_every_rank
        alone = _frames(engine, TILED)
        alone_untiled = _frames(engine, {})
        assert "vae_gather" not in engine.group.ctx.stats.snapshot()["calls"]
    assert shared.shape == alone.shape and np.array_equal(shared, alone)
    assert np.array_equal(untiled, alone_untiled)


@pytest.mark.slow  # one 2-process engine
def test_rank0_failing_inside_the_parallel_decode_ends_the_group_instead_of_hanging(tiny_dir: Path) -> None:
    """The worker waits in the tile exchange rank 0 never enters: the group is ended, the job fails with rank 0's
    error, the engine turns unhealthy, naming the decode, and the worker process is gone."""
    import os

    engine = Engine(str(tiny_dir), parallel="cfg=2")
    worker = engine.group.processes[0]

    def failing(*_args: object, **_kwargs: object) -> None:  # rank 0's copy only
        raise RuntimeError("rank-0 decode boom")

    engine.pipeline.vae.decode_over_ranks = failing
    try:
        job = engine.submit(make_request("a red fox", guidance_scale=3.0, seed=11, height=32, width=32,
                                         num_frames=5, num_inference_steps=2, extra=dict(TILED)))
        assert job.wait(60), "the request hung"
        assert job.status == "failed" and "rank-0 decode boom" in str(job.error)
        assert not engine.worker_alive
        assert "the parallel VAE decode" in (engine.group.failure or "")
    finally:
        assert engine.close(timeout=60)
    worker.join(10)
    assert not worker.is_alive()
    try:
        os.kill(worker.pid, 0)  # type: ignore[arg-type]
        gone = False
    except ProcessLookupError:
        gone = True
    assert gone or worker.exitcode is not None
