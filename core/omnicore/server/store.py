"""Durable job store: SQLite (WAL) for records, plain files for inputs and results.

A job record is the API Job object (a JSON document) plus a few indexed columns. Results are written to a
temporary file, flushed, fsynced and renamed into place *before* the record says ``completed``, so a
completed job always has content. On open, :meth:`JobStore.recover` applies the restart table: jobs that
were ``in_progress`` become ``failed`` (``interrupted``); queued jobs are handed back for re-enqueueing.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..jobstore.base import Claim, DuplicateKey, LeaseLost, Renewal
from ..jobstore.storage import checkpoint_stem, remove_checkpoints

TERMINAL = ("completed", "failed", "cancelled")
ACTIVE = ("queued", "in_progress")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    model TEXT NOT NULL,
    created_at REAL NOT NULL,
    finished_at REAL,
    record TEXT NOT NULL,
    request TEXT NOT NULL,
    idempotency_key TEXT UNIQUE,
    body_hash TEXT,
    result_path TEXT,
    delete_pending INTEGER NOT NULL DEFAULT 0,
    owner TEXT
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status);
"""

#: Columns added after the first release, with their definitions: :meth:`JobStore._migrate` adds the ones an
#: older database lacks. ``owner`` is the key id (``auth.key_id``) of the API key that created the job; rows
#: written before it existed, or while auth was off, have ``NULL``: with keys set only admin keys see them.
_ADDED_COLUMNS = (("owner", "TEXT"), ("lease_owner", "TEXT"), ("lease_token", "INTEGER NOT NULL DEFAULT 0"),
                  ("lease_expires", "REAL"), ("claims", "INTEGER NOT NULL DEFAULT 0"), ("checkpoint_path", "TEXT"),
                  ("checkpoint_step", "INTEGER"))
#: ``PRAGMA user_version`` of a store written by this code: 1 = the first release, 2 = owners, 3 = leases (the
#: job-store contract of :mod:`omnicore.jobstore`) and step checkpoints.
SCHEMA_VERSION = 3


class StateDirLocked(ConfigError):
    """Another live process (another ``omnicore serve``) holds the state directory."""


def _lock_state_dir(root: Path) -> Any:
    """Take an exclusive, non-blocking lock on ``root/lock`` for the life of the process (released on close
    or exit); two servers on one state dir would recover, re-run and orphan each other's jobs."""
    fh = open(root / "lock", "a+")  # noqa: SIM115 - held open while the store lives
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no advisory locks
        return fh
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        owner = fh.read().strip() or "unknown"
        fh.close()
        raise StateDirLocked("state_dir", f"{root} is in use by another omnicore server (pid {owner}); stop it or "
                                          "give this server its own --storage-dir") from None
    fh.seek(0)
    fh.truncate()
    fh.write(str(os.getpid()))
    fh.flush()
    return fh


