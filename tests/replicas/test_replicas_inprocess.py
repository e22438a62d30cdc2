"""Two replicas (real uvicorn servers around toy engines, in this process) sharing one real PostgreSQL and one
directory: any replica answers for any job, work is claimed once, cancel and events cross replicas."""

from __future__ import annotations

import time
from typing import Any

import httpx
from _server_helpers import read_events


def _wait(c: httpx.Client, vid: str, statuses: tuple[str, ...], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = c.get(f"/v1/videos/{vid}").json()
        if job["status"] in statuses:
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def test_jobs_submitted_round_robin_complete_once_and_any_replica_serves_them(replicas) -> None:
    servers = replicas(2)
    clients = [httpx.Client(base_url=s.url, timeout=60) for s in servers]
    ids = []
    for i in range(8):
        r = clients[i % 2].post("/v1/videos", json={"prompt": f"clip {i}", "num_frames": 2, "num_inference_steps": 2,
                                                    "seed": i})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "queued" and r.json()["queue_position"] is not None
        ids.append(r.json()["id"])
    for vid in ids:
        done = _wait(clients[0], vid, ("completed", "failed"))
        assert done["status"] == "completed", done
    store = servers[0].ctx.store
    holders = set()
    for vid in ids:
        a, b = (c.get(f"/v1/videos/{vid}").json() for c in clients)
        assert a == b
        bodies = [c.get(f"/v1/videos/{vid}/content").content for c in clients]
        assert bodies[0] == bodies[1] and bodies[0][4:8] == b"ftyp"
        part = clients[1].get(f"/v1/videos/{vid}/content", headers={"Range": "bytes=0-9"})
        assert part.status_code == 206 and part.content == bodies[0][:10]
        holder, token, claims = store.lease_of(vid)
        assert claims == 1 and token == 1 and holder is None  # claimed once, lease cleared at the end
    for s in servers:
        holders |= {k for k in s.ctx.claimer.held}
    assert holders == set()
    assert {r["id"] for r in clients[1].get("/v1/videos?limit=100").json()["data"]} == set(ids)


def _flag_clock(server: Any) -> list[float]:
    """When ``server``'s store writes ``cancel_requested`` (the request reaching the store), in monotonic time."""
    store, times = server.ctx.store, []
    update = store.update

    def recording(job_id: str, **changes: Any) -> Any:
        if changes.get("cancel_requested"):
            times.append(time.monotonic())
        return update(job_id, **changes)

    store.update = recording
    return times


def test_delete_through_another_replica_cancels_within_a_step(replicas) -> None:
    a, b = replicas(2, step_delay_s=0.05)
    ca, cb = httpx.Client(base_url=a.url, timeout=60), httpx.Client(base_url=b.url, timeout=60)
    vid = ca.post("/v1/videos", json={"prompt": "long", "num_frames": 2, "num_inference_steps": 200}).json()["id"]
    job = _wait(ca, vid, ("in_progress",))
    runner, bystander, other = (a, b, cb) if a.ctx.jobs.get_live(vid) is not None else (b, a, ca)
    deadline = time.monotonic() + 30
    while (other.get(f"/v1/videos/{vid}").json().get("step") or 0) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    job = other.get(f"/v1/videos/{vid}").json()
    assert job["eta_s"] is not None and job["eta_s"] > 0  # from its measured steps, seen from the other replica
    flagged = _flag_clock(bystander)
    r = other.delete(f"/v1/videos/{vid}")
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    # within one step: once the request is in the store, the runner starts at most one more step (the flag lands
    # while step k runs or before its progress write; that write sees it, and step k+1 never starts - or it lands
    # just after the write, step k+1 starts, and its own write stops the job)
    assert len(flagged) == 1
    started_after = [t for t in runner.slow_steps.starts if t > flagged[0]]
    assert len(started_after) <= 1, (len(started_after), len(runner.slow_steps.starts))
    assert ca.get(f"/v1/videos/{vid}").status_code == 404 and cb.get(f"/v1/videos/{vid}").status_code == 404


def test_cancel_of_a_queued_job_needs_no_holder(replicas) -> None:
    (a,) = replicas(1, step_delay_s=0.05, claim_slots=1)
    c = httpx.Client(base_url=a.url, timeout=60)
    first = c.post("/v1/videos", json={"prompt": "busy", "num_frames": 2, "num_inference_steps": 200}).json()["id"]
    _wait(c, first, ("in_progress",))
    queued = c.post("/v1/videos", json={"prompt": "waits", "num_frames": 2, "num_inference_steps": 2}).json()
    assert queued["queue_position"] == 0
    assert c.get(f"/v1/videos/{queued['id']}").json()["status"] == "queued"
    r = c.post(f"/v1/videos/{queued['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    c.post(f"/v1/videos/{first}/cancel")


def test_events_stream_from_a_replica_that_does_not_run_the_job(replicas) -> None:
    a, b = replicas(2, step_delay_s=0.1, claim_slots=1)
    ca = httpx.Client(base_url=a.url, timeout=60)
    vid = ca.post("/v1/videos", json={"prompt": "watch", "num_frames": 2, "num_inference_steps": 24}).json()["id"]
    _wait(ca, vid, ("in_progress",))
    watcher = b if a.ctx.jobs.get_live(vid) is not None else a
    assert watcher.ctx.jobs.get_live(vid) is None
    with httpx.Client(base_url=watcher.url, timeout=60) as cw, cw.stream("GET", f"/v1/videos/{vid}/events") as resp:
        events = read_events(resp)
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "video.completed" and "video.progress" in kinds
    steps = [e["data"]["step"] for e in events if e["event"] == "video.progress" and e["data"].get("step")]
    assert len(set(steps)) >= 3  # steps seen as they happened on the other replica
    ids = [int(e["id"]) for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_a_replica_that_drains_gives_its_unstarted_jobs_back(replicas) -> None:
    a, b = replicas(2, step_delay_s=0.05, claim_slots=2, shutdown_grace_s=0.1)
    ca = httpx.Client(base_url=a.url, timeout=60)
    cb = httpx.Client(base_url=b.url, timeout=60)
    ids = [ca.post("/v1/videos", json={"prompt": f"j{i}", "num_frames": 2, "num_inference_steps": 30}).json()["id"]
           for i in range(4)]
    _wait(ca, ids[0], ("in_progress",))
    a.stop()  # drains: what it runs past the grace and what it holds unstarted go back to the queue
    for vid in ids:
        assert _wait(cb, vid, ("completed", "failed", "cancelled"), timeout=120)["status"] == "completed"
