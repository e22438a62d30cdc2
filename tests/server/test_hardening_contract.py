"""Regression tests (issue 14 §6.12-6.13): contract mismatches through real HTTP, and the CLI's one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time



def test_image_route_wants_json_and_names_an_empty_body(make_server, client_for):
    c = client_for(make_server())
    r = c.post("/v1/images/generations", content=b"prompt=x", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", r.text
    r = c.post("/v1/images/generations", data={"prompt": "x"})  # a form body
    assert r.status_code == 415, r.text
    for path in ("/v1/images/generations", "/v1/videos"):
        r = c.post(path, content=b"", headers={"Content-Type": "application/json"})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "missing_required_parameter", r.text
        assert "None" not in err["message"] and "empty" in err["message"] and err["param"] == "prompt"


def test_seconds_must_be_a_whole_number_reported_on_seconds(make_server, client_for):
    c = client_for(make_server())
    for bad in (True, 1.5, "1.5", "x", [1]):
        r = c.post("/v1/videos", json={"prompt": "x", "seconds": bad})
        assert r.status_code == 400, (bad, r.text)
        err = r.json()["error"]
        assert err["param"] == "seconds" and err["code"] == "invalid_value", (bad, err)
    assert c.get("/v1/videos").json()["data"] == []
    ok = c.post("/v1/videos", json={"prompt": "x", "seconds": "1", "num_inference_steps": 1})
    assert ok.status_code == 200 and ok.json()["seconds"] == "1", ok.text


def test_images_and_videos_report_the_same_timing_keys(make_server, client_for):
    c = client_for(make_server())
    img = c.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 1}).json()
    vid = c.post("/v1/videos", json={"prompt": "x", "num_frames": 2, "num_inference_steps": 1}).json()["id"]
    deadline = time.monotonic() + 30
    while (job := c.get(f"/v1/videos/{vid}").json())["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    keys = {"queued_s", "preprocess_s", "encode_s", "denoise_s", "decode_s", "encode_output_s", "finalize_s",
            "total_s"}
    assert set(img["timings"]) == keys == set(job["timings"]), (img["timings"], job["timings"])


def test_an_operator_deadline_is_not_blamed_on_the_client(make_server, client_for):
    srv = make_server(step_delay_s=0.05, max_job_seconds=0.3)
    c = client_for(srv)
    r = c.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 100})
    assert r.status_code == 504 and r.json()["error"]["type"] == "server_error", r.text
    assert "--max-job-seconds" in r.json()["error"]["message"]
    r = c.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 100, "timeout_s": 0.2})
    assert r.status_code == 409 and r.json()["error"]["code"] == "timeout", r.text  # the client's own deadline
    vid = c.post("/v1/videos", json={"prompt": "x", "num_frames": 2, "num_inference_steps": 100}).json()["id"]
    deadline = time.monotonic() + 30
    while (job := c.get(f"/v1/videos/{vid}").json())["status"] not in ("failed", "completed", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert job["status"] == "failed" and job["error"]["code"] == "server_timeout", job["error"]


def test_model_card_and_openapi_match_the_contract(make_server, client_for):
    c = client_for(make_server())
    card = c.get("/v1/models/toy").json()
    assert card["omnicore"]["sizes"]["multiple_of"] == 8  # the toy's declared size_multiple_of
    spec = c.get("/openapi.json").json()
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    assert "202" in spec["paths"]["/v1/videos/{video_id}/cancel"]["post"]["responses"]
    assert "202" in spec["paths"]["/v1/videos/{video_id}"]["delete"]["responses"]
    assert "409" in spec["paths"]["/v1/videos/{video_id}/content"]["get"]["responses"]
    assert "409" in spec["paths"]["/v1/images/generations"]["post"]["responses"]
    body = spec["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]
    assert "prompt" in body["application/json"]["schema"]["properties"]
    r = c.put("/v1/videos/video_x")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert {m.strip() for m in r.headers["allow"].split(",")} == {"GET", "DELETE"}


def test_health_polls_are_not_access_logged(caplog):
    import logging

    from omnicore.server.http_edge import HealthLogFilter

    f = HealthLogFilter()

    def record(path: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:5", "GET", path, "1.1", 200), None)

    assert not f.filter(record("/health")) and not f.filter(record("/health/live"))
    assert f.filter(record("/v1/videos")) and f.filter(record("/metrics"))


def _omnicore(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "omnicore.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=env, **kw)


def test_cli_errors_are_one_line_not_tracebacks(tmp_path):
    r = _omnicore("serve", "tiny:lingbot", "--port", "99999")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--port" in r.stderr.splitlines()[-1] and "65535" in r.stderr.splitlines()[-1]
    # a reader that stops early (`omnicore plugins --json | head -1`) is not an error
    proc = subprocess.Popen([sys.executable, "-m", "omnicore.cli.main", "plugins", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert proc.returncode == 0


def test_cli_serve_refuses_a_state_dir_in_use(tmp_path):
    from omnicore.server.store import JobStore

    state = tmp_path / "state"
    holder = JobStore(state)  # the "other server"
    try:
        t0 = time.monotonic()
        r = _omnicore("serve", "tiny:lingbot", "--storage-dir", str(state), "--port", "0")
        assert r.returncode == 2, r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("error:") and "in use by another omnicore server" in last, r.stderr
        assert "Traceback" not in r.stderr
        assert time.monotonic() - t0 < 60
    finally:
        holder.close()
