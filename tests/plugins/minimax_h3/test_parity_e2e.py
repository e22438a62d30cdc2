"""End to end against the peer: same weights, seed and request through our pipeline and through diffusers'
``MiniMaxH3ModularPipeline`` (same noise convention: one CPU generator per output, conditioning noise, then video
noise, then audio rows). Decoded frames agree to one uint8 level and the waveforms to 1e-5; the only numeric
difference is our serving DiT (fused qkv, packed attention), itself within 1e-5 of diffusers' per forward.

diffusers counts grid points (``num_inference_steps=3`` = 2 model calls), we count model calls; and it generates
at least 5 s, so these runs use 124 frames."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _h3_helpers import image, keyframe, reference, request, run, tone

pytestmark = pytest.mark.slow

FRAMES = 124
SEED = 11


@pytest.fixture(scope="module")
def peer(tiny_dir: Path):
    from _h3_peer import peer_pipeline

    return peer_pipeline(tiny_dir)


@pytest.fixture(scope="module")
def peer_ref(tiny_combined_dir: Path):
    from _h3_peer import peer_pipeline

    return peer_pipeline(tiny_combined_dir, partition="ref2va")


def peer_run(peer, **inputs):
    out = peer(prompt="rain on a tin roof", num_frames=FRAMES, num_inference_steps=3,
               generator=torch.Generator().manual_seed(SEED), output_type="np", output=["videos", "audio"], **inputs)
    return out["videos"][0], out["audio"][0].float().numpy()


def assert_matches(ours, theirs) -> None:
    frames, audio = theirs
    assert ours.frames.shape == frames.shape and ours.audio.shape == audio.shape
    expected = (frames * 255.0).round().astype(np.int16)
    assert np.abs(ours.frames.astype(np.int16) - expected).max() <= 1
    np.testing.assert_allclose(ours.audio, audio, atol=1e-5, rtol=0)
    assert np.abs(audio).max() > 1e-3  # a silent track would make the comparison vacuous


def test_t2va_matches_diffusers(pipe, peer):
    _, (ours,) = run(pipe, request(num_frames=FRAMES, duration=None, seed=SEED, extra={"aspect_ratio": "16:9"}))
    assert_matches(ours, peer_run(peer, height=64, width=128))


def test_fl2va_first_and_last_keyframe_match_diffusers(pipe, peer):
    first, last = image(96, 64, seed=1), image(80, 64, seed=2)
    _, (ours,) = run(pipe, request(num_frames=FRAMES, duration=None, seed=SEED, extra={},
                                   inputs=(keyframe("first_frame", first), keyframe("last_frame", last))))
    assert ours.frames.shape[1:3] == (64, 96)
    assert_matches(ours, peer_run(peer, image=first, last_image=last))


def test_ref2va_image_and_audio_references_match_diffusers(combined, peer_ref):
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3AudioReference, MiniMaxH3ImageReference

    ref_image, clip = image(320, 256, seed=3), tone(2.5)
    _, (ours,) = run(combined, request(num_frames=FRAMES, duration=None, seed=SEED, extra={},
                                       inputs=(reference("image", ref_image), reference("audio", clip))))
    refs = [MiniMaxH3ImageReference(image=ref_image),
            MiniMaxH3AudioReference(audio=torch.from_numpy(clip.waveform), sample_rate=clip.sample_rate)]
    assert_matches(ours, peer_run(peer_ref, references=refs, height=64, width=128))


def test_ref2va_video_reference_with_soundtrack_matches_diffusers(combined, peer_ref, tmp_path):
    """Everything around Qwen3-VL's video pixels (which both sides take from the plugin, transformers' video
    processor needing torchvision): 24 fps resampling, conditioner sampling and timestamps, presentation, VAE
    encode of the first 17n+5 frames, the soundtrack's rows and the layout."""
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ImageReference, MiniMaxH3VideoReference
    from omnicore.media import read_audio_clip, read_video_clip
    from test_pipeline import write_reference_video

    path = write_reference_video(tmp_path / "ref.mp4")
    ref_image = image(320, 256, seed=6)
    _, (ours,) = run(combined, request(num_frames=FRAMES, duration=None, seed=SEED, extra={},
                                       inputs=(reference("video", str(path)), reference("image", ref_image))))
    clip, sound = read_video_clip(str(path)), read_audio_clip(str(path))
    refs = [MiniMaxH3VideoReference(frames=clip.frames, fps=clip.fps, audio=torch.from_numpy(sound.waveform),
                                    sample_rate=sound.sample_rate), MiniMaxH3ImageReference(image=ref_image)]
    assert_matches(ours, peer_run(peer_ref, references=refs, height=64, width=128))
