"""The refiner's size and steps are bounded by the work budget (issue 28 item 10), over real HTTP (uvicorn on
loopback) with ``tiny:lingbot-moe``: the pipeline declares the refiner as a stage of the job, the engine holds it to
the pixel limits and counts its work into ``--max-work``, and a request over either is a 400 naming the refiner
field — before any work starts."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "server"))  # _server_helpers

MAX_WORK = 100_000
SMALL = {"run_refiner": True, "refiner_height": 64, "refiner_width": 96}


@pytest.fixture(scope="module")
def server(tiny_moe_dir, tmp_path_factory):
    from _server_helpers import LiveServer
    from omnicore.config import Settings
    from omnicore.engine.api import Engine
    from omnicore.plugin_host.host import PluginHost
    from omnicore.server import ServerSettings, create_app

    root = tmp_path_factory.mktemp("lingbot-refiner-http")
    settings = Settings(cache_dir=str(root / "cache"))
    engine = Engine(tiny_moe_dir, host=PluginHost(settings), settings=settings)
    srv = LiveServer(create_app(engine, ServerSettings(state_dir=root / "state", max_work=MAX_WORK),
                                model_arg=str(tiny_moe_dir))).start()
    yield srv
    srv.stop()


def _image(server, **model_params):
    body = {"prompt": "a red fox", "size": "32x32", "num_inference_steps": 2, "seed": 1,
            "model_params": model_params}
    return httpx.post(server.url + "/v1/images/generations", json=body, timeout=120)


def _error(resp):
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


@pytest.mark.slow  # ~11 s on 2 CPU cores: the base image, then the refiner encode, DiT and decode
def test_a_refiner_within_the_budget_runs(server):
    resp = _image(server, **SMALL, refiner_steps=1)  # 2,048 base + 64x96 x 1 frame x 3 evaluations = 20,480
    assert resp.status_code == 200, resp.text
    assert resp.json()["size"] == "96x64"  # the refined image


def test_refiner_steps_beyond_the_budget_are_refused_naming_the_field(server):
    err = _error(_image(server, **SMALL, refiner_steps=1000))
    assert err["code"] == "limit_exceeded" and err["param"] == "model_params.refiner_steps", err
    assert "refiner stage" in err["message"] and "--max-work" in err["message"]


def test_a_refiner_size_beyond_the_budget_is_refused_naming_the_field(server):
    err = _error(_image(server, run_refiner=True, refiner_height=1088, refiner_width=1920))  # default 8 steps
    assert err["code"] == "limit_exceeded" and err["param"] == "model_params.refiner_height", err
    err = _error(_image(server, run_refiner=True))  # the defaults alone (1920x1088 x 8) are over this budget
    assert err["code"] == "limit_exceeded" and err["param"] == "model_params.run_refiner", err


def test_a_refiner_size_beyond_the_pixel_limit_is_refused(server):
    err = _error(_image(server, run_refiner=True, refiner_height=4096, refiner_width=4096, refiner_steps=1))
    assert err["code"] == "image_too_large" and err["param"] == "model_params.refiner_height", err


def test_refiner_steps_have_a_hard_cap(server):
    err = _error(_image(server, **SMALL, refiner_steps=10**9))
    assert err["param"] == "model_params.refiner_steps" and "at most 1000" in err["message"], err
    err = _error(_image(server, **SMALL, refiner_sigma_tail_steps=10**9))
    assert err["param"] == "model_params.refiner_sigma_tail_steps" and "at most 1000" in err["message"], err


def test_a_refined_video_counts_its_clip_frames(server):
    body = {"prompt": "a red fox", "size": "32x32", "num_frames": 9, "num_inference_steps": 2, "seed": 1,
            "model_params": SMALL}  # 18,432 base + 64x96 x 9 frames x 8 steps = 442,368
    err = _error(httpx.post(server.url + "/v1/videos", json=body, timeout=60))
    assert err["code"] == "limit_exceeded" and err["param"] == "model_params.refiner_height", err
    assert "x 9 frames x 8 steps" in err["message"]
