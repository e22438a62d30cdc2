"""Video jobs over real HTTP: OpenAI SDK round trip, SSE, cancellation, deletion, restart and idempotency."""

from __future__ import annotations

import io
import json
import time
import warnings

import av
import httpx
import numpy as np
import pytest
from omnicore.engine.request import GenerationRequest, SamplingParams
from PIL import Image


def _wait_status(c: httpx.Client, vid: str, statuses: tuple[str, ...], timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = c.get(f"/v1/videos/{vid}").json()
        if job["status"] in statuses:
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.02)


def _frames(mp4: bytes) -> np.ndarray:
    with av.open(io.BytesIO(mp4)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_openai_sdk_videos_create_retrieve_download(make_server):
    openai = pytest.importorskip("openai")
    srv = make_server()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the SDK marks the Sora API deprecated
        video = client.videos.create(prompt="a dog on a beach", seconds="1", size="32x32",
                                     extra_body={"seed": 99, "num_inference_steps": 3, "fps": 8})
        assert video.status == "queued" and video.id.startswith("video_")  # created, not yet started
        for _ in range(600):
            video = client.videos.retrieve(video.id)
            if video.status in ("completed", "failed"):
                break
            time.sleep(0.05)
        assert video.status == "completed" and video.progress == 100
        content = client.videos.download_content(video.id)
    data = content.read()
    frames = _frames(data)
    # the effective values are echoed: 1 s at 8 fps = 8 frames, as the job record says
    job = httpx.get(f"{srv.url}/v1/videos/{video.id}").json()
    assert job["num_frames"] == frames.shape[0] == 8 and job["seconds"] == "1" and job["seed"] == 99
    assert frames.shape[1:3] == (32, 32)
    # independent reference: the same request straight through the engine, encoded by the same writer
    req = GenerationRequest(prompt="a dog on a beach", params=SamplingParams(
        width=32, height=32, num_frames=8, duration=1.0, fps=8.0, seed=99, num_inference_steps=3,
        output_type="video"))
    direct = srv.ctx.engine.submit(req).result(60)[0]
    assert direct.num_frames == 8
    np.testing.assert_array_equal(frames, _frames(direct.to_bytes("mp4")))
    assert job["timings"]["total_s"] > 0 and job["usage"]["denoise_steps_computed"] == 3


def test_json_create_list_pagination_and_sse(make_server, client_for):
    srv = make_server()
    c = client_for(srv)
    ids = []
    for i in range(3):
        r = c.post("/v1/videos", json={"prompt": f"clip {i}", "num_frames": 2, "num_inference_steps": 2})
        assert r.status_code == 200 and r.headers["location"] == f"/v1/videos/{r.json()['id']}"
        ids.append(r.json()["id"])
    # SSE on the last one: a snapshot first, then progress/terminal events with increasing ids
    with c.stream("GET", f"/v1/videos/{ids[-1]}/events") as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = []
        cur: dict = {}
        for line in resp.iter_lines():
            if not line:
                events.append(cur)
                cur = {}
                if events[-1]["event"].startswith("video.") and events[-1]["event"] != "video.progress" \
                        and events[-1]["event"] != "video.heartbeat":
                    break
                continue
            key, _, value = line.partition(": ")
            cur[key] = value
    assert events[-1]["event"] == "video.completed"
    assert json.loads(events[-1]["data"])["status"] == "completed"
    ev_ids = [int(e["id"]) for e in events]
    assert ev_ids == sorted(ev_ids) and len(set(ev_ids)) == len(ev_ids)
    for vid in ids:
        _wait_status(c, vid, ("completed",))
    page1 = c.get("/v1/videos", params={"limit": 2}).json()
    assert [j["id"] for j in page1["data"]] == ids[::-1][:2] and page1["has_more"] is True
    page2 = c.get("/v1/videos", params={"limit": 2, "after": page1["last_id"]}).json()
    assert [j["id"] for j in page2["data"]] == [ids[0]] and page2["has_more"] is False
    asc = c.get("/v1/videos", params={"order": "asc", "status": "completed"}).json()
    assert [j["id"] for j in asc["data"]] == ids
    r = c.get("/v1/videos", params={"limit": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    r = c.get(f"/v1/videos/{ids[0]}/content", params={"variant": "thumbnail"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
    r = c.get(f"/v1/videos/{ids[0]}/content", headers={"Range": "bytes=0-9"})
    assert r.status_code == 206 and len(r.content) == 10
    assert c.get("/v1/videos/video_doesnotexist").json()["error"]["code"] == "job_not_found"


def test_delete_during_denoise_stops_within_one_step(make_server, client_for):
    srv = make_server(step_delay_s=0.1)
    c = client_for(srv)
    engine = srv.ctx.engine
    steps_before = engine.stats()["steps_executed"]
    vid = c.post("/v1/videos", json={"prompt": "long", "num_inference_steps": 200, "num_frames": 2}).json()["id"]
    job = _wait_status(c, vid, ("in_progress",))
    deadline = time.monotonic() + 30
    while (c.get(f"/v1/videos/{vid}").json().get("step") or 0) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    at_delete = engine.stats()["steps_executed"]
    r = c.delete(f"/v1/videos/{vid}")
    assert r.status_code == 200 and r.json() == {"id": vid, "object": "video.deleted", "deleted": True}
    after = engine.stats()["steps_executed"]
    assert after - at_delete <= 1, (at_delete, after)  # at most the step that was running
    # nothing more ran: the worker runs one batch at a time, so once a later 1-step request has finished, the
    # deleted job's batch is over; exactly that one step was added (an event, not a guessed sleep)
    assert c.post("/v1/images/generations", json={"prompt": "after", "num_inference_steps": 1}).status_code == 200
    assert engine.stats()["steps_executed"] == after + 1
    assert after - steps_before < 200
    assert engine.stats()["jobs_cancelled"] >= 1
    assert c.get(f"/v1/videos/{vid}").status_code == 404
    assert job["status"] == "in_progress"


def test_cancel_keeps_the_record_as_cancelled(make_server, client_for):
    srv = make_server(step_delay_s=0.05)
    c = client_for(srv)
    engine = srv.ctx.engine
    vid = c.post("/v1/videos", json={"prompt": "long", "num_inference_steps": 200}).json()["id"]
    _wait_status(c, vid, ("in_progress",))
    at_cancel = engine.stats()["steps_executed"]
    r = c.post(f"/v1/videos/{vid}/cancel")
    assert r.status_code == 200
    job = r.json()
    assert job["status"] == "cancelled" and job["error"]["code"] == "cancelled"
    assert "POST /cancel" in job["error"]["message"] and job["cancel_requested"] is False
    assert engine.stats()["steps_executed"] - at_cancel <= 1
    assert c.get(f"/v1/videos/{vid}").json()["status"] == "cancelled"
    assert c.post(f"/v1/videos/{vid}/cancel").status_code == 200  # idempotent
    r = c.get(f"/v1/videos/{vid}/content")
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_cancelled"
    done = c.post("/v1/videos", json={"prompt": "short", "num_inference_steps": 1}).json()["id"]
    _wait_status(c, done, ("completed",))
    r = c.post(f"/v1/videos/{done}/cancel")
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_already_finished"


def test_restart_keeps_completed_content_and_fails_interrupted_jobs(make_server, client_for, tmp_path):
    state = tmp_path / "restart-state"
    srv = make_server(state_dir=state)
    c = client_for(srv)
    vid = c.post("/v1/videos", json={"prompt": "keep me", "num_frames": 3, "num_inference_steps": 2}).json()["id"]
    _wait_status(c, vid, ("completed",))
    before = c.get(f"/v1/videos/{vid}/content").content
    srv.stop()
    # simulate a crash in the middle of a job: a record left 'in_progress' in the database
    from omnicore.server.store import JobStore

    store = JobStore(state)
    rec = dict(store.get(vid), id="video_crashedjob0000000000000000", status="in_progress", phase="denoise")
    store.insert(rec, {"body": {"prompt": "x"}, "inputs": []})
    store.close()
    srv2 = make_server(state_dir=state)
    c2 = client_for(srv2)
    job = c2.get(f"/v1/videos/{vid}").json()
    assert job["status"] == "completed"
    assert c2.get(f"/v1/videos/{vid}/content").content == before
    crashed = c2.get("/v1/videos/video_crashedjob0000000000000000").json()
    assert crashed["status"] == "failed" and crashed["error"]["code"] == "interrupted"
    assert crashed["error"]["message"]


def test_queued_jobs_are_reenqueued_after_restart(make_server, client_for, tmp_path):
    state = tmp_path / "requeue-state"
    srv = make_server(state_dir=state)
    c = client_for(srv)
    vid = c.post("/v1/videos", json={"prompt": "later", "num_frames": 2, "num_inference_steps": 2,
                                      "seed": 5}).json()["id"]
    _wait_status(c, vid, ("completed",))
    srv.stop()
    from omnicore.server.store import JobStore

    store = JobStore(state)  # pretend the process died while the job was still queued
    store.update(vid, status="queued")  # completed is terminal: rewrite the row through a fresh record
    rec = dict(store.get(vid), id="video_queuedjob00000000000000000", status="queued", progress=0)
    store.insert(rec, store.get_request(vid))
    store.close()
    srv2 = make_server(state_dir=state)
    c2 = client_for(srv2)
    job = _wait_status(c2, "video_queuedjob00000000000000000", ("completed", "failed"))
    assert job["status"] == "completed" and job["seed"] == 5
    assert c2.get(f"/v1/videos/{job['id']}/content").content == c2.get(f"/v1/videos/{vid}/content").content


def test_idempotency_key(make_server, client_for):
    srv = make_server()
    c = client_for(srv)
    body = {"prompt": "once", "num_frames": 2, "num_inference_steps": 1}
    a = c.post("/v1/videos", json=body, headers={"Idempotency-Key": "k1"}).json()
    b = c.post("/v1/videos", json=body, headers={"Idempotency-Key": "k1"}).json()
    assert a["id"] == b["id"]
    r = c.post("/v1/videos", json=dict(body, prompt="twice"), headers={"Idempotency-Key": "k1"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_key_reused"
    assert len(c.get("/v1/videos").json()["data"]) == 1


def test_sync_video_and_reference_image_gating(make_server, client_for):
    srv = make_server()
    c = client_for(srv)
    r = c.post("/v1/videos/sync", json={"prompt": "now", "num_frames": 3, "num_inference_steps": 2, "seed": 3})
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    assert r.headers["x-omnicore-seed"] == "3" and r.headers["x-omnicore-job-id"].startswith("video_")
    assert _frames(r.content).shape[0] == 3
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (9, 9, 9)).save(buf, "PNG")
    r = c.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("r.png", buf.getvalue(), "image/png")})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_for_model"
    r = c.post("/v1/videos", data={"prompt": "x"}, files={"input_reference": ("r.png", b"GIF89a....", "image/gif")})
    assert r.status_code == 415
    r = c.post("/v1/videos", json={"prompt": "x", "seconds": "1.5"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seconds"
    r = c.post("/v1/videos", content=b"prompt", headers={"content-type": "text/plain"})
    assert r.status_code == 415


def test_cancel_and_delete_answer_202_until_the_worker_stops(make_server, client_for):
    srv = make_server(step_delay_s=0.6, cancel_wait_s=0.05)
    c = client_for(srv)
    vid = c.post("/v1/videos", json={"prompt": "stubborn", "num_frames": 2, "num_inference_steps": 50}).json()["id"]
    deadline = time.monotonic() + 30
    while (c.get(f"/v1/videos/{vid}").json().get("step") or 0) < 1:  # now inside a slow step, past its check
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = c.post(f"/v1/videos/{vid}/cancel")
    assert r.status_code == 202
    assert r.json()["status"] == "in_progress" and r.json()["cancel_requested"] is True
    r = c.delete(f"/v1/videos/{vid}")  # a second cancel is idempotent; the deletion waits for the worker
    assert r.status_code == 202 and r.json()["deleted"] is False and r.json()["job"]["id"] == vid
    deadline = time.monotonic() + 10
    while c.get(f"/v1/videos/{vid}").status_code != 404:  # deleted once the current step ended
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert srv.ctx.engine.stats()["steps_executed"] < 50
