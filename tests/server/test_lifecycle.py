"""Server lifecycle over real HTTP: graceful shutdown, a dead engine worker, TTL expiry and opt-in deadlines."""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest
from omnicore.server.store import JobStore


def _wait(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _status(c: httpx.Client, vid: str) -> dict:
    return c.get(f"/v1/videos/{vid}").json()


def test_graceful_shutdown_finishes_running_work_holds_queued_jobs_and_flushes_the_store(make_server, client_for,
                                                                                           tmp_path):
    state = tmp_path / "drain-state"
    srv = make_server(state_dir=state, step_delay_s=0.05, shutdown_grace_s=20.0, engine_settings={"max_num_seqs": 1})
    c = client_for(srv)
    running = c.post("/v1/videos", json={"prompt": "finish me", "num_frames": 2, "num_inference_steps": 12}).json()
    _wait(lambda: _status(c, running["id"])["status"] == "in_progress", what="the first job to start")
    queued = c.post("/v1/videos", json={"prompt": "hold me", "num_frames": 2, "num_inference_steps": 2,
                                        "seed": 11}).json()
    assert queued["status"] == "queued"

    srv.ctx.begin_drain()  # what SIGTERM does first
    health = c.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "draining"
    r = c.post("/v1/images/generations", json={"prompt": "too late"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining" and r.headers["retry-after"]
    r = c.post("/v1/videos", json={"prompt": "too late"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 15  # it waited for the running job, not for the whole grace

    # the store was flushed and closed: the WAL is checkpointed into the main file
    wal = state / "jobs.sqlite3-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    with sqlite3.connect(state / "jobs.sqlite3") as db:
        assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 2
    store = JobStore(state)
    done, held = store.get(running["id"]), store.get(queued["id"])
    result = store.get_result_path(running["id"])
    store.close()
    assert done["status"] == "completed" and result is not None and result.stat().st_size > 0
    assert held["status"] == "queued" and held["cancel_requested"] is False and held["error"] is None

    # the held job runs after a restart on the same state dir
    srv2 = make_server(state_dir=state)
    c2 = client_for(srv2)
    job = _wait(lambda: (j := _status(c2, queued["id"]))["status"] in ("completed", "failed") and j,
                what="the held job to run after the restart")
    assert job["status"] == "completed" and job["seed"] == 11
    assert c2.get(f"/v1/videos/{queued['id']}/content").status_code == 200


def test_shutdown_grace_stops_long_work_at_a_step_and_records_interrupted(make_server, client_for, tmp_path):
    state = tmp_path / "grace-state"
    srv = make_server(state_dir=state, step_delay_s=0.05, shutdown_grace_s=0.2)
    c = client_for(srv)
    engine = srv.ctx.engine
    vid = c.post("/v1/videos", json={"prompt": "too long", "num_frames": 2, "num_inference_steps": 200}).json()["id"]
    _wait(lambda: (_status(c, vid).get("step") or 0) >= 2, what="denoising to begin")
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 5
    # the engine closed with the server: once its worker thread has exited no step can run any more
    _wait(lambda: not engine.worker_alive, what="the engine worker to exit")
    assert engine.stats()["steps_executed"] < 200
    store = JobStore(state)
    record = store.get(vid)
    store.close()
    assert record["status"] == "failed" and record["error"]["code"] == "interrupted"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_worker_fails_its_jobs_and_makes_the_server_unhealthy(make_server, client_for):
    srv = make_server(heartbeat_interval_s=0.1)
    c = client_for(srv)
    assert c.get("/health").json()["status"] == "ok"
    engine = srv.ctx.engine

    def die() -> None:
        raise RuntimeError("simulated worker crash")

    engine.scheduler.next_batch = die  # the worker thread raises outside its guarded batch run and exits
    job = c.post("/v1/videos", json={"prompt": "orphan", "num_frames": 2, "num_inference_steps": 2}).json()
    _wait(lambda: not engine.worker_alive, what="the worker thread to die")
    t0 = time.monotonic()
    failed = _wait(lambda: (j := _status(c, job["id"]))["status"] == "failed" and j, what="worker_died")
    assert time.monotonic() - t0 < 2.0  # within about one heartbeat interval
    assert failed["error"]["code"] == "worker_died" and failed["error"]["message"]
    health = c.get("/health")
    assert health.status_code == 503
    assert health.json()["status"] == "unhealthy" and "worker" in health.json()["error"]
    r = c.post("/v1/images/generations", json={"prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable"
    assert 'omnicore_ready 0.0' in c.get("/metrics").text


def test_finished_jobs_expire_while_the_server_runs(make_server, client_for):
    srv = make_server(job_ttl_s=1.0, heartbeat_interval_s=0.1, step_delay_s=0.02)
    c = client_for(srv)
    done = c.post("/v1/videos", json={"prompt": "short-lived", "num_frames": 2, "num_inference_steps": 1}).json()
    record = _wait(lambda: (j := _status(c, done["id"]))["status"] == "completed" and j, what="completion")
    assert record["expires_at"] - record["completed_at"] in (0, 1)
    path = srv.ctx.store.get_result_path(done["id"])
    assert path.exists()
    cancelled = c.post("/v1/videos", json={"prompt": "stop", "num_inference_steps": 200}).json()
    assert c.post(f"/v1/videos/{cancelled['id']}/cancel").json()["status"] == "cancelled"
    _wait(lambda: c.get(f"/v1/videos/{done['id']}").status_code == 404, timeout=10, what="the TTL to expire")
    assert not path.exists()
    _wait(lambda: c.get(f"/v1/videos/{cancelled['id']}").status_code == 404, timeout=10,
          what="the cancelled job to expire")
    assert c.get("/v1/videos").json()["data"] == []


def test_opt_in_deadlines_stop_the_work_and_say_timeout(make_server, client_for):
    srv = make_server(step_delay_s=0.05)
    c = client_for(srv)
    engine = srv.ctx.engine
    before = engine.stats()["steps_executed"]
    t0 = time.monotonic()
    r = c.post("/v1/images/generations", json={"prompt": "slow", "num_inference_steps": 200, "timeout_s": 0.3})
    assert r.status_code == 409 and r.json()["error"]["code"] == "timeout"
    assert time.monotonic() - t0 < 3
    assert engine.stats()["steps_executed"] - before < 200
    vid = c.post("/v1/videos", json={"prompt": "slow", "num_inference_steps": 200, "timeout_s": 0.3}).json()["id"]
    job = _wait(lambda: (j := _status(c, vid))["status"] in ("failed", "completed") and j, what="the deadline")
    assert job["status"] == "failed" and job["error"]["code"] == "timeout"
    # no deadline unless asked for: a job longer than the ones above completes
    slow = c.post("/v1/videos", json={"prompt": "no deadline", "num_frames": 2, "num_inference_steps": 12}).json()
    assert _wait(lambda: (j := _status(c, slow["id"]))["status"] in ("failed", "completed") and j)["status"] \
        == "completed"


def test_a_zero_heartbeat_interval_is_rejected_at_startup(tmp_path):
    from omnicore.errors import ConfigError
    from omnicore.server import ServerSettings

    with pytest.raises(ConfigError) as err:  # it would turn the job monitor into a busy loop
        ServerSettings(state_dir=tmp_path, heartbeat_interval_s=0.0)
    assert err.value.name == "heartbeat_interval_s"


def test_readiness_listeners_see_every_change_once_and_draining_is_final():
    """`omnicore serve` announces readiness from this callback, so a SIGTERM right after the model becomes ready
    cannot swallow the announcement (a polling thread could miss the short `ok` window)."""
    from omnicore.server.lifecycle import Readiness

    seen: list[str] = []
    r = Readiness("loading")
    r.on_change(seen.append)
    r.set("loading")  # no change, no call
    r.set("ok")
    r.set("draining")
    r.set("ok")  # ignored: draining is final
    r.set("unhealthy", error="worker died")
    assert seen == ["ok", "draining", "unhealthy"]
    assert r.error == "worker died"
