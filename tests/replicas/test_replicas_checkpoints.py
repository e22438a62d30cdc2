"""Step checkpoints across replicas (issue 25, ``--checkpoint-every``): two replicas (real uvicorn servers around
toy engines, in this process) on one real PostgreSQL and one directory. The replica running a job writes a
checkpoint every step; its lease is then expired in the database (as if it froze), the other replica claims the
job and resumes at the checkpoint's step, the first one's next write is fenced off, and the video's bytes equal an
uninterrupted run's. Then the same with two real ``omnicore serve`` processes and ``kill -9`` of the holder."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_replicas_inprocess import _wait

pytestmark = pytest.mark.slow

STEPS = 12


def _expire_lease(pg_url: str, job_id: str) -> None:
    import psycopg

    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE jobs SET lease_expires = now() - interval '1 second' WHERE id = %s", (job_id,))


def _checkpoint(pg_url: str, job_id: str) -> tuple[str | None, int | None]:
    import psycopg

    with psycopg.connect(pg_url) as conn:
        row = conn.execute("SELECT checkpoint_path, checkpoint_step FROM jobs WHERE id = %s", (job_id,)).fetchone()
    return (row[0], row[1]) if row else (None, None)


def test_a_job_whose_lease_is_lost_resumes_on_another_replica_from_its_checkpoint(
        replicas: Any, pg_url: str, tmp_path: Path) -> None:
    # one job per replica at a time, so the replica that loses the lease cannot take the job straight back
    a, b = replicas(2, step_delay_s=0.15, claim_slots=1, checkpoint_every=1, lease_s=30)
    ca = httpx.Client(base_url=a.url, timeout=60)
    body = {"prompt": "resume me", "num_frames": 2, "num_inference_steps": STEPS, "seed": 77}
    vid = ca.post("/v1/videos", json=body).json()["id"]
    _wait(ca, vid, ("in_progress",))
    first, second = (a, b) if a.ctx.jobs.get_live(vid) is not None else (b, a)
    deadline = time.monotonic() + 60
    while (_checkpoint(pg_url, vid)[1] or 0) < 3:
        assert time.monotonic() < deadline, ca.get(f"/v1/videos/{vid}").json()
        time.sleep(0.02)
    path, step = _checkpoint(pg_url, vid)
    assert path is not None and Path(path).is_file() and f"{vid}.1." in Path(path).name  # under claim 1's token
    steps_before = second.ctx.engine.stats()["steps_executed"]
    _expire_lease(pg_url, vid)  # the first replica "froze": its lease ran out
    done = _wait(ca, vid, ("completed", "failed", "cancelled"), timeout=120)
    assert done["status"] == "completed", done
    resumed = done["usage"]["resumed_from_step"]
    assert 3 <= resumed < STEPS  # the second replica started at a checkpoint's step, not at 0
    assert second.ctx.engine.stats()["steps_executed"] - steps_before == STEPS - resumed
    assert done["usage"]["denoise_steps_computed"] == STEPS - resumed
    store = first.ctx.store
    assert store.lease_of(vid)[1:] == (2, 2)  # token 2, claimed twice
    # the first replica's late writes were fenced off and it stopped the job (no result of claim 1)
    deadline = time.monotonic() + 30
    while first.ctx.jobs.get_live(vid) is not None and not first.ctx.jobs.get_live(vid).done.is_set():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    shared = tmp_path / "shared"
    assert not (shared / "results" / f"{vid}.1.mp4").exists()
    assert not list((shared / "checkpoints").glob(f"{vid}.*"))  # the finished job's checkpoints are gone
    content = ca.get(f"/v1/videos/{vid}/content").content
    # an uninterrupted run of the same request gives the same bytes
    again = ca.post("/v1/videos", json=body).json()["id"]
    assert _wait(ca, again, ("completed", "failed"), timeout=120)["status"] == "completed"
    assert "resumed_from_step" not in ca.get(f"/v1/videos/{again}").json()["usage"]
    assert ca.get(f"/v1/videos/{again}/content").content == content and content[4:8] == b"ftyp"


def test_kill_9_of_the_holder_resumes_the_job_on_another_process_from_its_checkpoint(
        postgres: Any, tmp_path: Path) -> None:
    """Two real ``omnicore serve tiny:lingbot --checkpoint-every 2`` processes; the one running a 24-step job is
    killed with SIGKILL after its second checkpoint; the other resumes it there once the lease (3 s) runs out."""
    pytest.importorskip("omni_lingbot", reason="the LingBot plugin (plugins/lingbot) is not installed")
    from _replica_procs import Replica, holder_pid, leases, wait_all

    pg_url = postgres.new_database("ckpt_kill9")
    made: list[Replica] = []

    def replica(name: str) -> Replica:
        r = Replica(name, pg_url=pg_url, shared=tmp_path / "shared", root=tmp_path, cache=tmp_path / "cache",
                    lease_s=3.0, extra=("--checkpoint-every", "2", "--claim-slots", "1"))
        made.append(r)
        r.wait_ready()  # one at a time: the first one writes the tiny preset into the shared cache
        return r

    try:
        one, two = replica("k1"), replica("k2")
        body = {"prompt": "kill me mid-run", "num_inference_steps": 24, "seed": 4242}
        vid = httpx.post(one.url + "/v1/videos", json=body, timeout=30).json()["id"]
        deadline = time.monotonic() + 180
        while (_checkpoint(pg_url, vid)[1] or 0) < 4:
            assert time.monotonic() < deadline, one.log()[-3000:] + two.log()[-3000:]
            time.sleep(0.05)
        victim = next(r for r in made if r.pid == holder_pid(pg_url, vid))
        survivor = next(r for r in made if r is not victim)
        victim.kill9()
        with httpx.Client(base_url=survivor.url, timeout=30) as c:
            done = wait_all(c, [vid], 300)[vid]
            assert done["status"] == "completed", done
            assert done["usage"]["resumed_from_step"] >= 4, done["usage"]
            assert leases(pg_url)[vid] == (2, 2)
            content = c.get(f"/v1/videos/{vid}/content").content
            again = c.post("/v1/videos", json=body).json()["id"]
            assert wait_all(c, [again], 300)[again]["status"] == "completed"
            assert c.get(f"/v1/videos/{again}/content").content == content  # as if nothing had happened
        assert not list((tmp_path / "shared" / "checkpoints").glob(f"{vid}.*"))
    finally:
        for r in made:
            r.stop()
