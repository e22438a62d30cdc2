"""Strict types at the HTTP edge, the seed range, and what a client is told when a plugin fails (issue 28 §10, §19).

Real uvicorn on loopback around the toy engine (``make_server``); the ``num_frames`` case uses tiny:lingbot,
whose ``preprocess`` rounds the frame count up onto its 4k+1 grid.
"""

from __future__ import annotations

import pytest
from omnicore.engine.request import MAX_SEED


@pytest.mark.parametrize("route,body,param", [
    ("/v1/images/generations", {"prompt": "x", "num_inference_steps": True}, "num_inference_steps"),
    ("/v1/images/generations", {"prompt": "x", "seed": True}, "seed"),
    ("/v1/images/generations", {"prompt": "x", "guidance_scale": False}, "guidance_scale"),
    ("/v1/images/generations", {"prompt": "x", "n": True}, "n"),
    ("/v1/images/generations", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/images/generations", {"prompt": "x", "stream": 1}, "stream"),
    ("/v1/videos", {"prompt": "x", "num_frames": True}, "num_frames"),
    ("/v1/videos", {"prompt": "x", "fps": True}, "fps"),
    ("/v1/videos", {"prompt": "x", "generate_audio": "on"}, "generate_audio"),
])
def test_booleans_are_not_numbers_and_stream_is_a_boolean(make_server, client_for, route, body, param):
    c = client_for(make_server())
    r = c.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_value", err
    assert param in err["message"] and "boolean" in err["message"], err


def test_form_fields_still_parse_numbers_and_booleans_from_text(make_server, client_for):
    """Multipart fields are text: ``-F num_frames=4 -F generate_audio=false`` keep working."""
    c = client_for(make_server())
    r = c.post("/v1/videos", data={"prompt": "x", "num_frames": "4", "num_inference_steps": "2", "seed": "3"})
    assert r.status_code == 200, r.text
    assert r.json()["seed"] == 3 and r.json()["num_frames"] == 4
    r = c.post("/v1/images/generations", json={"prompt": "x", "stream": "false", "num_inference_steps": 1})
    assert r.status_code == 200, r.text


def test_server_drawn_seeds_use_the_whole_seed_range(make_server, client_for):
    """A request without a seed gets one from the engine's range [0, MAX_SEED] (the server drew 31 bits before):
    8 draws all below 2**31 out of 2**63 would happen with probability 2**-256."""
    c = client_for(make_server())
    seeds = []
    for _ in range(8):
        r = c.post("/v1/images/generations", json={"prompt": "seed", "num_inference_steps": 1, "size": "16x16"})
        assert r.status_code == 200, r.text
        seeds.append(r.json()["data"][0]["seed"])
    assert all(0 <= s <= MAX_SEED for s in seeds)
    assert max(seeds) >= 2**31, seeds


def test_a_plugin_failing_in_preprocess_says_why_and_gives_the_request_id(make_server, client_for):
    c = client_for(make_server())
    r = c.post("/v1/images/generations", json={"prompt": "x", "model_params": {"fail_at": "preprocess"}},
               headers={"X-Request-Id": "req-preprocess-1"})
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "ToyFailure" in message and "asked to fail at preprocess" in message, message
    assert "request id req-preprocess-1" in message, message
    r = c.post("/v1/videos", json={"prompt": "x", "model_params": {"fail_at": "preprocess"}})
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "asked to fail at preprocess" in message and f"request id {r.headers['x-request-id']}" in message, message


@pytest.mark.slow
def test_num_frames_out_of_range_reports_the_value_sent(tmp_path):
    """LingBot rounds 100000 frames up to 100001 (4k+1): the 400 names the 100000 the client sent."""
    pytest.importorskip("omni_lingbot")
    import httpx
    from _server_helpers import LiveServer
    from omnicore.config import Settings
    from omnicore.engine.api import Engine
    from omnicore.plugin_host.host import PluginHost
    from omnicore.server import ServerSettings, create_app

    settings = Settings(cache_dir=str(tmp_path / "cache"), plugins=("lingbot",))
    engine = Engine("tiny:lingbot", host=PluginHost(settings), settings=settings)
    srv = LiveServer(create_app(engine, ServerSettings(state_dir=tmp_path / "state"), model_arg="tiny:lingbot"))
    srv.start()
    try:
        r = httpx.post(srv.url + "/v1/videos", json={"prompt": "x", "num_frames": 100000}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "num_frames" and "requested 100000" in err["message"], err
    finally:
        srv.stop()
