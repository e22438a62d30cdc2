"""Media inputs with roles through the Python API: the request record, the engine's capability check before
dispatch, and video/audio reaching the model decoded (issue 8 item 1)."""

from __future__ import annotations

import numpy as np
import pytest
from omnicore.config import Settings
from omnicore.engine.api import Engine
from omnicore.engine.request import GenerationRequest, MediaInput
from omnicore.errors import InvalidRequest
from omnicore.media import AudioClip, VideoClip, read_audio_clip, read_video_clip, sniff_kind
from toy import ToyPlugin, toy_host
from toy.media import TOY_MEDIA_SPEC, write_mp4, write_png, write_wav


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    cache = tmp_path_factory.mktemp("media-cache")
    settings = Settings(cache_dir=str(cache))
    with Engine("tiny:toy-media", host=toy_host(settings, plugin=ToyPlugin(TOY_MEDIA_SPEC)), settings=settings) as e:
        yield e


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("media-files")
    return {"dark": write_png(d / "dark.png", 20), "bright": write_png(d / "bright.png", 230),
            "clip": write_mp4(d / "clip.mp4", frames=4, fps=8, value=220),
            "long": write_mp4(d / "long.mp4", frames=24, fps=8, value=220),
            "wav": write_wav(d / "tone.wav", seconds=0.5), "text": _text(d / "notes.txt")}


def _text(path):
    path.write_text("not media")
    return path


# ------------------------------------------------------------------------------------------- the request record


def test_request_normalises_legacy_media_into_role_less_inputs():
    r = GenerationRequest("x", images=["a.png"], audios=[b"RIFF"], inputs=[MediaInput("video", "reference", "v.mp4")])
    assert [(m.kind, m.role) for m in r.inputs] == [("video", "reference"), ("image", None), ("audio", None)]
    assert r.images == ("a.png",) and r.videos == ("v.mp4",) and r.audios == (b"RIFF",)
    assert r.media("image") == (MediaInput("image", None, "a.png"),)
    assert r.media(role="reference") == (MediaInput("video", "reference", "v.mp4"),)
    # evolve(images=...) with the same count keeps the roles; a different count replaces them
    first = GenerationRequest("x", inputs=[MediaInput("image", "first_frame", "a.png")])
    assert first.evolve(images=["b.png"]).inputs == (MediaInput("image", "first_frame", "b.png"),)
    assert [m.role for m in first.evolve(images=["b.png", "c.png"]).inputs] == [None, None]
    # the input layout (kinds and roles) separates batches
    assert first.batch_key() != GenerationRequest("x", inputs=[MediaInput("image", "last_frame", "a.png")]).batch_key()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"inputs": ["a.png"]}, "inputs[0]"),
    ({"inputs": [MediaInput("image", "reference", "a")] * 1 + [object()]}, "inputs[1]"),
])
def test_request_rejects_non_media_inputs(kwargs, field):
    with pytest.raises(InvalidRequest) as info:
        GenerationRequest("x", **kwargs)
    assert info.value.field == field


def test_media_input_rejects_unknown_kind_and_empty_role():
    with pytest.raises(InvalidRequest, match="image"):
        MediaInput("picture", "reference", "a.png")
    with pytest.raises(InvalidRequest, match="non-empty"):
        MediaInput("image", " ", "a.png")


# ------------------------------------------------------------------------------------------- the engine's check


@pytest.mark.parametrize(("inputs", "field", "words"), [
    ([MediaInput("image", "edit_source", "x")], "inputs[0].role", "does not accept role 'edit_source'"),
    ([MediaInput("video", "first_frame", "x")], "inputs[0].kind", "takes image, not video"),
    ([MediaInput("image", "first_frame", "x")] * 2, "inputs[1]", "at most 1 first_frame input"),
    ([MediaInput("image", "reference", "x")] * 4, "inputs[3]", "at most 3 reference input"),
    ([MediaInput("image", "reference", "x")] * 3 + [MediaInput("image", "first_frame", "x"),
                                                   MediaInput("image", "last_frame", "x")], "inputs", "4 inputs"),
])
def test_engine_rejects_undeclared_roles_kinds_and_counts_before_dispatch(engine, inputs, field, words):
    calls = dict(engine.pipeline.preprocess_calls)
    with pytest.raises(InvalidRequest) as info:
        engine.generate("x", inputs=inputs)
    assert info.value.field == field and words in info.value.rule
    assert engine.pipeline.preprocess_calls == calls  # the model never saw it


