"""HTTP: conditioning media with roles on ``/v1/videos`` (multipart and JSON), upload validation before queueing,
``quality``, ``revised_prompt``, the model's default seed, and model cards — against a real uvicorn serving the
toy-media model (issue 8 items 1, 3, 7, 8, 9)."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
from _server_helpers import LiveServer, read_events
from omnicore.config import Settings
from omnicore.engine.api import Engine
from PIL import Image
from toy import ToyPlugin, toy_host
from toy.media import TOY_MEDIA_SPEC, write_mp4, write_png, write_wav


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from omnicore.server import ServerSettings, create_app

    root = tmp_path_factory.mktemp("media-server")
    settings = Settings(cache_dir=str(root / "cache"))
    engine = Engine("tiny:toy-media", host=toy_host(settings, plugin=ToyPlugin(TOY_MEDIA_SPEC)), settings=settings,
                    model_options={"revise_prompt": "true"})
    server = LiveServer(create_app(engine, ServerSettings(state_dir=root / "state"))).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media-uploads")
    return {"png": write_png(d / "a.png", 30).read_bytes(), "png2": write_png(d / "b.png", 220).read_bytes(),
            "mp4": write_mp4(d / "r.mp4", value=200).read_bytes(),
            "long": write_mp4(d / "long.mp4", frames=24, fps=8).read_bytes(),
            "wav": write_wav(d / "r.wav").read_bytes()}


def _frames(mp4: bytes) -> np.ndarray:
    with av.open(io.BytesIO(mp4)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


BASE = {"prompt": "a lamp", "num_frames": 2, "seed": 5}


def test_model_card_lists_modes_roles_limits_and_options(srv, client_for):
    c = client_for(srv)
    card = c.get("/v1/models").json()["data"][0]["omnicore"]
    assert card["modes"] == ["t2i", "t2v", "i2i", "i2v"]
    roles = {r["role"]: r for r in card["inputs"]["roles"]}
    assert list(roles) == ["reference", "first_frame", "last_frame"]
    assert roles["reference"]["kinds"] == ["image", "video", "audio"] and roles["reference"]["max_count"] == 3
    assert roles["reference"]["max_duration_s"] == 2.0 and card["inputs"]["max_inputs"] == 4
    assert card["inputs"]["max_input_images"] == 3  # the default image role is `reference`
    assert card["video"]["fps_range"] == [1.0, 60.0] and card["video"]["max_frames"] == 64
    assert card["sizes"]["multiple_of"] == 8 and card["sizes"]["max_pixels"] == 1024 * 1024
    assert card["defaults"]["seed"] == 1234 and card["sizes"]["default"] == "16x16"  # the preset's defaults
    options = {o["name"]: o for o in card["options"]}
    assert options["revise_prompt"]["value"] is True and options["variant"]["value"] == "base"
    assert options["variant"]["choices"] == ["base", "large"]
    assert "image.edit" in card["tasks"] and "video.generate" in card["tasks"]


def test_images_revised_prompt_default_seed_and_quality(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    img = client.images.generate(model="toy-media", prompt="a red kite")
    assert img.data[0].revised_prompt == "revised: a red kite"
    assert img.data[0].model_extra["seed"] == 1234  # no seed sent: the model's default seed
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model="toy-media", prompt="x", quality="hd")
    assert err.value.body["param"] == "quality" and err.value.body["code"] == "unsupported_parameter"


def test_quality_reaches_the_model(srv, client_for):
    c = client_for(srv)
    totals = {}
    for quality in ("draft", "auto", "high"):
        with c.stream("POST", "/v1/images/generations", json={"prompt": "x", "quality": quality, "stream": True}) \
                as r:
            events = read_events(r)
        totals[quality] = {e["data"]["total_steps"] for e in events if e["event"].endswith(".progress")} - {None, 0}
        done = [e for e in events if e["event"].endswith(".completed")]
        assert done and done[0]["data"]["revised_prompt"] == "revised: x"
    assert totals == {"draft": {1}, "auto": {2}, "high": {2}}  # toy-media: draft halves the default steps
    r = c.post("/v1/videos/sync", json={**BASE, "quality": "draft"})
    assert r.status_code == 200
    r = c.post("/v1/videos", json={**BASE, "quality": "best"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "quality"


def test_video_roles_multipart_and_json_reach_the_model(srv, client_for, media):
    c = client_for(srv)
    plain = _frames(c.post("/v1/videos/sync", json=BASE).content)
    files = [("input_reference", ("a.png", media["png"], "image/png")),
             ("last_frame", ("b.png", media["png2"], "image/png")),
             ("reference_video", ("r.mp4", media["mp4"], "video/mp4")),
             ("reference_audio", ("r.wav", media["wav"], "audio/wav"))]
    form = {k: str(v) for k, v in BASE.items()}
    r = c.post("/v1/videos/sync", data=form, files=files)
    assert r.status_code == 200, r.text
    multipart = _frames(r.content)
    assert multipart.shape == plain.shape and np.abs(multipart.astype(int) - plain).max() > 0
    body = {**BASE, "input_reference": {"image_url": _data_url("image/png", media["png"])},
            "last_frame": {"image_url": _data_url("image/png", media["png2"])},
            "reference_video": [{"video_url": _data_url("video/mp4", media["mp4"])}],
            "reference_audio": [{"audio_url": _data_url("audio/wav", media["wav"])}]}
    r = c.post("/v1/videos/sync", json=body)
    assert r.status_code == 200, r.text
    assert np.array_equal(_frames(r.content), multipart)  # the same inputs, whichever encoding carried them
    first = _frames(c.post("/v1/videos/sync", json={**BASE, "input_reference": body["input_reference"]}).content)
    last = _frames(c.post("/v1/videos/sync", json={**BASE, "last_frame": body["input_reference"]}).content)
    assert not np.array_equal(first, last)  # the same image in another role conditions differently


def test_async_job_persists_media_with_roles(srv, client_for, media):
    from omnicore.server.routes_videos import rebuild_request

    c = client_for(srv)
    files = [("reference_images", ("a.png", media["png"], "image/png")),
             ("reference_images[]", ("b.png", media["png2"], "image/png")),
             ("reference_audio", ("r.wav", media["wav"], "audio/wav"))]
    r = c.post("/v1/videos", data={k: str(v) for k, v in BASE.items()}, files=files)
    assert r.status_code == 200, r.text
    rebuilt = rebuild_request(srv.ctx, r.json()["id"])  # what a restart re-enqueues
    assert [(m.kind, m.role) for m in rebuilt.inputs] == [("image", "reference"), ("image", "reference"),
                                                          ("audio", "reference")]
    assert rebuilt.inputs[2].data.sample_rate == 8000 and rebuilt.params.seed == 5


@pytest.mark.parametrize(("files", "json_body", "status", "param", "code"), [
    ([("reference_images", ("a.png", "png", "image/png"))] * 4, None, 400, "reference_images",
     "too_many_input_images"),
    ([("reference_images", ("a.png", "png", "image/png"))] * 3 + [("reference_video", ("r.mp4", "mp4", "video/mp4"))],
     None, 400, "reference_video", "invalid_value"),
    ([("reference_video", ("l.mp4", "long", "video/mp4"))], None, 400, "reference_video", "invalid_media"),
    ([("reference_video", ("x.mp4", b"\x00" * 64, "video/mp4"))], None, 415, "reference_video",
     "unsupported_media_type"),
    ([("reference_video", ("a.png", "png", "video/mp4"))], None, 415, "reference_video", "unsupported_media_type"),
    ([("last_frame", ("a.gif", b"GIF89a....", "image/gif"))], None, 415, "last_frame", "unsupported_media_type"),
    ([("input_reference", ("a.png", "png", "image/png"))] * 2, None, 400, "input_reference", "invalid_value"),
    (None, {"reference_audio": [{"audio_url": "https://example.com/a.wav"}]}, 400, "reference_audio",
     "unsupported_parameter"),
    (None, {"reference_video": [{"image_url": "data:,"}]}, 400, "reference_video.0.video_url",
     "missing_required_parameter"),
])
def test_bad_media_is_refused_before_queueing(srv, client_for, media, files, json_body, status, param, code):
    c = client_for(srv)
    calls = dict(srv.ctx.engine.pipeline.preprocess_calls)
    # job ids only: the module-scoped server may still be finishing an earlier test's job (its record changes)
    before = [j["id"] for j in c.get("/v1/videos").json()["data"]]
    if files is not None:
        parts = [(k, (n, media[d] if isinstance(d, str) else d, t)) for k, (n, d, t) in files]
        r = c.post("/v1/videos", data={k: str(v) for k, v in BASE.items()}, files=parts)
    else:
        r = c.post("/v1/videos", json={**BASE, **json_body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert srv.ctx.engine.pipeline.preprocess_calls == calls
    assert [j["id"] for j in c.get("/v1/videos").json()["data"]] == before


def test_roles_a_model_lacks_are_unsupported_for_model(make_server, client_for, media):
    c = client_for(make_server())  # the plain toy declares no roles
    for field, name, data, mime in (("last_frame", "a.png", media["png"], "image/png"),
                                    ("reference_audio", "r.wav", media["wav"], "audio/wav"),
                                    ("reference_images", "a.png", media["png"], "image/png")):
        r = c.post("/v1/videos", data={"prompt": "x"}, files={field: (name, data, mime)})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (field, "unsupported_for_model") and "accepts: none" in err["message"]
    edited = c.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", media["png"], "image/png")})
    assert edited.status_code == 404 and edited.json()["error"]["code"] == "task_not_supported"


def test_image_edits_use_the_default_image_role(srv, client_for, media):
    c = client_for(srv)
    r = c.post("/v1/images/edits", data={"prompt": "x", "seed": "2"},
               files=[("image[]", ("a.png", media["png"], "image/png")), ("image[]", ("b.png", media["png2"],
                                                                                     "image/png"))])
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["revised_prompt"] == "revised: x"
    pic = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
    plain = c.post("/v1/images/generations", json={"prompt": "x", "seed": 2}).json()["data"][0]["b64_json"]
    assert not np.array_equal(pic, np.asarray(Image.open(io.BytesIO(base64.b64decode(plain)))))
    r = c.post("/v1/images/edits", data={"prompt": "x"}, files=[("image[]", ("a.png", media["png"], "image/png"))] * 4)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_input_images"


def test_openai_sdk_sends_a_first_frame(srv, media):
    openai = pytest.importorskip("openai")
    import time
    import warnings

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create(model="toy-media", prompt="a lamp", input_reference=("a.png", media["png"],
                                                                                          "image/png"),
                                     extra_body={"num_frames": 2, "seed": 5})
        for _ in range(600):
            video = client.videos.retrieve(video.id)
            if video.status in ("completed", "failed"):
                break
            time.sleep(0.05)
        assert video.status == "completed", video
        data = client.videos.download_content(video.id).read()
    plain = _frames(httpx_sync(srv, {**BASE}))
    first = _frames(httpx_sync(srv, {**BASE, "input_reference": {"image_url": _data_url("image/png", media["png"])}}))
    assert np.array_equal(_frames(data), first) and not np.array_equal(first, plain)


def httpx_sync(srv, body):
    import httpx

    with httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/videos/sync", json=body)
    assert r.status_code == 200, r.text
    return r.content
