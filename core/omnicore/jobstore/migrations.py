"""Versioned schema of the PostgreSQL job store.

Each entry of :data:`MIGRATIONS` is applied once, in order, inside one transaction that also records its version in
``omnicore_schema``; replicas starting at the same time serialise on an advisory lock, so exactly one of them
migrates and the others see the result. A database newer than this code (a version we do not know) is refused:
an old replica must not write rows it does not understand.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError

#: (version, what it does, SQL). Append only; never edit an applied entry.
MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (1, "jobs, leases and the key-id secret", """
CREATE TABLE jobs (
    seq BIGSERIAL PRIMARY KEY,
    id TEXT UNIQUE NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    model TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    finished_at DOUBLE PRECISION,
    record JSONB NOT NULL,
    request JSONB NOT NULL,
    idempotency_key TEXT UNIQUE,
    body_hash TEXT,
    result_path TEXT,
    delete_pending BOOLEAN NOT NULL DEFAULT FALSE,
    owner TEXT,
    lease_owner TEXT,
    lease_token BIGINT NOT NULL DEFAULT 0,
    lease_expires TIMESTAMPTZ,
    claims INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX jobs_status ON jobs(status);
CREATE INDEX jobs_owner ON jobs(owner);
CREATE INDEX jobs_active ON jobs(model, seq) WHERE status IN ('queued', 'in_progress');
CREATE TABLE store_meta (key TEXT PRIMARY KEY, value BYTEA NOT NULL);
"""),
    (2, "step checkpoints: where the last one of a job is and its step", """
ALTER TABLE jobs ADD COLUMN checkpoint_path TEXT;
ALTER TABLE jobs ADD COLUMN checkpoint_step INTEGER;
"""),
)

LATEST = MIGRATIONS[-1][0]
_LOCK_KEY = 0x6F6D6E69  # "omni": the advisory lock every migrating replica takes


def migrate(conn: Any) -> int:
    """Bring the database to :data:`LATEST`; returns the version it had before. ``conn``: a psycopg connection
    outside a transaction."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        conn.execute("CREATE TABLE IF NOT EXISTS omnicore_schema (version INTEGER PRIMARY KEY, description TEXT,"
                     " applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        row = conn.execute("SELECT COALESCE(MAX(version), 0) FROM omnicore_schema").fetchone()
        have = int(row[0])
        if have > LATEST:
            raise ConfigError("store", f"the database's job-store schema is version {have}, newer than this "
                                       f"omnicore knows ({LATEST}); upgrade this replica")
        for version, description, sql in MIGRATIONS:
            if version > have:
                conn.execute(sql)
                conn.execute("INSERT INTO omnicore_schema (version, description) VALUES (%s, %s)",
                             (version, description))
    return have
