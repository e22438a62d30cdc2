"""``/v1/videos`` on a combined MiniMax-H3 deployment (both partitions) behind real uvicorn: t2va with an aspect
ratio in ``model_params``, fl2va from ``input_reference`` + ``last_frame``, ref2va from ``reference_images`` +
``reference_audio``; every answer is an MP4 with a 32 kHz stereo AAC track."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("omni_minimax_h3", reason="the MiniMax-H3 plugin (plugins/minimax_h3) is not installed")
av = pytest.importorskip("av")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from _server_helpers import LiveServer
    from omni_minimax_h3.presets import build_tiny_combined
    from omnicore.config import Settings
    from omnicore.engine.api import Engine
    from omnicore.plugin_host.host import PluginHost
    from omnicore.server import ServerSettings, create_app

    root = tmp_path_factory.mktemp("h3")
    repo = build_tiny_combined(root / "repo")
    settings = Settings(cache_dir=str(root / "cache"), plugins=("minimax_h3",))
    engine = Engine(str(repo), host=PluginHost(settings), settings=settings)
    server = LiveServer(create_app(engine, ServerSettings(state_dir=root / "state"))).start()
    yield server
    server.stop()


def _png(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _wav(seconds: float = 2.5, rate: int = 32000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def _probe(mp4: bytes) -> tuple[int, tuple[int, int], tuple[str, int, int]]:
    with av.open(io.BytesIO(mp4)) as c:
        a = c.streams.audio[0].codec_context
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    return len(frames), frames[0].shape[:2], (a.name, a.sample_rate, a.channels)


BASE = {"prompt": "rain on a tin roof", "seconds": "4", "seed": "3", "num_inference_steps": "2"}


def test_all_three_tasks_over_http(srv, client_for):
    c = client_for(srv)
    card = c.get("/v1/models").json()["data"][0]["omnicore"]
    assert {r["role"] for r in card["inputs"]["roles"]} == {"first_frame", "last_frame", "reference"}

    r = c.post("/v1/videos/sync", json={**BASE, "model_params": {"aspect_ratio": "16:9"}})
    assert r.status_code == 200, r.text
    assert _probe(r.content) == (107, (64, 128), ("aac", 32000, 2))

    r = c.post("/v1/videos/sync", json=BASE)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_params.aspect_ratio"

    files = [("input_reference", ("a.png", _png(96, 64, 1), "image/png")),
             ("last_frame", ("b.png", _png(96, 64, 2), "image/png"))]
    r = c.post("/v1/videos/sync", data=BASE, files=files)
    assert r.status_code == 200, r.text
    assert _probe(r.content) == (107, (64, 96), ("aac", 32000, 2))  # the first keyframe's 3:2 canvas

    files = [("reference_images", ("r.png", _png(320, 256, 3), "image/png")),
             ("reference_audio", ("r.wav", _wav(), "audio/wav"))]
    r = c.post("/v1/videos/sync", data=BASE, files=files)
    assert r.status_code == 200, r.text
    assert _probe(r.content) == (107, (64, 128), ("aac", 32000, 2))  # ref2va: 16:9 by default


def test_a_finished_job_reports_the_length_it_wrote(srv, client_for):
    """4 s of H3 is 107 frames at 24 fps (its 17n+5 frame rule): the finished job says 4.46, not the 4 asked for."""
    import time

    c = client_for(srv)
    job = c.post("/v1/videos", json={**BASE, "model_params": {"aspect_ratio": "1:1"}}).json()
    assert job["seconds"] == "4"  # as created: what was asked
    deadline = time.monotonic() + 120
    while job["status"] in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        job = c.get(f"/v1/videos/{job['id']}").json()
    assert job["status"] == "completed", job
    frames, _, _ = _probe(c.get(f"/v1/videos/{job['id']}/content").content)
    assert (job["num_frames"], job["fps"]) == (frames, 24) == (107, 24)
    assert job["seconds"] == f"{107 / 24:.3g}" == "4.46"
