"""Regression tests (issue 14 §6.1-6.2): limits hold on the resolved request, a work budget, cancellable decode.

Everything goes through real HTTP against a real uvicorn (see ``conftest.make_server``).
"""

from __future__ import annotations

import time


def _wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_pixel_limit_holds_however_the_size_is_given(make_server, client_for):
    srv = make_server(max_image_pixels=64 * 64)
    c = client_for(srv)
    cases = [
        ("/v1/images/generations", {"prompt": "x", "size": "128x128"}),
        ("/v1/images/generations", {"prompt": "x", "num_inference_steps": 1, "model_params": {"size": "8192x8192"}}),
        ("/v1/images/generations", {"prompt": "x", "num_inference_steps": 1, "extra_params": {"size": "128x64"}}),
        ("/v1/videos", {"prompt": "x", "model_params": {"size": "128x128"}}),
        ("/v1/videos/sync", {"prompt": "x", "model_params": {"size": "16384x16384"}}),
    ]
    for path, body in cases:
        r = c.post(path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["code"] == "image_too_large", err
        assert "--max-image-pixels" in err["message"] and str(64 * 64) in err["message"], err
    # a rejected video job was never persisted
    assert c.get("/v1/videos").json()["data"] == []
    # within the limit, the model-specific size is honoured (and reported)
    r = c.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 1,
                                               "model_params": {"size": "64x48"}})
    assert r.status_code == 200, r.text
    assert r.json()["size"] == "64x48"


def test_the_model_default_size_is_checked_too(make_server, client_for):
    srv = make_server(max_image_pixels=16 * 16)  # the toy's default is 32x32
    r = client_for(srv).post("/v1/images/generations", json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_too_large", r.text
    assert "32x32" in r.json()["error"]["message"]


def test_model_limits_and_the_server_work_budget_reject_at_submission(make_server, client_for):
    srv = make_server(max_work=32 * 32 * 9 * 4)
    c = client_for(srv)
    t0 = time.monotonic()
    r = c.post("/v1/videos", json={"prompt": "x", "seconds": 3600})  # 28,800 frames at the toy's 8 fps
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "limit_exceeded" and err["param"] == "num_frames", err
    assert "max_frames of model toy" in err["message"] and "64" in err["message"], err
    r = c.post("/v1/videos", json={"prompt": "x", "num_frames": 33, "num_inference_steps": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "limit_exceeded" and "--max-work" in err["message"], err
    r = c.post("/v1/videos/sync", json={"prompt": "x", "num_frames": 33, "num_inference_steps": 4})
    assert r.status_code == 400 and "--max-work" in r.json()["error"]["message"], r.text
    r = c.post("/v1/images/generations", json={"prompt": "x", "n": 4, "size": "64x64", "num_inference_steps": 4})
    assert r.status_code == 400 and "--max-work" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 10  # rejected up front, not after running
    assert c.get("/v1/videos").json()["data"] == []
    # inside the budget it runs
    r = c.post("/v1/videos/sync", json={"prompt": "x", "num_frames": 9, "num_inference_steps": 4})
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text


def test_delete_stops_a_long_decode_within_seconds(make_server, client_for):
    srv = make_server(cancel_wait_s=10.0, shutdown_grace_s=0.0)
    decoder = srv.ctx.engine.pipeline.model.decoder
    decoded: list[float] = []

    def slow_frame(_module, _args):  # a slow VAE: 0.3 s per latent frame, 33 frames ~ 10 s
        decoded.append(time.monotonic())
        time.sleep(0.3)

    handle = decoder.register_forward_pre_hook(slow_frame)
    try:
        c = client_for(srv)
        job = c.post("/v1/videos", json={"prompt": "x", "num_frames": 33, "num_inference_steps": 1}).json()
        _wait_for(lambda: c.get(f"/v1/videos/{job['id']}").json()["phase"] == "decode" and decoded,
                  what="the decode phase")
        t0 = time.monotonic()
        r = c.delete(f"/v1/videos/{job['id']}")
        stopped_in = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["deleted"] is True, r.text
        assert stopped_in < 3.0, stopped_in
        assert len(decoded) < 20, f"decode ran on for {len(decoded)} frames after DELETE"
        assert c.get(f"/v1/videos/{job['id']}").status_code == 404
    finally:
        handle.remove()