def test_engine_checks_outputs_modalities_and_fps_range(engine):
    with pytest.raises(InvalidRequest) as info:
        engine.generate("x", num_outputs=5)
    assert info.value.field == "params.num_outputs"
    with pytest.raises(InvalidRequest) as info:
        engine.generate("x", modalities=("audio",))
    assert info.value.field == "modalities" and info.value.code == "unsupported_for_model"
    with pytest.raises(InvalidRequest) as info:
        engine.generate("x", num_frames=2, fps=90.0)
    assert info.value.field == "params.fps" and "[1, 60]" in info.value.rule


def test_role_less_media_take_the_models_first_declared_role(engine, files):
    job = engine.submit(GenerationRequest("x", images=[str(files["dark"])]))
    job.result(30)
    assert [(m.kind, m.role) for m in job.request.inputs] == [("image", "reference")]


def test_a_model_without_roles_rejects_media_naming_the_input(tmp_path, files):
    settings = Settings(cache_dir=str(tmp_path))
    with Engine("tiny:toy", host=toy_host(settings), settings=settings) as plain, \
            pytest.raises(InvalidRequest) as info:
        plain.generate("x", images=[str(files["dark"])])
    assert info.value.field == "inputs[0].kind" and "takes no image inputs" in info.value.rule
    assert info.value.code == "unsupported_for_model"


def test_roles_and_media_reach_the_model(engine, files):
    def run(**kw):
        [out] = engine.generate("a lamp", seed=3, **kw)
        return out.frames.astype(np.float32)

    plain = run()
    dark, bright = run(images=[str(files["dark"])]), run(images=[str(files["bright"])])
    as_first = run(inputs=[MediaInput("image", "first_frame", str(files["dark"]))])
    as_last = run(inputs=[MediaInput("image", "last_frame", str(files["dark"]))])
    for a, b in [(plain, dark), (dark, bright), (dark, as_first), (as_first, as_last)]:
        assert np.abs(a - b).max() > 0
    assert np.array_equal(run(images=[str(files["dark"])]), dark)  # deterministic
    video = run(videos=[str(files["clip"])])
    audio = run(audios=[str(files["wav"])])
    assert np.abs(video - plain).max() > 0 and np.abs(audio - plain).max() > 0 and np.abs(video - audio).max() > 0
    # a decoded clip given directly equals the same file
    clip = read_video_clip(files["clip"])
    assert np.array_equal(run(inputs=[MediaInput("video", "reference", clip)]), video)


def test_role_duration_caps_are_checked_before_dispatch(engine, files):
    calls = dict(engine.pipeline.preprocess_calls)
    with pytest.raises(InvalidRequest) as info:
        engine.generate("x", videos=[str(files["long"])])  # 3 s; the reference role takes at most 2 s
    assert info.value.field == "inputs[0]" and "at most 2 s" in info.value.rule
    long_audio = AudioClip(np.zeros((1, 8000 * 3), np.float32), 8000)
    with pytest.raises(InvalidRequest, match="at most 2 s"):
        engine.generate("x", audios=[long_audio])
    assert engine.pipeline.preprocess_calls == calls


# ------------------------------------------------------------------------------------------- readers


