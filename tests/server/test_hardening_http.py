"""Regression tests (issue 14 §6.3-6.11) through real HTTP: state-dir lock, deep JSON, disconnects, read
timeouts, lenient Range, crash leftovers, out-of-memory, deny-by-default auth, visible draining."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest


def _wait_for(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _completed_video(c: httpx.Client) -> str:
    vid = c.post("/v1/videos", json={"prompt": "x", "num_frames": 3, "num_inference_steps": 1}).json()["id"]
    _wait_for(lambda: c.get(f"/v1/videos/{vid}").json()["status"] == "completed", what="the job")
    return vid


def test_a_second_server_on_the_same_state_dir_is_refused(make_server, client_for, tmp_path):
    from omnicore.server.store import JobStore, StateDirLocked

    state = tmp_path / "shared"
    srv = make_server(state_dir=state)
    c = client_for(srv)
    vid = _completed_video(c)
    with pytest.raises(StateDirLocked, match="in use by another omnicore server"):
        JobStore(state)
    # the first server's jobs were not touched by the refused second one
    assert c.get(f"/v1/videos/{vid}").json()["status"] == "completed"
    srv.stop()
    JobStore(state).close()  # released on shutdown


def test_partial_files_from_a_crash_are_removed_at_startup(make_server, client_for, tmp_path):
    state = tmp_path / "crashed"
    (state / "results").mkdir(parents=True)
    leftovers = [state / "results" / ".video_abc.mp4.1a2b3c.part", state / "results" / ".video_def.mp4.tmp"]
    for p in leftovers:
        p.write_bytes(b"half an mp4")
    keep = state / "results" / "video_done.mp4"
    keep.write_bytes(b"a finished result")
    make_server(state_dir=state)
    assert not any(p.exists() for p in leftovers)
    assert keep.exists()


def test_deeply_nested_json_is_a_400_not_a_500(make_server, client_for):
    c = client_for(make_server())
    deep = '{"prompt": "x", "model_params": {"a": ' + "[" * 3000 + "]" * 3000 + "}}"
    for path in ("/v1/videos", "/v1/videos/sync", "/v1/images/generations"):
        r = c.post(path, content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.status_code, r.text[:200])
        assert r.json()["error"]["type"] == "invalid_request_error"
    moderate = {"prompt": "x", "model_params": {"tag": "t"}, "num_inference_steps": 1, "num_frames": 1}
    assert c.post("/v1/videos/sync", json=moderate).status_code == 200  # the server is fine afterwards


def test_a_client_that_disconnects_cancels_its_synchronous_request(make_server):
    srv = make_server(step_delay_s=0.05)
    engine = srv.ctx.engine
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/images/generations", json={"prompt": "x", "num_inference_steps": 200}, timeout=0.5)
    _wait_for(lambda: engine.stats()["jobs_cancelled"] >= 1, timeout_s=10, what="the job to be cancelled")
    steps = engine.stats()["steps_executed"]
    assert steps < 100, steps  # stopped long before its 200 steps (10 s of work)
    with pytest.raises(httpx.ReadTimeout):  # the same for video/sync
        httpx.post(srv.url + "/v1/videos/sync", json={"prompt": "x", "num_frames": 2, "num_inference_steps": 200},
                   timeout=0.5)
    _wait_for(lambda: engine.stats()["jobs_cancelled"] >= 2, timeout_s=10, what="the sync video to be cancelled")
    # and for a streamed image request whose client leaves after the first event
    with httpx.stream("POST", srv.url + "/v1/images/generations", timeout=10,
                      json={"prompt": "x", "num_inference_steps": 200, "stream": True}) as resp:
        next(resp.iter_lines())
    _wait_for(lambda: engine.stats()["jobs_cancelled"] >= 3, timeout_s=10, what="the streamed job to be cancelled")


def _raw(srv, data: bytes, read_for_s: float) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=read_for_s) as s:
        s.sendall(data)
        chunks = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except TimeoutError:
            chunks.append(b"<still open>")
        return b"".join(chunks)


def test_a_body_shorter_than_its_content_length_times_out_with_408(make_server):
    srv = make_server(read_timeout_s=0.5)
    t0 = time.monotonic()
    reply = _raw(srv, b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\":", read_for_s=5)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"request_timeout" in reply
    assert time.monotonic() - t0 < 4


def test_incomplete_request_headers_are_dropped_after_the_read_timeout(make_server):
    srv = make_server(read_timeout_s=0.5)
    t0 = time.monotonic()
    reply = _raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n", read_for_s=5)  # never sends the blank line
    assert reply == b"", reply[:200]  # closed, not held open
    assert time.monotonic() - t0 < 4
    assert httpx.get(srv.url + "/health").status_code == 200  # normal requests are unaffected


def test_an_invalid_range_is_ignored_and_a_valid_one_honoured(make_server, client_for):
    c = client_for(make_server())
    vid = _completed_video(c)
    full = c.get(f"/v1/videos/{vid}/content")
    assert full.status_code == 200 and len(full.content) > 100
    for bad in ("bytes=100-50", "bytes=abc", "items=0-1", "bytes=", "bytes=1-2,x"):
        r = c.get(f"/v1/videos/{vid}/content", headers={"Range": bad})
        assert r.status_code == 200 and r.content == full.content, (bad, r.status_code, r.text[:100])
    part = c.get(f"/v1/videos/{vid}/content", headers={"Range": "bytes=0-9"})
    assert part.status_code == 206 and part.content == full.content[:10]


def test_out_of_memory_is_reported_as_out_of_memory(make_server, client_for):
    srv = make_server()
    c = client_for(srv)
    model = srv.ctx.engine.pipeline.model

    def oom(_module, _args):  # what the CPU allocator raises when it cannot allocate
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)")

    handle = model.decoder.register_forward_pre_hook(oom)
    try:
        vid = c.post("/v1/videos", json={"prompt": "x", "num_frames": 3, "num_inference_steps": 1}).json()["id"]
        job = _wait_for(lambda: (j := c.get(f"/v1/videos/{vid}").json())["status"] == "failed" and j, what="failure")
        assert job["error"]["code"] == "out_of_memory", job["error"]
        assert "decode" in job["error"]["message"]
        r = c.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 1})
        assert r.status_code == 500 and r.json()["error"]["code"] == "out_of_memory", r.text
    finally:
        handle.remove()


def test_with_a_key_everything_but_health_requires_it(make_server):
    srv = make_server(api_keys=("sekrit",))
    for path in ("/openapi.json", "/docs", "/redoc", "/v1/models", "/v1/videos", "/no/such/route", "/metrics/"):
        r = httpx.get(srv.url + path)
        if path == "/metrics/":
            continue  # (a trailing slash is the same open route)
        assert r.status_code == 401, (path, r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    auth = {"Authorization": "Bearer sekrit"}
    assert httpx.get(srv.url + "/openapi.json", headers=auth).status_code == 200
    for path in ("/health", "/health/live", "/metrics"):
        assert httpx.get(srv.url + path).status_code == 200, path
    protected = make_server(api_keys=("sekrit",), metrics_auth=True, state_dir=srv.ctx.settings.state_dir.parent / "m")
    assert httpx.get(protected.url + "/metrics").status_code == 401
    assert httpx.get(protected.url + "/metrics", headers=auth).status_code == 200
    assert httpx.get(protected.url + "/health").status_code == 200


def test_draining_is_visible_while_running_work_finishes(make_server, client_for):
    srv = make_server(step_delay_s=0.05, shutdown_grace_s=30.0)
    c = client_for(srv)
    vid = c.post("/v1/videos", json={"prompt": "x", "num_frames": 2, "num_inference_steps": 40}).json()["id"]
    _wait_for(lambda: c.get(f"/v1/videos/{vid}").json()["status"] == "in_progress", what="the job to start")
    stopper = threading.Thread(target=srv.stop)  # what SIGTERM does (the signal handler)
    stopper.start()
    _wait_for(lambda: c.get("/health").status_code == 503, what="draining")
    assert c.get("/health").json()["status"] == "draining"
    r = c.post("/v1/videos", json={"prompt": "too late"})  # new work: 503 on a listener that is still up
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining" and r.headers["retry-after"]
    assert c.get(f"/v1/videos/{vid}").status_code == 200  # reads keep working during the grace
    assert c.get("/v1/videos").status_code == 200
    stopper.join(30)
    assert not stopper.is_alive()
    record = srv.ctx.store  # closed now; the job finished within the grace instead of being interrupted
    from omnicore.server.store import JobStore

    store = JobStore(record.root)
    try:
        assert store.get(vid)["status"] == "completed"
    finally:
        store.close()
