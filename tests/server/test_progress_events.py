"""Job progress over real HTTP: the create answer, phases, weighted progress, SSE reconnects and image streams."""

from __future__ import annotations

import base64
import time

from _server_helpers import read_events

_TERMINAL = ("video.completed", "video.failed", "video.cancelled")


def _denoise_progress(step: int, total: int) -> int:
    # Default weights: preparing 1 + preprocess 4 + encode 5 come before denoise (80) of 100.
    return int(1 + 4 + 5 + 80 * step / total)


def test_create_answers_queued_and_events_carry_phase_progress(make_server, client_for):
    srv = make_server(step_delay_s=0.03)
    c = client_for(srv)
    job = c.post("/v1/videos", json={"prompt": "progress", "num_frames": 2, "num_inference_steps": 8}).json()
    # creating a job does not start it; the answer is the job as created
    assert (job["status"], job["phase"], job["progress"], job["step"]) == ("queued", "queued", 0, None)
    assert job["queue_position"] == 0 and job["total_steps"] == 8
    with c.stream("GET", f"/v1/videos/{job['id']}/events") as resp:
        events = read_events(resp, lambda e: e["event"] in _TERMINAL)
    assert events[-1]["event"] == "video.completed" and events[-1]["data"]["progress"] == 100
    progress = [e["data"] for e in events if e["event"] == "video.progress"]
    phases = [p["phase"] for p in progress]
    assert {"denoise", "decode", "encode_output", "finalize"} <= set(phases)
    assert set(phases) <= {"queued", "preparing", "preprocess", "encode", "denoise", "decode", "encode_output",
                           "finalize"}
    values = [p["progress"] for p in progress]
    assert values == sorted(values) and max(values) <= 99  # never decreases; 100 only when completed
    steps = [p for p in progress if p["phase"] == "denoise"]
    assert [p["step"] for p in steps][-1] == 8
    for p in steps:
        assert p["phase_progress"] == p["step"] / 8
        assert p["progress"] == _denoise_progress(p["step"], 8)
    for p in progress:
        if p["phase"] in ("decode", "encode_output", "finalize"):
            assert p["phase_progress"] == 0.0 and p["progress"] >= 90
    ids = [e["id"] for e in events]
    assert ids == sorted(set(ids))
    final = c.get(f"/v1/videos/{job['id']}").json()
    assert final["status"] == "completed" and final["phase"] is None and final["phase_progress"] is None
    assert set(final["timings"]) == {"queued_s", "preprocess_s", "encode_s", "denoise_s", "decode_s",
                                     "encode_output_s", "finalize_s", "total_s"}
    assert final["timings"]["denoise_s"] >= 8 * 0.03 * 0.9  # the slowed steps are where the time went


def _wait_for_step(c, vid: str, step: int, timeout_s: float = 30.0) -> None:
    """Wait (on the job's own progress, not a guessed sleep) until it has done at least ``step`` steps."""
    deadline = time.monotonic() + timeout_s
    while (c.get(f"/v1/videos/{vid}").json().get("step") or 0) < step:
        assert time.monotonic() < deadline, f"job {vid} did not reach step {step}"
        time.sleep(0.01)


def test_sse_reconnect_with_last_event_id_gets_the_missed_events_or_a_snapshot(make_server, client_for):
    srv = make_server(step_delay_s=0.05)
    c = client_for(srv)
    vid = c.post("/v1/videos", json={"prompt": "reconnect", "num_frames": 2, "num_inference_steps": 30}).json()["id"]
    with c.stream("GET", f"/v1/videos/{vid}/events") as resp:
        first = read_events(resp, lambda e: e["data"].get("step") and e["data"]["step"] >= 3)
    last = first[-1]
    _wait_for_step(c, vid, last["data"]["step"] + 3)  # several steps happen while the client is away
    with c.stream("GET", f"/v1/videos/{vid}/events", headers={"Last-Event-ID": str(last["id"])}) as resp:
        again = read_events(resp, lambda e: e["event"] in _TERMINAL)
    assert again[0]["id"] == last["id"] + 1  # the missed events, from the one right after the last seen
    ids = [e["id"] for e in again]
    assert ids == list(range(last["id"] + 1, last["id"] + 1 + len(ids)))  # none missing, none repeated
    steps = [e["data"]["step"] for e in again if e["event"] == "video.progress" and e["data"]["phase"] == "denoise"]
    assert steps == list(range(last["data"]["step"] + 1, 31))  # every step after the last one seen, once
    assert again[-1]["event"] == "video.completed"

    # the buffer is bounded: a client too far behind gets a snapshot of the current state instead
    srv.ctx.hub.buffer_size = 3
    vid2 = c.post("/v1/videos", json={"prompt": "far behind", "num_frames": 2, "num_inference_steps": 40}).json()["id"]
    with c.stream("GET", f"/v1/videos/{vid2}/events") as resp:
        first = read_events(resp, lambda e: e["data"].get("step") and e["data"]["step"] >= 2)
    _wait_for_step(c, vid2, first[-1]["data"]["step"] + 5)  # more events than the buffer of 3 holds
    with c.stream("GET", f"/v1/videos/{vid2}/events", headers={"Last-Event-ID": str(first[-1]["id"])}) as resp:
        snap = read_events(resp, lambda e: True)[0]
    assert snap["event"] == "video.progress" and snap["id"] > first[-1]["id"] + 1
    assert snap["data"]["step"] >= first[-1]["data"]["step"] + 3
    # ids stay above what a client saw even when the server no longer knows them (e.g. after a restart)
    with c.stream("GET", f"/v1/videos/{vid2}/events", headers={"Last-Event-ID": "100000"}) as resp:
        assert read_events(resp, lambda e: True)[0]["id"] == 100001
    c.delete(f"/v1/videos/{vid2}")


def test_image_stream_sends_progress_then_the_same_image_as_the_plain_request(make_server, client_for):
    srv = make_server()
    c = client_for(srv)
    body = {"prompt": "streamed", "size": "32x32", "num_inference_steps": 4, "seed": 21}
    plain = c.post("/v1/images/generations", json=body).json()
    with c.stream("POST", "/v1/images/generations", json={**body, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = read_events(resp)
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "image_generation.completed" and kinds.count("image_generation.completed") == 1
    steps = [e["data"] for e in events if e["event"] == "image_generation.progress" and e["data"]["phase"] == "denoise"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["progress"] for s in steps] == [_denoise_progress(k, 4) for k in (1, 2, 3, 4)]
    done = events[-1]["data"]
    assert done["seed"] == 21 and done["size"] == "32x32" and done["index"] == 0
    assert base64.b64decode(done["b64_json"]) == base64.b64decode(plain["data"][0]["b64_json"])