def test_readers_decode_video_and_audio_to_the_documented_records(files, tmp_path):
    clip = read_video_clip(files["clip"])
    assert isinstance(clip, VideoClip) and clip.frames.dtype == np.uint8 and clip.frames.shape == (4, 32, 32, 3)
    assert clip.fps == 8.0 and clip.duration_s == 0.5 and abs(float(clip.frames.mean()) - 220) < 3
    wav = read_audio_clip(files["wav"])
    assert isinstance(wav, AudioClip) and wav.waveform.dtype == np.float32 and wav.waveform.shape == (1, 4000)
    assert wav.sample_rate == 8000 and 0.3 < float(np.abs(wav.waveform).max()) <= 0.51
    soundtrack = read_audio_clip(write_mp4(tmp_path / "av.mp4", audio_seconds=0.5))
    assert soundtrack.waveform.shape[0] == 2 and soundtrack.sample_rate == 16000
    assert [sniff_kind(files[k]) for k in ("dark", "clip", "wav")] == ["image", "video", "audio"]
    assert sniff_kind(files["clip"].read_bytes()) == "video"  # bytes work too; the name plays no part


def test_readers_enforce_caps_and_name_the_field(files):
    with pytest.raises(InvalidRequest) as info:
        read_video_clip(files["long"], field="ref", max_frames=10, max_duration_s=None)
    assert info.value.field == "ref" and "more than 10 frames" in info.value.rule
    with pytest.raises(InvalidRequest, match="more than 100 pixels"):
        read_video_clip(files["clip"], max_pixels=100)
    with pytest.raises(InvalidRequest, match="more than 3000 pixels in all"):  # 32x32 frames: the third breaks it
        read_video_clip(files["clip"], max_total_pixels=3000)
    assert read_video_clip(files["clip"], max_total_pixels=4 * 32 * 32).num_frames == 4
    with pytest.raises(InvalidRequest, match="longer than the limit of 1 s"):
        read_video_clip(files["long"], max_duration_s=1.0)
    with pytest.raises(InvalidRequest, match="shorter than the minimum"):
        read_audio_clip(files["wav"], min_duration_s=2.0)
    with pytest.raises(InvalidRequest, match="no video stream"):
        read_video_clip(files["wav"])
    with pytest.raises(InvalidRequest) as info:
        sniff_kind(files["text"], field="--reference")
    assert info.value.field == "--reference" and "not a recognised" in info.value.rule
    with pytest.raises(InvalidRequest, match="cannot read"):
        sniff_kind(files["text"].parent / "missing.png")


def test_media_input_load_decodes_every_kind(files):
    from PIL import Image

    img = MediaInput("image", "reference", str(files["dark"])).load()
    assert isinstance(img, Image.Image) and img.mode == "RGB" and img.getpixel((0, 0)) == (20, 20, 20)
    arr = MediaInput("image", None, np.full((4, 6, 3), 7, np.uint8)).load()
    assert arr.size == (6, 4)
    assert MediaInput("video", "reference", files["clip"].read_bytes()).load().num_frames == 4
    assert MediaInput("audio", "reference", str(files["wav"])).load().sample_rate == 8000
    with pytest.raises(InvalidRequest) as info:
        MediaInput("image", "reference", np.zeros((4, 4), np.float32)).load(field="inputs[2]")
    assert info.value.field == "inputs[2]" and "uint8 [H, W, 3]" in info.value.rule
    with pytest.raises(InvalidRequest, match="more than 100 pixels"):
        MediaInput("image", "reference", str(files["dark"])).load(max_pixels=100)


def test_async_engine_takes_inputs_with_roles(engine, files):
    import asyncio

    from omnicore.engine.api import AsyncEngine

    async def run():
        return await AsyncEngine(engine).generate("a lamp", seed=3,
                                                  inputs=[MediaInput("image", "last_frame", str(files["dark"]))])

    [out] = asyncio.run(run())
    [same] = engine.generate("a lamp", seed=3, inputs=[MediaInput("image", "last_frame", str(files["dark"]))])
    assert np.array_equal(out.frames, same.frames)
    with pytest.raises(InvalidRequest):
        asyncio.run(AsyncEngine(engine).generate("x", inputs=[MediaInput("audio", "last_frame", "a.wav")]))
