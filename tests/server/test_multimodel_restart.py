"""Killing a several-model server (SIGKILL) while it swaps models, then restarting it on the same state
directory: the persisted jobs of every model that were queued run after the restart (the restart table)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _server_helpers import LiveServer

pytestmark = pytest.mark.slow
HELPER = Path(__file__).with_name("_pool_server.py")


def _models(c: httpx.Client) -> dict[str, str]:
    return {m["id"]: m["omnicore"]["state"] for m in c.get("/v1/models").json()["data"]}


def test_jobs_of_every_model_resume_after_a_kill_during_a_swap(tmp_path, toy_cache):
    from omnicore.pool import resident_bytes
    from toy import build_toy_checkpoint, toy_engine

    dirs = {n: build_toy_checkpoint(tmp_path / n, weight_seed=i + 1) for i, n in enumerate(("a", "b"))}
    with toy_engine(toy_cache, str(dirs["a"])) as engine:
        budget = int(resident_bytes(engine.pipeline, "cpu") * 1.5)  # room for one model at a time
    state, port_file = tmp_path / "state", tmp_path / "port"
    proc = subprocess.Popen([sys.executable, str(HELPER), str(state), str(toy_cache), str(port_file), str(budget),
                             "3.0", *(f"{n}={d}" for n, d in dirs.items())], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the pool server did not start"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        with httpx.Client(base_url=url, timeout=30) as c:
            body = {"prompt": "p", "num_frames": 2, "num_inference_steps": 4}
            ids = {"a1": c.post("/v1/videos", json=dict(body, model="a", seed=1)).json()["id"]}
            time.sleep(0.2)
            for key, model in (("b1", "b"), ("b2", "b"), ("a2", "a"), ("a3", "a")):
                r = c.post("/v1/videos", json=dict(body, model=model, seed=int(key[1])))
                assert r.status_code == 200, r.text
                ids[key] = r.json()["id"]
            deadline = time.monotonic() + 60
            while _models(c).get("b") != "loading":  # a1 ran, `a` went out, `b` is coming in (3 s)
                assert time.monotonic() < deadline, _models(c)
                time.sleep(0.05)
            at_kill = {k: c.get(f"/v1/videos/{v}").json()["status"] for k, v in ids.items()}
            queued = {k for k, s in at_kill.items() if s == "queued"}
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert {"b1", "b2", "a2", "a3"} <= queued, queued  # both models had persisted queued work at the kill

    from omnicore.config import Settings
    from omnicore.pool import ModelEntry, ModelPool
    from omnicore.server import ServerSettings, create_app
    from toy import toy_host

    settings = Settings(cache_dir=str(toy_cache))
    pool = ModelPool([ModelEntry(name=n, checkpoint=str(d)) for n, d in dirs.items()], host=toy_host(settings),
                     settings=settings, memory_budget=budget)
    srv = LiveServer(create_app(pool, ServerSettings(state_dir=state))).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            deadline = time.monotonic() + 120
            while True:
                jobs = {k: c.get(f"/v1/videos/{v}").json() for k, v in ids.items()}
                if all(j["status"] in ("completed", "failed", "cancelled") for j in jobs.values()):
                    break
                assert time.monotonic() < deadline, {k: j["status"] for k, j in jobs.items()}
                time.sleep(0.1)
            for key in queued:  # every model's queued jobs re-ran, for the model they were queued for
                assert jobs[key]["status"] == "completed", jobs[key]
                assert jobs[key]["model"] == key[0]
                assert c.get(f"/v1/videos/{ids[key]}/content").status_code == 200
            assert jobs["a1"]["status"] == "completed"  # finished before the kill
        order = pool.order
        assert ("load", "b") in order or ("restore", "b") in order
    finally:
        srv.stop()
