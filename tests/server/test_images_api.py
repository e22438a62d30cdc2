"""Image routes, errors, auth, limits, readiness and metrics against a real uvicorn + toy engine."""

from __future__ import annotations

import base64
import io
import threading
import time

import httpx
import numpy as np
import pytest
from omnicore.engine.request import GenerationRequest, SamplingParams
from PIL import Image


def _png(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def _direct(engine, prompt: str, w: int, h: int, seed: int, n: int = 1) -> list[np.ndarray]:
    req = GenerationRequest(prompt=prompt, params=SamplingParams(width=w, height=h, num_frames=1, seed=seed,
                                                                 num_outputs=n, output_type="image"))
    return [o.frames[0] for o in engine.submit(req).result(60)]


def test_openai_sdk_images_generate_matches_direct_engine_call(make_server):
    openai = pytest.importorskip("openai")
    srv = make_server()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    resp = client.images.generate(model="toy", prompt="a red fox", n=2, size="64x32",
                                  extra_body={"seed": 1234})
    assert len(resp.data) == 2
    got = [_png(d.b64_json) for d in resp.data]
    want = _direct(srv.ctx.engine, "a red fox", 64, 32, 1234, n=2)
    for g, w in zip(got, want):
        assert g.shape == (32, 64, 3)
        np.testing.assert_array_equal(g, w)  # PNG is lossless: byte-identical pixels
    assert not np.array_equal(got[0], got[1])  # output i uses seed + i
    raw = httpx.post(srv.url + "/v1/images/generations", json={"prompt": "a red fox", "seed": 7}).json()
    assert raw["data"][0]["seed"] == 7 and raw["size"] == "32x32" and raw["id"].startswith("img_")


def test_validation_errors_are_400_in_openai_shape(make_server, client_for):
    srv = make_server()
    c = client_for(srv)
    engine = srv.ctx.engine
    calls_before = dict(engine.pipeline.preprocess_calls)
    cases = [
        ({"prompt": "x", "bogus": 1}, "bogus", "unknown_parameter"),
        ({"n": 1}, "prompt", "missing_required_parameter"),
        ({"prompt": "x", "n": "many"}, "n", "invalid_value"),
        ({"prompt": "x", "n": 5}, "n", "invalid_value"),  # the toy makes at most 4 per request
        ({"prompt": "x", "size": "big"}, "size", "invalid_value"),
        ({"prompt": "x", "response_format": "url"}, "response_format", "unsupported_parameter"),
        ({"prompt": "x", "quality": "hd"}, "quality", "unsupported_parameter"),
        ({"prompt": "x", "output_compression": 50}, "output_compression", "invalid_value"),
        ({"prompt": "x", "model_params": {}, "extra_params": {}}, "extra_params", "invalid_value"),
        ({"prompt": "x", "lora": [{"name": "nope"}]}, "lora", "invalid_lora"),  # the toy takes no adapters
        ({"prompt": "x", "lora": [{"name": "a", "scale": "big"}]}, "lora.0.scale", "invalid_value"),
        ({"prompt": "x", "guidance_scale": -1}, "guidance_scale", "invalid_value"),
    ]
    for body, param, code in cases:
        r = c.post("/v1/images/generations", json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), body
        assert err["message"]
    # none of these reached the model: rejected before dispatch
    assert engine.pipeline.preprocess_calls == calls_before
    # pixel and work limits hold on the *resolved* request, so they are checked after the model's preprocess
    # (which resolves sizes), still before any work is queued (test_hardening_limits.py covers them)
    r = c.post("/v1/images/generations", json={"prompt": "x", "size": "8192x8192"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_too_large", r.text
    assert engine.stats()["steps_executed"] == 0
    # the model's own validation (preprocess) maps its field to the HTTP name
    r = c.post("/v1/images/generations", json={"prompt": "x", "size": "36x36"})  # toy needs multiples of 8
    assert r.status_code == 400 and r.json()["error"]["param"] == "size"
    r = c.post("/v1/images/generations", json={"prompt": "x", "model_params": {"nope": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_params.nope"
    r = c.post("/v1/images/generations", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"
    r = c.post("/v1/images/generations", json={"prompt": "x", "model": "other-model"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = c.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "route_not_found"
    r = c.put("/v1/images/generations")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["x-request-id"]
    r = c.get("/v1/models", headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"


def test_edits_route_is_task_gated_for_a_model_without_image_editing(make_server, client_for):
    srv = make_server()
    c = client_for(srv)
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (1, 2, 3)).save(buf, "PNG")
    r = c.post("/v1/images/edits", data={"prompt": "x"}, files={"image": ("a.png", buf.getvalue(), "image/png")})
    assert r.status_code == 404 and r.json()["error"]["code"] == "task_not_supported"


def test_auth_and_open_health(make_server, client_for):
    srv = make_server(api_keys=("sekret",))
    c = client_for(srv)
    r = c.get("/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "authentication_error",
                                 "param": None, "code": "invalid_api_key"}
    assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = c.get("/v1/models", headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "toy"
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_upload_and_body_caps_are_413(make_server, client_for):
    srv = make_server(max_upload_bytes=1000, max_request_bytes=50_000)
    c = client_for(srv)
    big = b"\x89PNG\r\n\x1a\n" + b"0" * 4000
    r = c.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("a.png", big, "image/png")})
    assert r.status_code == 413 and r.json()["error"]["code"] == "upload_too_large"
    r = c.post("/v1/images/generations", json={"prompt": "x" * 60_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the cap is enforced while streaming the body
        for _ in range(20):
            yield b" " * 5000

    r = c.post("/v1/images/generations", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_queue_full_is_429_with_retry_after(make_server, client_for):
    srv = make_server(max_queued_jobs=1, step_delay_s=0.2)
    c = client_for(srv)
    job = c.post("/v1/videos", json={"prompt": "slow", "num_inference_steps": 20}).json()
    r = c.post("/v1/images/generations", json={"prompt": "x"})
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_error"
    assert int(r.headers["retry-after"]) >= 1
    assert c.delete(f"/v1/videos/{job['id']}").json()["deleted"] is True
    assert c.post("/v1/images/generations", json={"prompt": "x"}).status_code == 200


def test_not_ready_is_503_until_the_model_loaded(toy_cache, tmp_path, client_for):
    from _server_helpers import LiveServer
    from omnicore.server import ServerSettings, create_app
    from toy import toy_engine

    gate = threading.Event()

    def loader():
        gate.wait(30)
        return toy_engine(toy_cache)

    srv = LiveServer(create_app(settings=ServerSettings(state_dir=tmp_path / "s"), loader=loader)).start()
    try:
        c = client_for(srv)
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "loading" and h.headers["retry-after"]
        assert c.get("/health/live").json() == {"status": "live"}
        r = c.post("/v1/images/generations", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        assert r.json()["error"]["type"] == "service_unavailable_error"
        gate.set()
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.post("/v1/images/generations", json={"prompt": "x"}).status_code == 200
    finally:
        srv.stop()


def test_metrics_expose_contract_series(make_server, client_for):
    srv = make_server()
    c = client_for(srv)
    assert c.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 3}).status_code == 200
    text = c.get("/metrics").text
    for name in ("omnicore_http_requests_total", "omnicore_http_request_duration_seconds_bucket",
                 "omnicore_queue_depth", "omnicore_jobs_running", "omnicore_jobs_total",
                 "omnicore_denoise_steps_total", "omnicore_ready"):
        assert name in text, name
    assert 'omnicore_jobs_total{status="completed",task="image.generate"} 1.0' in text
    assert 'omnicore_denoise_steps_total{result="computed"} 3.0' in text
    assert 'route="/v1/images/generations"' in text
