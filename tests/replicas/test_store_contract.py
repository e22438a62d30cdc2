"""The job-store contract, run against both stores (SQLite and a real throwaway PostgreSQL, never a mock)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from omnicore.jobstore import DuplicateKey, JobStoreProtocol, LeaseLost


def _record(job_id: str, model: str = "m", status: str = "queued") -> dict[str, Any]:
    return {"id": job_id, "object": "video", "model": model, "status": status, "progress": 0,
            "cancel_requested": False, "created_at": int(time.time())}


def _insert(store: Any, job_id: str, model: str = "m", **kw: Any) -> None:
    store.insert(_record(job_id, model), {"body": {"prompt": job_id}, "inputs": []}, **kw)


def test_both_stores_keep_the_protocol(store: Any) -> None:
    assert isinstance(store, JobStoreProtocol)
    assert len(store.secret) >= 32


def test_records_round_trip_and_terminal_status_never_moves(store: Any) -> None:
    _insert(store, "a", owner="k1", idempotency_key="idem", body_hash="h")
    assert store.get("a")["status"] == "queued"
    assert store.get_request("a") == {"body": {"prompt": "a"}, "inputs": []}
    assert store.get_owner("a") == (True, "k1") and store.get_owner("zz") == (False, None)
    assert store.find_idempotent("idem") == ("a", "h") and store.find_idempotent("nope") is None
    with pytest.raises(DuplicateKey):
        _insert(store, "b", idempotency_key="idem")
    assert store.update("a", status="in_progress", step=1)["step"] == 1
    path = store.result_path("a", "mp4")
    path.write_bytes(b"x")
    done = store.update("a", status="completed", result_path=path, progress=100)
    assert done["status"] == "completed" and store.get_result_path("a") == path
    assert store.update("a", status="failed")["status"] == "completed"  # terminal wins
    assert store.update("a", updated_at=5)["updated_at"] == 5  # same status: still writable
    assert store.update("missing", status="failed") is None
    assert store.ids_with_status("completed") == ["a"]


def test_list_pages_in_both_orders_and_filters(store: Any) -> None:
    for i in range(5):
        _insert(store, f"j{i}", owner="k1" if i % 2 else "k2")
    page, more = store.list(limit=2)
    assert [r["id"] for r in page] == ["j4", "j3"] and more
    page, more = store.list(after="j3", limit=10, order="desc")
    assert [r["id"] for r in page] == ["j2", "j1", "j0"] and not more
    page, _ = store.list(order="asc", limit=10, owner="k1", all_owners=False)
    assert [r["id"] for r in page] == ["j1", "j3"]
    store.update("j0", status="failed")
    assert [r["id"] for r in store.list(status="failed")[0]] == ["j0"]


def test_delete_removes_record_inputs_and_results(store: Any) -> None:
    _insert(store, "d")
    (store.inputs_dir("d") / "x.png").write_bytes(b"p")
    store.result_path("d", "3.mp4").write_bytes(b"r")
    store.mark_delete_pending("d")
    assert store.delete_pending("d")
    assert store.delete("d") and store.get("d") is None and not store.delete("d")
    assert not store.inputs_dir("d").joinpath("x.png").exists() and not store.result_path("d", "3.mp4").exists()


def test_claim_takes_the_oldest_unheld_job_of_a_served_model(store: Any) -> None:
    _insert(store, "a", model="m")
    _insert(store, "b", model="other")
    _insert(store, "c", model="m")
    first = store.claim("r1", ["m"], 30)
    second = store.claim("r2", ["m"], 30)
    assert (first.job_id, second.job_id) == ("a", "c")
    assert first.token >= 1 and first.claims == 1 and first.status == "queued"
    assert store.claim("r3", ["m"], 30) is None  # both held, "b" is another model's
    assert store.claim("r3", ["other"], 30).job_id == "b"


def test_an_expired_lease_is_reclaimed_and_the_stale_holder_is_fenced(store: Any) -> None:
    _insert(store, "a")
    old = store.claim("r1", ["m"], 0.3)
    store.update("a", fence=old.token, status="in_progress", step=1)
    assert store.claim("r2", ["m"], 30) is None  # lease still live
    time.sleep(0.5)
    new = store.claim("r2", ["m"], 30)
    assert new.job_id == "a" and new.token > old.token and new.claims == 2 and new.status == "in_progress"
    with pytest.raises(LeaseLost):
        store.update("a", fence=old.token, status="completed")
    assert store.renew("a", old.token, 30) is None
    assert store.get("a")["status"] == "in_progress"
    assert store.update("a", fence=new.token, status="completed")["status"] == "completed"
    with pytest.raises(LeaseLost):  # even after the end, the stale token writes nothing
        store.update("a", fence=old.token, updated_at=1)
    assert store.claim("r3", ["m"], 0.01) is None  # terminal jobs are never claimed


def test_step_checkpoints_are_recorded_under_the_lease_and_removed_with_the_job(store: Any) -> None:
    _insert(store, "a")
    assert store.get_checkpoint("a") is None
    old = store.claim("r1", ["m"], 0.3)
    stem = store.checkpoint_stem("a", old.token, 2)
    assert stem.name == f"a.{old.token}.2"
    for suffix in (".json", ".safetensors"):
        stem.with_name(stem.name + suffix).write_text("x")
    store.set_checkpoint("a", old.token, stem.with_name(stem.name + ".json"), 2)
    assert store.get_checkpoint("a") == (stem.with_name(stem.name + ".json"), 2)
    time.sleep(0.5)
    new = store.claim("r2", ["m"], 30)
    with pytest.raises(LeaseLost):  # the stale holder cannot move the job's checkpoint
        store.set_checkpoint("a", old.token, stem.with_name("other.json"), 3)
    assert store.get_checkpoint("a") == (stem.with_name(stem.name + ".json"), 2)  # the new holder reads it
    later = store.checkpoint_stem("a", new.token, 4)
    later.with_name(later.name + ".json").write_text("y")
    store.set_checkpoint("a", new.token, later.with_name(later.name + ".json"), 4)
    store.remove_checkpoints("a", token=new.token, keep=later.with_name(later.name + ".json"))
    assert stem.with_name(stem.name + ".json").exists()  # another claim's files are not this claim's to remove
    assert store.update("a", fence=new.token, status="completed")["status"] == "completed"
    with pytest.raises(LeaseLost):  # a finished job takes no more checkpoints
        store.set_checkpoint("a", new.token, later.with_name(later.name + ".json"), 5)
    assert store.delete("a")
    assert not list(stem.parent.glob("a.*"))


def test_renewal_reports_a_cancel_asked_through_another_replica(store: Any) -> None:
    _insert(store, "a")
    held = store.claim("r1", ["m"], 30)
    assert store.renew("a", held.token, 30).cancel_requested is False
    assert store.cancel_unheld("a", {"code": "cancelled", "message": "x"}) is None  # a live holder has it
    store.update("a", cancel_requested=True)  # what DELETE on another replica writes
    store.mark_delete_pending("a")
    renewal = store.renew("a", held.token, 30)
    assert renewal.cancel_requested and renewal.delete_pending


def test_cancel_unheld_fences_a_holder_that_comes_back(store: Any) -> None:
    _insert(store, "q")
    assert store.cancel_unheld("q", {"code": "cancelled", "message": "x"})["status"] == "cancelled"
    _insert(store, "a")
    held = store.claim("r1", ["m"], 0.2)
    time.sleep(0.3)
    assert store.cancel_unheld("a", {"code": "cancelled", "message": "x"})["status"] == "cancelled"
    with pytest.raises(LeaseLost):
        store.update("a", fence=held.token, status="completed")
    assert store.get("a")["status"] == "cancelled"


def test_release_returns_a_held_job_to_the_queue(store: Any) -> None:
    _insert(store, "a")
    held = store.claim("r1", ["m"], 30)
    store.update("a", fence=held.token, status="in_progress")
    assert store.release("a", held.token)
    assert store.get("a")["status"] == "queued"
    again = store.claim("r2", ["m"], 30)
    assert again.job_id == "a" and again.token > held.token


def test_queue_position_workers_and_mean_run_time(store: Any) -> None:
    for i in range(3):
        _insert(store, f"j{i}")
    assert [store.queue_position(f"j{i}") for i in range(3)] == [0, 1, 2]
    held = store.claim("r1", ["m"], 30)
    store.update(held.job_id, fence=held.token, status="in_progress")
    assert store.queue_position("j0") is None and store.queue_position("j2") == 1
    assert store.workers() == 1
    assert store.mean_run_s("m") is None
    store.update("j0", fence=held.token, status="completed", timings={"total_s": 5.0, "queued_s": 1.0})
    assert store.mean_run_s("m") == pytest.approx(4.0)


def test_concurrent_claims_take_each_job_exactly_once(open_store: Any, store_kind: str) -> None:
    store = open_store()
    others = [open_store() for _ in range(2)] if store_kind == "postgresql" else []  # more replicas' pools
    for i in range(60):
        _insert(store, f"j{i:02d}")
    handles = [store, *others]
    got: list[str] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        s = handles[n % len(handles)]
        while (c := s.claim(f"r{n}", ["m"], 30)) is not None:
            with lock:
                got.append(c.job_id)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    counts = Counter(got)
    assert len(counts) == 60 and set(counts.values()) == {1}


def test_expire_removes_old_terminal_jobs(store: Any) -> None:
    _insert(store, "old")
    _insert(store, "live")
    store.update("old", status="completed")
    assert store.expire(3600, now=time.time() + 7200) == ["old"]
    assert store.get("old") is None and store.get("live") is not None
    assert store.expire(0) == []


def test_the_secret_is_the_same_for_every_handle(open_store: Any, store_kind: str) -> None:
    first = open_store()
    secret = first.secret
    if store_kind == "sqlite":
        first.close()  # one process per state directory
    assert open_store().secret == secret


def test_postgres_schema_is_versioned_and_a_newer_one_is_refused(pg_url: str, tmp_path: Path) -> None:
    import psycopg
    from omnicore.errors import ConfigError
    from omnicore.jobstore.migrations import LATEST
    from omnicore.jobstore.postgres import PostgresJobStore

    first = PostgresJobStore(pg_url, tmp_path)
    assert first.migrated_from == 0
    second = PostgresJobStore(pg_url, tmp_path)
    assert second.migrated_from == LATEST  # nothing left to apply
    with psycopg.connect(pg_url) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM omnicore_schema ORDER BY version")]
        assert versions == list(range(1, LATEST + 1))
        conn.execute("INSERT INTO omnicore_schema (version, description) VALUES (%s, 'future')", (LATEST + 1,))
    with pytest.raises(ConfigError, match="newer"):
        PostgresJobStore(pg_url, tmp_path)
    first.close()
    second.close()


def test_sqlite_store_records_its_schema_version(tmp_path: Path) -> None:
    import sqlite3

    from omnicore.server.store import SCHEMA_VERSION, JobStore

    JobStore(tmp_path).close()
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
