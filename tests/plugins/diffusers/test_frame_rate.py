"""A video pipeline told its frame rate (LTX's ``frame_rate``): the request's fps goes there, ``extra`` may set it,
and the output is written at what the pipeline was told. The checkpoint is a tiny random-weight LTXPipeline
written by ``save_pretrained``; outputs are compared with the stock pipeline bit for bit (CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

PROMPT = "a red fox in the snow"
RUN = {"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def ltx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )
    from omni_diffusers.presets import _t5, _tokenizer

    tokenizer, vocab = _tokenizer(32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                                                 num_attention_heads=4, attention_head_dim=8, cross_attention_dim=32,
                                                 num_layers=1, caption_channels=32)
        vae = AutoencoderKLLTXVideo(
            in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
            upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False, patch_size=1,
            patch_size_t=1, encoder_causal=True, decoder_causal=False)
        text_encoder = _t5(vocab)
    target = tmp_path_factory.mktemp("tiny-ltx")
    LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                transformer=transformer).save_pretrained(str(target), safe_serialization=True)
    return target


def _stock(path: Path, seed: int, frame_rate: int) -> np.ndarray:
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(PROMPT, frame_rate=frame_rate, max_sequence_length=32, guidance_scale=3.0, output_type="np",
                  generator=torch.Generator().manual_seed(seed), **RUN).frames[0]
    return (frames * 255).round().astype("uint8")


@pytest.mark.slow
def test_the_frame_rate_the_pipeline_was_told_is_the_outputs_fps(ltx_dir: Path, settings: Any) -> None:
    from _diffusers_helpers import make_engine

    with make_engine(ltx_dir, settings) as engine:
        assert engine.spec.defaults.fps == 25 and engine.pipeline.card.fps_keyword == "frame_rate"
        [default] = engine.generate(PROMPT, seed=1, guidance_scale=3.0, **RUN)
        [told] = engine.generate(PROMPT, seed=1, guidance_scale=3.0, extra={"frame_rate": 12}, **RUN)
        [asked] = engine.generate(PROMPT, seed=1, guidance_scale=3.0, fps=30, **RUN)
        pipeline = engine.pipeline
        from omnicore.engine.api import make_request

        keys = {pipeline.batch_key(pipeline.preprocess(make_request(PROMPT, seed=1, fps=f, **RUN))) for f in (24, 30)}
    assert (default.fps, told.fps, asked.fps) == (25.0, 12.0, 30.0)
    assert np.array_equal(default.frames, _stock(ltx_dir, 1, 25))
    assert np.array_equal(told.frames, _stock(ltx_dir, 1, 12))
    assert np.array_equal(asked.frames, _stock(ltx_dir, 1, 30))
    assert not np.array_equal(default.frames, told.frames)  # LTX conditions on it (rotary scale)
    assert len(keys) == 2  # two frame rates cannot share a call
