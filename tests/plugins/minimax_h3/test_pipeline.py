"""MiniMax-H3 pipeline on the tiny repositories: outputs, the three tasks, packed batching of different requests,
several outputs per request, cancellation inside a batch, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _h3_helpers import image, keyframe, reference, request, run, tone
from omnicore.errors import InvalidRequest


def test_t2va_output_is_video_with_stereo_32k_audio(pipe):
    state, (out,) = run(pipe, request())
    assert state.num_steps == 2
    assert out.kind == "video" and out.fps == 24.0 and out.frames.dtype == np.uint8
    assert out.frames.shape == (107, 64, 128, 3)  # 4 s -> 107 frames, 16:9 on the tiny 64-pixel canvas
    assert out.sample_rate == 32000 and out.audio.dtype == np.float32
    assert out.audio.shape == (2, 178 * 800) and np.isfinite(out.audio).all()
    assert out.seed == 7 and out.index == 0


def test_deterministic_and_seed_sensitive(pipe):
    _, (a,) = run(pipe, request())
    _, (b,) = run(pipe, request())
    _, (c,) = run(pipe, request(seed=8))
    assert np.array_equal(a.frames, b.frames) and np.array_equal(a.audio, b.audio)
    assert not np.array_equal(a.frames, c.frames) and not np.array_equal(a.audio, c.audio)


def test_preprocess_fills_the_request_once(pipe):
    prepared = pipe.preprocess(request(extra={"aspect_ratio": "1:1"}))
    p = prepared.params
    assert (p.height, p.width, p.num_frames, p.fps, p.num_inference_steps, p.flow_shift) == (64, 64, 107, 24.0, 2, 12.0)
    assert prepared.plan.resolved.task == "t2va" and pipe.preprocess(prepared) is prepared


def test_preprocess_keeps_the_callers_extra(pipe):
    """The plan lives in the request's typed ``plan`` slot: the prepared request's ``extra`` is still exactly what
    the caller sent (preprocess used to replace it with its own ``{"h3": ..., "media": ...}``)."""
    sent = {"aspect_ratio": "1:1", "duration": 4}
    prepared = pipe.preprocess(request(extra=sent))
    assert prepared.extra == sent and prepared.plan.resolved.height == 64
    assert prepared.batch_key() == pipe.preprocess(request(extra=sent)).batch_key()


def test_fl2va_keyframes_are_held_and_change_the_video(pipe):
    first, last = image(seed=1), image(seed=2)
    plain = run(pipe, request())[1][0]
    state, (out,) = run(pipe, request(inputs=(keyframe("first_frame", first), keyframe("last_frame", last)),
                                      extra={"aspect_ratio": "16:9"}))
    assert state.extras["items"][0].layout.num_condition_video_rows == 2 * (4 // 2) * (8 // 2)
    # the generated video's token grid (conditioning frames excluded) on the DiT's attention metadata
    frames = state.requests[0].plan.resolved.num_latent_frames
    assert state.extras["batch"].docs.metadata.latent_grid == (frames, 4 // 2, 8 // 2)
    assert out.frames.shape == plain.frames.shape and not np.array_equal(out.frames, plain.frames)
    # the anchors never move: the conditioning rows after the loop are the noised latents from encode
    fresh = pipe.encode([pipe.preprocess(request(inputs=(keyframe("first_frame", first),
                                                         keyframe("last_frame", last))))])
    n = state.extras["items"][0].layout.num_condition_video_rows
    assert torch.equal(state.latents[0][:n], fresh.latents[0][:n])


def test_fl2va_canvas_follows_the_first_keyframe(pipe):
    prepared = pipe.preprocess(request(inputs=(keyframe("first_frame", image(64, 128)),), extra={}))
    assert (prepared.params.height, prepared.params.width) == (128, 64)  # 1:2 portrait on the tiny canvas


def test_packed_batch_of_different_requests_equals_solo_runs(pipe):
    """Two requests of different sizes, lengths and tasks in one packed forward per step."""
    a = request(seed=3)
    b = request(seed=4, duration=5.0, inputs=(keyframe("first_frame", image(seed=5)),), extra={"aspect_ratio": "1:1"})
    state, batched = run(pipe, a, b)
    assert state.extras["batch"].num_requests == 2
    solo = [run(pipe, r)[1][0] for r in (a, b)]
    for got, want in zip(batched, solo):
        assert got.frames.shape == want.frames.shape and got.seed == want.seed
        assert np.abs(got.frames.astype(int) - want.frames.astype(int)).max() <= 1
        np.testing.assert_allclose(got.audio, want.audio, atol=1e-5)
    assert batched[1].frames.shape == (124, 64, 64, 3)


def test_num_outputs_use_consecutive_seeds(pipe):
    _, outs = run(pipe, request(num_outputs=2))
    assert [(o.index, o.seed) for o in outs] == [(0, 7), (1, 8)]
    _, (second,) = run(pipe, request(seed=8))
    assert np.abs(outs[1].frames.astype(int) - second.frames.astype(int)).max() <= 1


def test_select_requests_keeps_the_survivor_exact(pipe):
    a, b = request(seed=3), request(seed=4, extra={"aspect_ratio": "1:1"})
    state = pipe.encode([pipe.preprocess(a), pipe.preprocess(b)])
    state = pipe.denoise_step(state, 0)
    state = pipe.select_requests(state, [1])
    assert state.extras["batch"].num_requests == 1 and len(state.requests) == 1
    for step in range(1, state.num_steps):
        state = pipe.denoise_step(state, step)
    (kept,) = pipe.decode(state)
    _, (solo,) = run(pipe, b)
    assert kept.seed == 4 and np.abs(kept.frames.astype(int) - solo.frames.astype(int)).max() <= 1


def test_ref2va_on_a_combined_deployment(combined):
    assert combined.partition == "combined"
    refs = (reference("image", image(320, 256, seed=3)), reference("audio", tone(2.5)))
    state, (out,) = run(combined, request(inputs=refs, extra={}))
    assert state.extras["partition"] == "ref2va"
    items = state.extras["items"]
    assert items[0].layout.num_condition_audio_rows == 2 * 100  # 2.5 s of audio = 100 latents per channel
    assert items[0].layout.latent_grid == (state.requests[0].plan.resolved.num_latent_frames, 4 // 2, 8 // 2)
    assert out.frames.shape == (107, 64, 128, 3) and out.audio.shape == (2, 178 * 800)
    _, (t2va,) = run(combined, request())
    assert combined.preprocess(request()).plan.resolved.partition == "fl2va"
    assert not np.array_equal(out.frames, t2va.frames)


def test_errors_name_the_field(pipe, combined):
    with pytest.raises(InvalidRequest) as info:
        pipe.preprocess(request(extra={}))
    assert info.value.field == "extra.aspect_ratio"
    with pytest.raises(InvalidRequest) as info:
        pipe.preprocess(request(inputs=(reference("image", image(320, 256)),), extra={}))
    assert info.value.field == "inputs"  # an FL2VA deployment has no Ref2VA DiT
    with pytest.raises(InvalidRequest) as info:
        combined.preprocess(request(inputs=(reference("audio", tone()),), extra={}))
    assert info.value.field == "inputs"  # audio alone
    with pytest.raises(InvalidRequest) as info:
        pipe.preprocess(request(inputs=(keyframe("first_frame", b"not an image"),), extra={}))
    assert info.value.field == "inputs[0].data"
    with pytest.raises(InvalidRequest) as info:
        pipe.preprocess(request(fps=25.0))
    assert info.value.field == "params.fps"
    with pytest.raises(InvalidRequest) as info:  # refused as HTTP refuses it (it was floored to 96x32, i.e. 3:1)
        pipe.preprocess(request(height=50, width=100, extra={}))
    assert info.value.field == "params.width" and "nearest valid sizes: 128x64, 96x64" in str(info.value)


def write_reference_video(path, seconds: float = 2.5, fps: int = 12):
    """An H.264 + mono AAC file (96x64 noise frames at 12 fps, a 330 Hz tone)."""
    import av

    rng = np.random.default_rng(4)
    with av.open(str(path), "w") as container:
        v = container.add_stream("libx264", rate=fps)
        v.width, v.height, v.pix_fmt = 96, 64, "yuv420p"
        a = container.add_stream("aac", rate=32000, layout="mono")
        for i in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8), format="rgb24")
            frame.pts = i
            container.mux(v.encode(frame))
        container.mux(v.encode(None))
        t = np.arange(int(32000 * seconds)) / 32000
        samples = (0.2 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)[None]
        for start in range(0, samples.shape[1], 1024):
            frame = av.AudioFrame.from_ndarray(samples[:, start:start + 1024].copy(), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 32000, start
            container.mux(a.encode(frame))
        container.mux(a.encode(None))
    return path


def test_ref2va_video_reference_with_its_soundtrack(combined, tmp_path):
    """A video file with an audio stream: its soundtrack rows come right before its frames (labelled
    ``<Audio 1>``), the frames go to the VAE (first 17n+5 on the 24 fps clock) and, at 2 fps in blocks of two,
    to Qwen3-VL as ``<|video_pad|>`` blocks labelled with their time."""
    from omni_minimax_h3.text_encoder import VideoCondition

    path = write_reference_video(tmp_path / "ref.mp4")
    seen: list = []
    encode = combined.text_encoder.encode
    combined.text_encoder.encode = lambda prompt, items=(): (seen.append(list(items)), encode(prompt, items))[1]
    try:
        state, (out,) = run(combined, request(extra={}, inputs=(reference("video", str(path)),)))
    finally:
        combined.text_encoder.encode = encode
    (items,) = seen
    assert [label for label, _ in items] == ["<Audio 1>: ", "<Video 1>: "]
    video = items[1][1]
    assert isinstance(video, VideoCondition) and len(video.frames) == 5 and video.timestamps == [0.25, 1.25, 2.0]
    layout = state.extras["items"][0].layout
    # 60 frames on the 24 fps clock -> 56 encodable -> 17 latent frames of 4x6 -> 2x3 rows per frame
    assert layout.num_condition_video_rows == 17 * 2 * 3
    from omnicore.media import read_audio_clip

    decoded = read_audio_clip(str(path)).waveform.shape[1]  # 2.5 s plus the AAC codec's padding
    assert layout.num_condition_audio_rows == 2 * -(-decoded // 800)
    assert out.frames.shape == (107, 64, 128, 3) and np.isfinite(out.audio).all()


def test_partition_option_and_vae_precision(tiny_combined_dir, tiny_dir):
    from _h3_helpers import load
    from omnicore.errors import ConfigError

    fl2va = load(tiny_combined_dir, model_options={"partition": "fl2va"})
    assert fl2va.partition == "fl2va" and fl2va.transformer_ref is None
    with pytest.raises(InvalidRequest) as info:
        fl2va.preprocess(request(inputs=(reference("image", image(320, 256)),), extra={}))
    assert info.value.field == "inputs"
    assert load(tiny_combined_dir, model_options={"partition": "combined"}).partition == "combined"
    with pytest.raises(ConfigError) as err:
        load(tiny_dir, model_options={"partition": "ref2va"})  # an FL2VA-only repository
    assert err.value.name == "model_options.partition"
    bf16 = load(tiny_combined_dir, model_options={"partition": "fl2va"}, vae_decode_precision="bf16")
    _, (low,) = run(bf16, request())
    _, (full,) = run(fl2va, request())
    assert low.frames.shape == full.frames.shape and np.abs(low.frames.astype(int) - full.frames.astype(int)).max() < 64
