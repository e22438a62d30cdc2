"""Job stores behind one contract: SQLite for one server (the default), PostgreSQL for several replicas.

:func:`open_store` picks the implementation from ``--store``: unset (or ``sqlite``) keeps today's store in the
state directory; ``postgresql://...`` opens the shared store, with inputs and results under ``--storage-url``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import ACTIVE, TERMINAL, Claim, DuplicateKey, JobStoreProtocol, LeaseLost, Renewal

__all__ = ["ACTIVE", "TERMINAL", "Claim", "DuplicateKey", "JobStoreProtocol", "LeaseLost", "Renewal", "open_store"]


def open_store(store: str | None, state_dir: str | Path, storage_url: str | None = None) -> Any:
    """The job store ``store`` names (``None``/``"sqlite"``: SQLite in ``state_dir``; ``postgresql://...``:
    the shared store, files under ``storage_url``, default ``state_dir``)."""
    from ..errors import ConfigError

    if not store or store == "sqlite":
        from ..server.store import JobStore

        return JobStore(state_dir)
    if store.startswith(("postgresql://", "postgres://")):
        from .postgres import PostgresJobStore

        return PostgresJobStore(store, storage_url or str(state_dir))
    raise ConfigError("store", f"{store!r} is not a job store: use sqlite (the default) or postgresql://...")