def _remove_partials(results: Path) -> list[str]:
    """Delete temporary result files (``.<name>.<rand>.part`` / ``.<name>.tmp``) a crash left behind."""
    removed = []
    for path in results.glob(".*"):
        if path.is_file() and (path.name.endswith(".part") or path.name.endswith(".tmp")):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def _load_secret(path: Path) -> bytes:
    """The state directory's random secret for key ids (created once, mode 0600): ids stay stable across
    restarts, and without this file a key id cannot be matched against guessed keys."""
    try:
        data = path.read_bytes()
        if len(data) >= 32:
            return data
    except FileNotFoundError:
        pass
    data = os.urandom(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return data


class JobStore:
    """Thread-safe: one connection guarded by a lock; every call is a short transaction.

    Keeps the :class:`omnicore.jobstore.base.JobStoreProtocol` contract, leases included, for one server: it is
    not ``shared`` (the state directory is locked to one process), so the job manager runs what it accepts and
    the restart table applies."""

    shared = False

    def __init__(self, state_dir: str | Path) -> None:
        self.root = Path(state_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock_state_dir(self.root)  # one server per state dir: before anything is touched
        (self.root / "results").mkdir(exist_ok=True)
        (self.root / "inputs").mkdir(exist_ok=True)
        self.removed_partials = _remove_partials(self.root / "results")  # left by a crash mid-write
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.root / "jobs.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._migrate()
        self._db.execute("CREATE INDEX IF NOT EXISTS jobs_owner ON jobs(owner)")
        self.secret = _load_secret(self.root / "key_id_secret")
        self._closed = False

    def _migrate(self) -> None:
        """Bring a store written by an older version up to :data:`_SCHEMA` (columns are only ever added)."""
        have = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for name, decl in _ADDED_COLUMNS:
            if name not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {decl}")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise ConfigError("state_dir", f"{self.root} holds a job store of schema version {version}, newer than "
                                           f"this omnicore knows ({SCHEMA_VERSION}); upgrade omnicore")
        self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # ------------------------------------------------------------------ plumbing
    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the job store is closed")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        """Checkpoint the WAL into the main file and close (graceful shutdown flushes the store)."""
        with self._lock:
            if self._closed:
                return
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:  # e.g. a full disk: the WAL stays and SQLite replays it on the next open
                pass
            finally:
                self._db.close()
                self._closed = True
                self._lock_file.close()  # releases the state-dir lock

    # ------------------------------------------------------------------ files
    def inputs_dir(self, job_id: str) -> Path:
        path = self.root / "inputs" / job_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    def remove_inputs(self, job_id: str) -> None:
        """Remove a job's stored uploads (a submission that was not accepted leaves nothing behind)."""
        shutil.rmtree(self.root / "inputs" / job_id, ignore_errors=True)

    def result_path(self, job_id: str, ext: str) -> Path:
        return self.root / "results" / f"{job_id}.{ext}"

    def write_result(self, job_id: str, ext: str, write: Callable[[Path], Any]) -> Path:
        """Atomically create the result: ``write(tmp_path)`` fills a temp file, which is fsynced and renamed."""
        final = self.result_path(job_id, ext)
        tmp = final.with_name(f".{final.name}.tmp")
        write(tmp)
        with open(tmp, "rb+") as fh:
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        return final

    def checkpoint_stem(self, job_id: str, token: int, step: int) -> Path:
        return checkpoint_stem(self.root, job_id, token, step)

    def remove_checkpoints(self, job_id: str, token: int | None = None, keep: Path | None = None) -> None:
        remove_checkpoints(self.root, job_id, token, keep)

    # ------------------------------------------------------------------ records
    def insert(self, record: dict[str, Any], request: dict[str, Any], *, kind: str = "video",
               idempotency_key: str | None = None, body_hash: str | None = None, owner: str | None = None) -> None:
        try:
            with self._tx() as db:
                db.execute(
                    "INSERT INTO jobs (id, kind, status, model, created_at, record, request, idempotency_key,"
                    " body_hash, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (record["id"], kind, record["status"], record.get("model", ""), time.time(),
                     json.dumps(record), json.dumps(request), idempotency_key, body_hash, owner),
                )
        except sqlite3.IntegrityError as exc:  # the contract's error, whichever store
            raise DuplicateKey(str(exc)) from None

    def get_owner(self, job_id: str) -> tuple[bool, str | None]:
        """``(exists, owner key id)`` of a job (owner ``None`` for jobs created without a key)."""
        with self._lock:
            row = self._db.execute("SELECT owner FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return (row is not None, row[0] if row else None)

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT record FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def get_request(self, job_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT request FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def get_result_path(self, job_id: str) -> Path | None:
        with self._lock:
            row = self._db.execute("SELECT result_path FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return Path(row[0]) if row and row[0] else None

    def update(self, job_id: str, *, result_path: Path | None = None, fence: int | None = None,
               **changes: Any) -> dict[str, Any] | None:
        """Merge ``changes`` into the record. A terminal status is never overwritten (status only moves forward);
        with ``fence``, nothing is written unless it is the job's current lease token (else :class:`LeaseLost`)."""
        with self._tx() as db:
            row = db.execute("SELECT record, lease_token FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            if fence is not None and int(row[1]) != fence:
                raise LeaseLost(job_id, fence, int(row[1]))
            record = json.loads(row[0])
            if record["status"] in TERMINAL and changes.get("status", record["status"]) != record["status"]:
                return record
            record.update(changes)
            finished = time.time() if record["status"] in TERMINAL else None
            db.execute(
                "UPDATE jobs SET record = ?, status = ?, finished_at = COALESCE(finished_at, ?),"
                " result_path = COALESCE(?, result_path),"
                " lease_owner = CASE WHEN ? THEN NULL ELSE lease_owner END,"
                " lease_expires = CASE WHEN ? THEN NULL ELSE lease_expires END WHERE id = ?",
                (json.dumps(record), record["status"], finished,
                 str(result_path) if result_path else None, finished is not None, finished is not None, job_id),
            )
            return record

    def set_checkpoint(self, job_id: str, token: int, path: Path, step: int) -> None:
        """Record the job's latest step checkpoint, fenced by lease ``token`` (else :class:`LeaseLost`)."""
        with self._tx() as db:
            row = db.execute("SELECT lease_token, status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or int(row[0]) != token or row[1] in TERMINAL:
                raise LeaseLost(job_id, token, int(row[0]) if row else None)
            db.execute("UPDATE jobs SET checkpoint_path = ?, checkpoint_step = ? WHERE id = ?",
                       (str(path), int(step), job_id))

    def get_checkpoint(self, job_id: str) -> tuple[Path, int] | None:
        """``(path of its JSON, step)`` of the job's latest step checkpoint, or ``None``."""
        with self._lock:
            row = self._db.execute("SELECT checkpoint_path, checkpoint_step FROM jobs WHERE id = ?",
                                   (job_id,)).fetchone()
        return (Path(row[0]), int(row[1])) if row and row[0] and row[1] is not None else None

    def mark_delete_pending(self, job_id: str) -> None:
        with self._tx() as db:
            db.execute("UPDATE jobs SET delete_pending = 1 WHERE id = ?", (job_id,))

    def delete_pending(self, job_id: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT delete_pending FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return bool(row and row[0])

    def delete(self, job_id: str) -> bool:
        """Remove the record, its inputs and its results together."""
        with self._tx() as db:
            row = db.execute("SELECT result_path FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return False
            db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        if row[0]:
            Path(row[0]).unlink(missing_ok=True)
        for path in (self.root / "results").glob(f"{job_id}.*"):  # results of earlier claims (fenced names)
            path.unlink(missing_ok=True)
        shutil.rmtree(self.root / "inputs" / job_id, ignore_errors=True)
        remove_checkpoints(self.root, job_id)
        return True

    def find_idempotent(self, key: str) -> tuple[str, str | None] | None:
        with self._lock:
            row = self._db.execute("SELECT id, body_hash FROM jobs WHERE idempotency_key = ?", (key,)).fetchone()
        return (row[0], row[1]) if row else None

    def list(self, *, after: str | None = None, limit: int = 20, order: str = "desc",
             status: str | None = None, kind: str = "video", owner: str | None = None,
             all_owners: bool = True) -> tuple[list[dict[str, Any]], bool]:
        """One page of records and whether more follow. ``after`` is the id of the previous page's last item.

        Unless ``all_owners``, only jobs whose owner is ``owner`` are listed (and ``after`` must be one of them)."""
        desc = order == "desc"
        where: builtins.list[str] = ["kind = ?"]
        args: builtins.list[Any] = [kind]
        if not all_owners:
            where.append("owner = ?")
            args.append(owner)
        with self._lock:
            if after:
                row = self._db.execute(f"SELECT seq FROM jobs WHERE id = ? AND {' AND '.join(where)}",
                                       (after, *args)).fetchone()
                if row is None:
                    return [], False
                where.append("seq < ?" if desc else "seq > ?")
                args.append(row[0])
            if status:
                where.append("status = ?")
                args.append(status)
            rows = self._db.execute(
                f"SELECT record FROM jobs WHERE {' AND '.join(where)} ORDER BY seq {'DESC' if desc else 'ASC'}"
                " LIMIT ?", (*args, limit + 1),
            ).fetchall()
        records = [json.loads(r[0]) for r in rows]
        return records[:limit], len(records) > limit

    def ids_with_status(self, *statuses: str) -> builtins.list[str]:
        marks = ",".join("?" * len(statuses))
        with self._lock:
            rows = self._db.execute(f"SELECT id FROM jobs WHERE status IN ({marks}) ORDER BY seq", statuses).fetchall()
        return [r[0] for r in rows]

    # ------------------------------------------------------------------ leases (see omnicore.jobstore.base)
    def claim(self, holder: str, models: Sequence[str], lease_s: float) -> Claim | None:
        """Take the oldest job for ``models`` nobody holds (queued and unleased, or active with an expired lease)."""
        now = time.time()
        marks = ",".join("?" * len(models)) or "NULL"
        with self._tx() as db:
            row = db.execute(
                f"SELECT seq FROM jobs WHERE status IN ('queued', 'in_progress') AND model IN ({marks})"
                " AND delete_pending = 0 AND (lease_expires IS NULL AND status = 'queued' OR lease_expires < ?)"
                " ORDER BY seq LIMIT 1", (*models, now)).fetchone()
            if row is None:
                return None
            db.execute("UPDATE jobs SET lease_owner = ?, lease_token = lease_token + 1, claims = claims + 1,"
                       " lease_expires = ? WHERE seq = ?", (holder, now + lease_s, row[0]))
            got = db.execute("SELECT id, lease_token, claims, status FROM jobs WHERE seq = ?", (row[0],)).fetchone()
        return Claim(got[0], int(got[1]), int(got[2]), got[3])

    def renew(self, job_id: str, token: int, lease_s: float) -> Renewal | None:
        with self._tx() as db:
            row = db.execute("SELECT record, delete_pending FROM jobs WHERE id = ? AND lease_token = ? AND status"
                             " IN ('queued', 'in_progress')", (job_id, token)).fetchone()
            if row is None:
                return None
            db.execute("UPDATE jobs SET lease_expires = ? WHERE id = ?", (time.time() + lease_s, job_id))
        return Renewal(bool(json.loads(row[0]).get("cancel_requested")), bool(row[1]))

    def release(self, job_id: str, token: int) -> bool:
        """Give a held job back to the queue unfinished: status ``queued``, no lease."""
        with self._tx() as db:
            row = db.execute("SELECT record FROM jobs WHERE id = ? AND lease_token = ? AND status IN"
                             " ('queued', 'in_progress')", (job_id, token)).fetchone()
            if row is None:
                return False
            record = {**json.loads(row[0]), "status": "queued", "phase": "queued", "cancel_requested": False}
            db.execute("UPDATE jobs SET lease_owner = NULL, lease_expires = NULL, status = 'queued', record = ?"
                       " WHERE id = ?", (json.dumps(record), job_id))
        return True

    def cancel_unheld(self, job_id: str, error: dict[str, str]) -> dict[str, Any] | None:
        """Cancel a job no live lease holds and bump its token; ``None`` when a live holder has it."""
        now = time.time()
        with self._tx() as db:
            row = db.execute("SELECT record FROM jobs WHERE id = ? AND status IN ('queued', 'in_progress') AND"
                             " (lease_expires IS NULL OR lease_expires < ?)", (job_id, now)).fetchone()
            if row is None:
                return None
            record = {**json.loads(row[0]), "status": "cancelled", "error": error, "updated_at": int(now),
                      "queue_position": None, "cancel_requested": False, "phase": None, "phase_progress": None}
            db.execute("UPDATE jobs SET status = 'cancelled', record = ?, finished_at = ?, lease_owner = NULL,"
                       " lease_expires = NULL, lease_token = lease_token + 1 WHERE id = ?",
                       (json.dumps(record), now, job_id))
        return record

    def queue_position(self, job_id: str) -> int | None:
        with self._lock:
            row = self._db.execute(
                "SELECT (SELECT count(*) FROM jobs o WHERE o.status = 'queued' AND o.model = j.model AND"
                " o.seq < j.seq AND o.delete_pending = 0) FROM jobs j WHERE j.id = ? AND j.status = 'queued'",
                (job_id,)).fetchone()
        return int(row[0]) if row else None

    def workers(self) -> int:
        """How many distinct holders have a live lease now, at least 1."""
        with self._lock:
            row = self._db.execute("SELECT count(DISTINCT lease_owner) FROM jobs WHERE lease_expires > ?",
                                   (time.time(),)).fetchone()
        return max(1, int(row[0]))

    def mean_run_s(self, model: str, last: int = 20) -> float | None:
        """Mean running time (total less queued) of the last ``last`` completed jobs of ``model``."""
        with self._lock:
            row = self._db.execute(
                "SELECT avg(json_extract(record, '$.timings.total_s') - json_extract(record, '$.timings.queued_s'))"
                " FROM (SELECT record FROM jobs WHERE status = 'completed' AND model = ? AND"
                " json_extract(record, '$.timings.total_s') IS NOT NULL ORDER BY seq DESC LIMIT ?)",
                (model, last)).fetchone()
        return float(row[0]) if row and row[0] is not None else None

    def lease_of(self, job_id: str) -> tuple[str | None, int, int] | None:
        """``(holder, token, claims)`` of a job (tests and diagnostics)."""
        with self._lock:
            row = self._db.execute("SELECT lease_owner, lease_token, claims FROM jobs WHERE id = ?",
                                   (job_id,)).fetchone()
        return (row[0], int(row[1]), int(row[2])) if row else None

    # ------------------------------------------------------------------ restart and retention
    def recover(self, served_models: tuple[str, ...]) -> builtins.list[str]:
        """Apply the restart table; return the ids of queued jobs to re-enqueue, oldest first.

        ``in_progress`` -> ``failed`` (``interrupted``); ``queued`` for another model -> ``failed``
        (``model_changed``); ``completed`` without its result file -> ``failed`` (``content_missing``).
        """
        now = int(time.time())
        for job_id in self.ids_with_status("in_progress"):
            self.update(job_id, status="failed", phase=None, completed_at=None, updated_at=now,
                        queue_position=None, cancel_requested=False,
                        error={"code": "interrupted",
                               "message": "the server stopped while this job was running; it was not resumed"})
        requeue: builtins.list[str] = []
        for job_id in self.ids_with_status("queued"):
            record = self.get(job_id) or {}
            if record.get("model") not in served_models:
                self.update(job_id, status="failed", updated_at=now, queue_position=None,
                            error={"code": "model_changed",
                                   "message": f"queued for model {record.get('model')!r}, but the server now "
                                              f"serves {served_models[0] if served_models else None!r}"})
            else:
                requeue.append(job_id)
        for job_id in self.ids_with_status("completed"):
            path = self.get_result_path(job_id)
            if path is None or not path.exists():
                self.update(job_id, status="failed", updated_at=now,
                            error={"code": "content_missing", "message": "the result file is missing from the "
                                                                          "state directory"})
        for job_id in self._delete_pending_terminal():
            self.delete(job_id)
        return requeue

    def _delete_pending_terminal(self) -> builtins.list[str]:
        with self._lock:
            rows = self._db.execute("SELECT id FROM jobs WHERE delete_pending = 1 AND status IN (?, ?, ?)",
                                    TERMINAL).fetchall()
        return [r[0] for r in rows]

    def expire(self, ttl_s: float, now: float | None = None) -> builtins.list[str]:
        """Delete terminal jobs finished more than ``ttl_s`` ago (0 keeps everything)."""
        if ttl_s <= 0:
            return []
        cutoff = (time.time() if now is None else now) - ttl_s
        with self._lock:
            rows = self._db.execute("SELECT id FROM jobs WHERE finished_at IS NOT NULL AND finished_at < ?",
                                    (cutoff,)).fetchall()
        ids = [r[0] for r in rows]
        for job_id in ids:
            self.delete(job_id)
        return ids
