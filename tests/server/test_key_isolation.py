"""Issue 28 §7-§8: video jobs belong to the API key that created them, an admin key sees all, usage per key,
the store migrates, and a key sent in the query string never reaches the access log. Real uvicorn on loopback.

The visibility rule: with keys set, a key sees the jobs it created (others get 404, the same answer as for a job
that does not exist), an ``--admin-api-key`` sees every job, and jobs without an owner (created before this
version, or while auth was off) are visible to admin keys only. Without keys there is no isolation.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

KEY_A = "key-alpha-5b1e8f0c2d"
KEY_B = "key-bravo-93a6c4e7f1"
ADMIN = "key-admin-0d7b2a9e64"


def _client(srv, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=srv.url, headers=headers, timeout=30)


def _completed(c: httpx.Client, prompt: str, **headers: str) -> str:
    r = c.post("/v1/videos", json={"prompt": prompt, "num_frames": 2, "num_inference_steps": 2}, headers=headers)
    assert r.status_code == 200, r.text
    vid = r.json()["id"]
    deadline = time.monotonic() + 30
    while c.get(f"/v1/videos/{vid}").json()["status"] != "completed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return vid


@pytest.fixture
def keyed(make_server):
    srv = make_server(api_keys=(KEY_A, KEY_B), admin_api_keys=(ADMIN,), step_delay_s=0.02)
    clients = {k: _client(srv, k) for k in (KEY_A, KEY_B, ADMIN)}
    yield srv, clients
    for c in clients.values():
        c.close()


def test_another_key_gets_404_for_every_route_of_a_job(keyed):
    srv, cl = keyed
    a, b, admin = cl[KEY_A], cl[KEY_B], cl[ADMIN]
    vid = _completed(a, "alpha's secret prompt")
    running = a.post("/v1/videos", json={"prompt": "alpha running", "num_frames": 2,
                                         "num_inference_steps": 200}).json()["id"]
    for method, path in (("GET", f"/v1/videos/{vid}"), ("GET", f"/v1/videos/{vid}/content"),
                         ("GET", f"/v1/videos/{vid}/events"), ("POST", f"/v1/videos/{vid}/cancel"),
                         ("DELETE", f"/v1/videos/{vid}"), ("POST", f"/v1/videos/{running}/cancel"),
                         ("DELETE", f"/v1/videos/{running}"), ("GET", f"/v1/videos/{running}/events")):
        r = b.request(method, path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found", (method, path, r.text)
    listed = b.get("/v1/videos").json()
    assert listed["data"] == [] and "alpha" not in json.dumps(listed)
    assert b.get("/v1/videos", params={"after": vid}).json()["data"] == []  # no probing through the cursor
    # the owner and the admin still see and control it
    assert a.get(f"/v1/videos/{running}").json()["status"] in ("queued", "in_progress")
    assert {j["id"] for j in a.get("/v1/videos").json()["data"]} == {vid, running}
    assert {j["id"] for j in admin.get("/v1/videos").json()["data"]} == {vid, running}
    assert admin.get(f"/v1/videos/{vid}/content").status_code == 200
    assert admin.post(f"/v1/videos/{running}/cancel").json()["status"] == "cancelled"
    assert a.get(f"/v1/videos/{vid}/content").status_code == 200
    # B's own job is B's alone
    mine = _completed(b, "bravo")
    assert a.get(f"/v1/videos/{mine}").status_code == 404
    assert [j["id"] for j in b.get("/v1/videos").json()["data"]] == [mine]
    assert a.delete(f"/v1/videos/{vid}").json()["deleted"] is True


def test_idempotency_keys_are_per_api_key(keyed):
    srv, cl = keyed
    body = {"prompt": "same body", "num_frames": 2, "num_inference_steps": 1}
    first = cl[KEY_A].post("/v1/videos", json=body, headers={"Idempotency-Key": "shared"}).json()["id"]
    again = cl[KEY_A].post("/v1/videos", json=body, headers={"Idempotency-Key": "shared"}).json()["id"]
    other = cl[KEY_B].post("/v1/videos", json=body, headers={"Idempotency-Key": "shared"})
    assert first == again
    assert other.status_code == 200 and other.json()["id"] != first  # not A's job handed to B


def test_keys_are_stored_only_as_key_ids_and_usage_is_per_key(keyed):
    srv, cl = keyed
    a, b = cl[KEY_A], cl[KEY_B]
    _completed(a, "one")
    _completed(a, "two")
    r = a.post("/v1/images/generations", json={"prompt": "img", "num_inference_steps": 3})
    assert r.status_code == 200, r.text
    ua, ub = a.get("/v1/usage").json(), b.get("/v1/usage").json()
    assert ua["object"] == "usage" and len(ua["key_id"]) == 16 and ua["key_id"] != ub["key_id"]
    assert ua["jobs"] == {"completed": 3} and ua["jobs_total"] == 3
    assert ua["denoise_steps"] == 2 + 2 + 3 and ua["compute_seconds"] > 0
    assert ub["jobs_total"] == 0 and ub["denoise_steps"] == 0
    metrics = httpx.get(srv.url + "/metrics").text
    assert f'omnicore_key_jobs_total{{key_id="{ua["key_id"]}",status="completed"}} 3.0' in metrics, metrics[-2000:]
    assert f'omnicore_key_denoise_steps_total{{key_id="{ua["key_id"]}"}} 7.0' in metrics
    for key in (KEY_A, KEY_B, ADMIN):  # neither the store nor the metrics hold a key
        assert key not in metrics
        for path in Path(srv.ctx.store.root).rglob("*"):
            if path.is_file() and path.name != "key_id_secret":
                assert key.encode() not in path.read_bytes(), (key, path)
    assert httpx.get(srv.url + "/v1/usage").status_code == 401


def test_without_keys_there_is_no_isolation(make_server, client_for):
    srv = make_server()
    c = client_for(srv)
    vid = _completed(c, "open")
    assert c.get(f"/v1/videos/{vid}").status_code == 200
    usage = c.get("/v1/usage").json()
    assert usage["key_id"] is None and usage["jobs"] == {"completed": 1}


def test_a_store_from_before_owners_is_migrated(make_server, tmp_path):
    state = tmp_path / "old-state"
    old = make_server(state_dir=state)  # a job written with auth off ...
    with httpx.Client(base_url=old.url, timeout=30) as c:
        vid = _completed(c, "from the old version")
    old.stop()
    db = sqlite3.connect(state / "jobs.sqlite3")  # ... in the schema before owners existed
    db.execute("DROP INDEX jobs_owner")
    db.execute("ALTER TABLE jobs DROP COLUMN owner")
    db.commit()
    assert "owner" not in [r[1] for r in db.execute("PRAGMA table_info(jobs)")]
    db.close()
    srv = make_server(state_dir=state, api_keys=(KEY_A,), admin_api_keys=(ADMIN,))
    a, admin = _client(srv, KEY_A), _client(srv, ADMIN)
    try:
        assert a.get(f"/v1/videos/{vid}").status_code == 404  # ownerless: admin only
        assert a.get("/v1/videos").json()["data"] == []
        assert admin.get(f"/v1/videos/{vid}").json()["prompt"] == "from the old version"
        assert admin.get(f"/v1/videos/{vid}/content").status_code == 200
        new = _completed(a, "new")
        assert {j["id"] for j in admin.get("/v1/videos").json()["data"]} == {vid, new}
        assert [j["id"] for j in a.get("/v1/videos").json()["data"]] == [new]
    finally:
        a.close()
        admin.close()
    cols = [r[1] for r in sqlite3.connect(state / "jobs.sqlite3").execute("PRAGMA table_info(jobs)")]
    assert "owner" in cols


def test_a_key_in_the_query_string_is_redacted_from_the_access_log(make_server):
    from omnicore.server.http_edge import redact_query

    srv = make_server(api_keys=(KEY_A,))
    access = logging.getLogger("uvicorn.access")
    lines: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, level = Grab(), access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    srv.server.config.access_log = True
    try:
        for query in (f"api_key={KEY_A}", f"limit=2&token={KEY_A}", f"Authorization=Bearer%20{KEY_A}",
                      f"x_api_key={KEY_A}&order=asc"):
            assert httpx.get(f"{srv.url}/v1/videos?{query}").status_code == 401
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    assert len(lines) == 4, lines
    assert all(KEY_A not in line for line in lines), lines
    assert "limit=2&token=REDACTED" in lines[1] and "order=asc" in lines[3]
    assert redact_query("/v1/videos?limit=2") == "/v1/videos?limit=2"


def test_an_admin_key_alone_turns_auth_on(make_server):
    srv = make_server(admin_api_keys=(ADMIN,))
    assert httpx.get(srv.url + "/v1/videos").status_code == 401
    with _client(srv, ADMIN) as admin:
        assert admin.get("/v1/videos").status_code == 200
