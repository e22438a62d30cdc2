"""VAE tiling: request options, off by default, the tiled decode against independent references,
and no leaking of one request's setting into another (alone, after each other, or in one batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _lingbot_helpers import request, run
from omni_lingbot.plan import plan_of
from omni_lingbot.stage_options import VaeTiling, resolve_vae_tiling
from omnicore.errors import InvalidRequest

SMALL_TILES = VaeTiling(min_height=64, min_width=64, stride_height=48, stride_width=48)


def _latent(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- options


def test_tiling_is_off_by_default(pipe):
    assert resolve_vae_tiling({}) is None and resolve_vae_tiling({"vae_tiling": False}) is None
    assert plan_of(pipe.preprocess(request())).vae_tiling is None
    assert pipe.vae.vae.use_tiling is False


def test_tiling_options():
    assert resolve_vae_tiling({"vae_tiling": True}) == VaeTiling(256, 256, 192, 192)  # the reference's defaults
    # a tile size alone turns tiling on; the other sizes keep their defaults; integral floats are accepted
    assert resolve_vae_tiling({"vae_tile_sample_min_width": 640.0, "vae_tile_sample_stride_width": 480}) == \
        VaeTiling(256, 640, 192, 480)
    assert resolve_vae_tiling({"vae_tiling": True, "vae_tile_sample_min_height": 8,
                               "vae_tile_sample_stride_height": 8}) == VaeTiling(8, 256, 8, 192)


@pytest.mark.parametrize(("extra", "field", "gist"), [
    ({"vae_tiling": "yes"}, "vae_tiling", "true or false"),
    ({"vae_tiling": True, "vae_tile_sample_min_height": 100}, "vae_tile_sample_min_height", "multiple of 8"),
    ({"vae_tile_sample_min_width": 0}, "vae_tile_sample_min_width", ">= 8"),
    ({"vae_tile_sample_stride_height": 12.5}, "vae_tile_sample_stride_height", "integer"),
    ({"vae_tile_sample_stride_width": 264}, "vae_tile_sample_stride_width", r"must not exceed .*min_width \(256\)"),
    ({"vae_tiling": False, "vae_tile_sample_min_height": 128}, "vae_tile_sample_min_height", "contradict"),
])
def test_tiling_option_errors_name_the_field(pipe, extra, field, gist):
    with pytest.raises(InvalidRequest, match=gist) as info:
        pipe.preprocess(request(extra=extra))
    assert info.value.field == f"extra.{field}"


# ---------------------------------------------------------------------------------------------- the tiled decode


def test_tiled_decode_is_tiles_of_the_untiled_decoder_blended_linearly(pipe):
    """Independent reference: decode each tile's latent crop untiled and blend by hand. With 64 px tiles at a
    48 px stride (8 / 6 latent cells) the output's first 48 columns are tile 0, columns 64..96 are tile 1's
    columns 16..48, and columns 48..64 ramp linearly from tile 0 to tile 1."""
    vae = pipe.vae
    z = _latent((1, 4, 1, 8, 12), 0)  # 64 x 96 px: one tile row, tiles at latent columns 0..8 and 6..12
    with vae.tiling(SMALL_TILES):
        tiled = vae.decode(z)
    tile0 = vae.decode(z[..., 0:8, 0:8])
    tile1 = vae.decode(z[..., 0:8, 6:12])
    assert tiled.shape == (1, 1, 64, 96, 3)
    torch.testing.assert_close(tiled[:, :, :48, :48], tile0[:, :, :48, :48], atol=1e-6, rtol=0)
    torch.testing.assert_close(tiled[:, :, :48, 64:96], tile1[:, :, :48, 16:48], atol=1e-6, rtol=0)
    ramp = torch.arange(16, dtype=torch.float32).view(1, 1, 1, 16, 1) / 16
    blended = tile0[:, :, :48, 48:64] * (1 - ramp) + tile1[:, :, :48, 0:16] * ramp
    # the decoder clamps after blending; where neither tile saturated, clamp-then-blend is the same thing
    inside = ((tile0[:, :, :48, 48:64] > 0) & (tile0[:, :, :48, 48:64] < 1)
              & (tile1[:, :, :48, 0:16] > 0) & (tile1[:, :, :48, 0:16] < 1))
    assert inside.float().mean() > 0.5
    torch.testing.assert_close(tiled[:, :, :48, 48:64][inside], blended[inside], atol=1e-5, rtol=0)


def test_tiled_decode_approximates_the_untiled_decode(pipe):
    """Default tiles (256 / 192 px) on a 128 x 320 latent: two tiles across. The tiny decoder has random weights
    and a ~115 px receptive field with no trained locality, so seams are not invisible as with the real VAE;
    the bound says the tiled frame is far closer to the untiled one than an unrelated decode is. Measured over
    seeds 0-2: error / unrelated = 0.20-0.24; asserted < 0.4."""
    vae = pipe.vae
    z, other = _latent((1, 4, 1, 16, 40), 0), _latent((1, 4, 1, 16, 40), 1)
    untiled = vae.decode(z)
    with vae.tiling(VaeTiling()):
        tiled = vae.decode(z)
    error = (tiled - untiled).abs().mean().item()
    unrelated = (vae.decode(other) - untiled).abs().mean().item()
    assert 0 < error < 0.4 * unrelated
    # a latent no larger than one tile is not split at all: bit-identical
    small = _latent((1, 4, 1, 8, 8), 2)
    with vae.tiling(SMALL_TILES):
        assert torch.equal(vae.decode(small), pipe.vae.decode(small))


# ---------------------------------------------------------------------------------------------- no leaks


def test_tiling_state_is_restored_even_on_error(pipe):
    vae = pipe.vae.vae
    before = (vae.use_tiling, vae.tile_sample_min_height, vae.tile_sample_stride_width)
    with pytest.raises(RuntimeError, match="boom"), pipe.vae.tiling(SMALL_TILES):
        assert vae.use_tiling and vae.tile_sample_min_height == 64
        raise RuntimeError("boom")
    assert (vae.use_tiling, vae.tile_sample_min_height, vae.tile_sample_stride_width) == before


def test_tiling_is_per_request_in_the_pipeline(pipe):
    params = {"height": 64, "width": 128, "num_frames": 5, "num_inference_steps": 2}
    tiles = {"vae_tile_sample_min_height": 64, "vae_tile_sample_min_width": 64,
             "vae_tile_sample_stride_height": 48, "vae_tile_sample_stride_width": 48}
    plain_req, tiled_req = request(**params), request(**params, extra=tiles)
    assert pipe.batch_key(pipe.preprocess(plain_req)) == pipe.batch_key(pipe.preprocess(tiled_req))
    state, (plain,) = run(pipe, plain_req)
    _, (tiled,) = run(pipe, tiled_req)
    assert pipe.vae.vae.use_tiling is False  # nothing left switched on
    _, (plain_again,) = run(pipe, plain_req)
    assert np.array_equal(plain_again.frames, plain.frames)
    # the tiled request decoded exactly the way the VAE decodes these latents with those tiles
    with pipe.vae.tiling(SMALL_TILES):
        expected = pipe.vae.decode(state.latents)[0]
    assert np.array_equal(tiled.frames, (expected * 255).round().clamp(0, 255).to(torch.uint8).numpy())
    assert not np.array_equal(tiled.frames, plain.frames)
    # one batch holding both: each request decodes under its own setting
    both_state, (plain_b, tiled_b) = run(pipe, plain_req, tiled_req)
    for out, latents, tiling in ((plain_b, both_state.latents[:1], None), (tiled_b, both_state.latents[1:],
                                                                           SMALL_TILES)):
        with pipe.vae.tiling(tiling):
            frames = pipe.vae.decode(latents)[0]
        assert np.array_equal(out.frames, (frames * 255).round().clamp(0, 255).to(torch.uint8).numpy())


# ---------------------------------------------------------------------------------------------- cancellation


def test_decode_checks_cancellation_once_per_latent_frame(pipe):
    """The Wan decoder runs per latent frame; each run is a cancellation point (engine.cancellation), so a
    cancelled video stops decoding within one chunk instead of after the whole clip."""
    from omnicore.engine.cancellation import cancel_scope
    from omnicore.errors import Cancelled

    vae = pipe.vae
    z = _latent((1, 4, 3, 4, 4), 1)  # three latent frames
    checks: list[int] = []
    with cancel_scope(lambda: checks.append(1) or False):
        vae.decode(z)
    assert len(checks) == 3, checks  # one check per latent frame
    checks.clear()
    with cancel_scope(lambda: checks.append(1) or len(checks) >= 2), pytest.raises(Cancelled):
        vae.decode(z)  # cancelled before the second frame: stops there
    assert len(checks) == 2
    vae.decode(z)  # outside a runner's scope nothing is checked, and the hooks are gone
