"""The PostgreSQL job store: one database that several ``omnicore serve`` replicas share.

Records live in one ``jobs`` table (the API Job object as JSONB plus indexed columns, schema in
:mod:`.migrations`); inputs and results live in a :class:`~.storage.SharedStorage` directory. Every call is one
short transaction on a pooled connection (psycopg 3 + psycopg_pool). Claiming uses ``SELECT ... FOR UPDATE SKIP
LOCKED``, so replicas polling at once never block each other or take the same job; lease expiry is judged by the
database's clock, so replicas need not agree on the time. Writes carrying a fencing token are applied only while
the token is the job's current one (a single ``UPDATE ... WHERE lease_token = %s``), else :class:`LeaseLost`.
"""

from __future__ import annotations

import builtins
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .base import TERMINAL, Claim, DuplicateKey, LeaseLost, Renewal
from .migrations import migrate
from .storage import SharedStorage

_T = list(TERMINAL)


class PostgresJobStore:
    """``PostgresJobStore("postgresql://user@host/db", storage_url="file:///shared/dir")``."""

    shared = True

    def __init__(self, url: str, storage_url: str | Path, *, min_size: int = 1, max_size: int = 8) -> None:
        try:
            import psycopg  # noqa: F401
            from psycopg_pool import ConnectionPool
        except ImportError:
            raise ConfigError("store", "a postgresql:// store needs psycopg 3 and psycopg_pool; install them with: "
                                       "pip install 'omnicore[postgres]'") from None
        self.url = url
        self.storage = SharedStorage(storage_url)
        self.root = self.storage.root
        self.removed_partials: list[str] = []
        from psycopg.rows import tuple_row

        self._pool = ConnectionPool(url, min_size=min_size, max_size=max_size, open=False,
                                    kwargs={"autocommit": True, "row_factory": tuple_row})
        try:
            self._pool.open(wait=True, timeout=30)
        except Exception as exc:
            self._pool.close()
            raise ConfigError("store", f"cannot connect to {_redact(url)}: {exc}") from None
        with self._pool.connection() as conn:
            self.migrated_from = migrate(conn)
        self.secret = self._load_secret()
        self._closed = False

    # ------------------------------------------------------------------ plumbing
    def _one(self, sql: str, args: Sequence[Any] = ()) -> Any:
        with self._pool.connection() as conn:
            cur = conn.execute(sql, args)
            return cur.fetchone() if cur.description is not None else None

    def _all(self, sql: str, args: Sequence[Any] = ()) -> builtins.list[Any]:
        with self._pool.connection() as conn:
            return conn.execute(sql, args).fetchall()

    def _load_secret(self) -> bytes:
        """The key-id secret, shared by every replica (so a key has one id wherever it calls)."""
        self._one("INSERT INTO store_meta (key, value) VALUES ('key_id_secret', %s) ON CONFLICT DO NOTHING",
                  (os.urandom(32),))
        return bytes(self._one("SELECT value FROM store_meta WHERE key = 'key_id_secret'")[0])

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.close()

    # ------------------------------------------------------------------ files
    def inputs_dir(self, job_id: str) -> Path:
        return self.storage.inputs_dir(job_id)

    def remove_inputs(self, job_id: str) -> None:
        self.storage.remove_inputs(job_id)

    def result_path(self, job_id: str, ext: str) -> Path:
        return self.storage.result_path(job_id, ext)

    def write_result(self, job_id: str, ext: str, write: Callable[[Path], Any]) -> Path:
        return self.storage.write_result(job_id, ext, write)

    def checkpoint_stem(self, job_id: str, token: int, step: int) -> Path:
        return self.storage.checkpoint_stem(job_id, token, step)

    def remove_checkpoints(self, job_id: str, token: int | None = None, keep: Path | None = None) -> None:
        self.storage.remove_checkpoints(job_id, token, keep)

    # ------------------------------------------------------------------ records
    def insert(self, record: dict[str, Any], request: dict[str, Any], *, kind: str = "video",
               idempotency_key: str | None = None, body_hash: str | None = None, owner: str | None = None) -> None:
        from psycopg import errors
        from psycopg.types.json import Jsonb

        try:
            self._one("INSERT INTO jobs (id, kind, status, model, created_at, record, request, idempotency_key,"
                      " body_hash, owner) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING seq",
                      (record["id"], kind, record["status"], record.get("model", ""), time.time(), Jsonb(record),
                       Jsonb(request), idempotency_key, body_hash, owner))
        except errors.UniqueViolation as exc:
            raise DuplicateKey(str(exc)) from None

    def get_owner(self, job_id: str) -> tuple[bool, str | None]:
        row = self._one("SELECT owner FROM jobs WHERE id = %s", (job_id,))
        return (row is not None, row[0] if row else None)

    def get(self, job_id: str) -> dict[str, Any] | None:
        row = self._one("SELECT record FROM jobs WHERE id = %s", (job_id,))
        return dict(row[0]) if row else None

    def get_request(self, job_id: str) -> dict[str, Any] | None:
        row = self._one("SELECT request FROM jobs WHERE id = %s", (job_id,))
        return dict(row[0]) if row else None

    def get_result_path(self, job_id: str) -> Path | None:
        row = self._one("SELECT result_path FROM jobs WHERE id = %s", (job_id,))
        return Path(row[0]) if row and row[0] else None

    def update(self, job_id: str, *, result_path: Path | None = None, fence: int | None = None,
               **changes: Any) -> dict[str, Any] | None:
        """Merge ``changes`` into the record in one statement. A terminal status is never replaced by another;
        with ``fence``, nothing is written unless it is the job's current lease token (else :class:`LeaseLost`)."""
        from psycopg.types.json import Jsonb

        status = changes.get("status")
        terminal = status in TERMINAL
        row = self._one(
            "UPDATE jobs SET record = record || %s, status = COALESCE(%s, status),"
            " finished_at = CASE WHEN %s THEN COALESCE(finished_at, %s) ELSE finished_at END,"
            " result_path = COALESCE(%s, result_path),"
            " lease_owner = CASE WHEN %s THEN NULL ELSE lease_owner END,"
            " lease_expires = CASE WHEN %s THEN NULL ELSE lease_expires END"
            " WHERE id = %s AND (status <> ALL(%s) OR status = COALESCE(%s, status))"
            " AND (%s::bigint IS NULL OR lease_token = %s) RETURNING record",
            (Jsonb(changes), status, terminal, time.time(), str(result_path) if result_path else None, terminal,
             terminal, job_id, _T, status, fence, fence))
        if row is not None:
            return dict(row[0])
        now = self._one("SELECT record, lease_token FROM jobs WHERE id = %s", (job_id,))
        if now is None:
            return None
        if fence is not None and int(now[1]) != fence:
            raise LeaseLost(job_id, fence, int(now[1]))
        return dict(now[0])  # terminal already: unchanged

    def set_checkpoint(self, job_id: str, token: int, path: Path, step: int) -> None:
        """Record the job's latest step checkpoint, fenced: only the holder of lease ``token`` of an unfinished job
        may (else :class:`LeaseLost`, and the caller removes the files it wrote)."""
        row = self._one("UPDATE jobs SET checkpoint_path = %s, checkpoint_step = %s WHERE id = %s AND lease_token = %s"
                        " AND status <> ALL(%s) RETURNING id", (str(path), int(step), job_id, token, _T))
        if row is None:
            now = self._one("SELECT lease_token FROM jobs WHERE id = %s", (job_id,))
            raise LeaseLost(job_id, token, int(now[0]) if now else None)

    def get_checkpoint(self, job_id: str) -> tuple[Path, int] | None:
        """``(path of its JSON, step)`` of the job's latest step checkpoint, or ``None``."""
        row = self._one("SELECT checkpoint_path, checkpoint_step FROM jobs WHERE id = %s", (job_id,))
        return (Path(row[0]), int(row[1])) if row and row[0] and row[1] is not None else None

    def mark_delete_pending(self, job_id: str) -> None:
        self._one("UPDATE jobs SET delete_pending = TRUE WHERE id = %s RETURNING id", (job_id,))

    def delete_pending(self, job_id: str) -> bool:
        row = self._one("SELECT delete_pending FROM jobs WHERE id = %s", (job_id,))
        return bool(row and row[0])

    def delete(self, job_id: str) -> bool:
        row = self._one("DELETE FROM jobs WHERE id = %s RETURNING result_path", (job_id,))
        if row is None:
            return False
        self.storage.remove_results(job_id)
        self.storage.remove_inputs(job_id)
        self.storage.remove_checkpoints(job_id)
        return True

    def find_idempotent(self, key: str) -> tuple[str, str | None] | None:
        row = self._one("SELECT id, body_hash FROM jobs WHERE idempotency_key = %s", (key,))
        return (row[0], row[1]) if row else None

    def list(self, *, after: str | None = None, limit: int = 20, order: str = "desc",
             status: str | None = None, kind: str = "video", owner: str | None = None,
             all_owners: bool = True) -> tuple[builtins.list[dict[str, Any]], bool]:
        desc = order == "desc"
        where: builtins.list[str] = ["kind = %s"]
        args: builtins.list[Any] = [kind]
        if not all_owners:
            where.append("owner IS NOT DISTINCT FROM %s")
            args.append(owner)
        if after:
            row = self._one(f"SELECT seq FROM jobs WHERE id = %s AND {' AND '.join(where)}", (after, *args))
            if row is None:
                return [], False
            where.append("seq < %s" if desc else "seq > %s")
            args.append(row[0])
        if status:
            where.append("status = %s")
            args.append(status)
        rows = self._all(f"SELECT record FROM jobs WHERE {' AND '.join(where)} ORDER BY seq "
                         f"{'DESC' if desc else 'ASC'} LIMIT %s", (*args, limit + 1))
        records = [dict(r[0]) for r in rows]
        return records[:limit], len(records) > limit

    def ids_with_status(self, *statuses: str) -> builtins.list[str]:
        return [r[0] for r in self._all("SELECT id FROM jobs WHERE status = ANY(%s) ORDER BY seq", (list(statuses),))]

    # ------------------------------------------------------------------ leases
    def claim(self, holder: str, models: Sequence[str], lease_s: float) -> Claim | None:
        """Take the oldest job for ``models`` that nobody holds (queued and unleased, or any active job whose
        lease expired); the claim bumps its fencing token."""
        row = self._one(
            "WITH c AS (SELECT seq FROM jobs WHERE status IN ('queued', 'in_progress') AND model = ANY(%s)"
            " AND NOT delete_pending AND (lease_expires IS NULL AND status = 'queued' OR lease_expires < now())"
            " ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED)"
            " UPDATE jobs j SET lease_owner = %s, lease_token = j.lease_token + 1, claims = j.claims + 1,"
            " lease_expires = now() + make_interval(secs => %s) FROM c WHERE j.seq = c.seq"
            " RETURNING j.id, j.lease_token, j.claims, j.status",
            (list(models), holder, float(lease_s)))
        return Claim(row[0], int(row[1]), int(row[2]), row[3]) if row else None

    def renew(self, job_id: str, token: int, lease_s: float) -> Renewal | None:
        row = self._one(
            "UPDATE jobs SET lease_expires = now() + make_interval(secs => %s) WHERE id = %s AND lease_token = %s"
            " AND status <> ALL(%s) RETURNING COALESCE((record->>'cancel_requested')::boolean, FALSE),"
            " delete_pending", (float(lease_s), job_id, token, _T))
        return Renewal(bool(row[0]), bool(row[1])) if row else None

    def release(self, job_id: str, token: int) -> bool:
        """Give a held job back to the queue unfinished (a draining replica): status ``queued``, no lease (and no
        ``cancel_requested``: the drain's own stop request is not the client's)."""
        from psycopg.types.json import Jsonb

        row = self._one(
            "UPDATE jobs SET lease_owner = NULL, lease_expires = NULL, status = 'queued', record = record || %s"
            " WHERE id = %s AND lease_token = %s AND status <> ALL(%s) RETURNING id",
            (Jsonb({"status": "queued", "phase": "queued", "cancel_requested": False}), job_id, token, _T))
        return row is not None

    def cancel_unheld(self, job_id: str, error: dict[str, str]) -> dict[str, Any] | None:
        """Cancel a job no replica holds (queued, or its lease expired) and bump its token, so a holder that
        comes back cannot write; ``None`` when a live holder has it (ask it through ``cancel_requested``)."""
        from psycopg.types.json import Jsonb

        now = int(time.time())
        changes = {"status": "cancelled", "error": error, "updated_at": now, "queue_position": None,
                   "cancel_requested": False, "phase": None, "phase_progress": None}
        row = self._one(
            "UPDATE jobs SET status = 'cancelled', record = record || %s, finished_at = %s, lease_owner = NULL,"
            " lease_expires = NULL, lease_token = lease_token + 1 WHERE id = %s AND status IN ('queued',"
            " 'in_progress') AND (lease_expires IS NULL OR lease_expires < now()) RETURNING record",
            (Jsonb(changes), time.time(), job_id))
        return dict(row[0]) if row else None

    def queue_position(self, job_id: str) -> int | None:
        row = self._one(
            "SELECT (SELECT count(*) FROM jobs o WHERE o.status = 'queued' AND o.model = j.model AND o.seq < j.seq"
            " AND NOT o.delete_pending) FROM jobs j WHERE j.id = %s AND j.status = 'queued'", (job_id,))
        return int(row[0]) if row else None

    def workers(self) -> int:
        """How many distinct holders have a live lease now (replicas working), at least 1."""
        row = self._one("SELECT count(DISTINCT lease_owner) FROM jobs WHERE lease_expires > now()")
        return max(1, int(row[0]))

    def mean_run_s(self, model: str, last: int = 20) -> float | None:
        row = self._one(
            "SELECT avg((record->'timings'->>'total_s')::float - (record->'timings'->>'queued_s')::float) FROM"
            " (SELECT record FROM jobs WHERE status = 'completed' AND model = %s AND record->'timings' ? 'total_s'"
            " ORDER BY seq DESC LIMIT %s) r", (model, last))
        return float(row[0]) if row and row[0] is not None else None

    def lease_of(self, job_id: str) -> tuple[str | None, int, int] | None:
        """``(holder, token, claims)`` of a job (tests and diagnostics)."""
        row = self._one("SELECT lease_owner, lease_token, claims FROM jobs WHERE id = %s", (job_id,))
        return (row[0], int(row[1]), int(row[2])) if row else None

    # ------------------------------------------------------------------ restart and retention
    def recover(self, served_models: tuple[str, ...]) -> builtins.list[str]:
        """Nothing to re-enqueue by hand: a shared store's queue is the table, and jobs whose holder died come
        back by lease expiry. Deletes that were pending on finished jobs are completed."""
        for (job_id,) in self._all("SELECT id FROM jobs WHERE delete_pending AND status = ANY(%s)", (_T,)):
            self.delete(job_id)
        return []

    def expire(self, ttl_s: float, now: float | None = None) -> builtins.list[str]:
        if ttl_s <= 0:
            return []
        cutoff = (time.time() if now is None else now) - ttl_s
        ids = [r[0] for r in self._all("SELECT id FROM jobs WHERE finished_at IS NOT NULL AND finished_at < %s",
                                       (cutoff,))]
        for job_id in ids:
            self.delete(job_id)
        return ids


def _redact(url: str) -> str:
    """``url`` without its password (error messages)."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}" if ":" in creds else url
