"""The job-store contract: what the HTTP layer and the job manager need from wherever jobs are kept.

Two implementations keep it: :class:`omnicore.server.store.JobStore` (SQLite in the state directory, one server,
the default) and :class:`omnicore.jobstore.postgres.PostgresJobStore` (one database shared by several replicas).
The same contract tests run against both (``tests/replicas/test_store_contract.py``).

Leases are part of the contract. A replica *claims* a queued job (:meth:`JobStoreProtocol.claim`), which hands it a
**fencing token** (a number that grows with every claim of that job); it renews the lease while it works and passes
the token with every write (``update(..., fence=token)``). A write whose token is no longer the job's current one
raises :class:`LeaseLost`: a replica that froze past its lease and came back cannot overwrite the work of the
replica that re-claimed the job, so a job completes exactly once.

Step checkpoints (``--checkpoint-every K``) follow the same rule: the holder writes the files under a name carrying
its token (``checkpoint_stem``) and records them with ``set_checkpoint(job, token, path, step)``, which is fenced;
the next claim reads ``get_checkpoint`` and resumes from there.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

TERMINAL = ("completed", "failed", "cancelled")
ACTIVE = ("queued", "in_progress")


class LeaseLost(Exception):
    """A fenced write came from a holder whose lease is gone (expired and re-claimed, or the job was cancelled)."""

    def __init__(self, job_id: str, token: int, current: int | None) -> None:
        super().__init__(f"job {job_id}: lease token {token} is stale (current {current}); the write was rejected")
        self.job_id = job_id
        self.token = token
        self.current = current


class DuplicateKey(Exception):
    """An insert hit a unique key another job holds (two requests raced with one ``Idempotency-Key``)."""


@attrs.frozen
class Claim:
    """A job this replica now holds: its id, the fencing token of this claim, how many times it was claimed
    (``claims > 1``: another holder's lease expired) and its status when claimed (``in_progress`` on a re-claim)."""

    job_id: str
    token: int
    claims: int
    status: str


@attrs.frozen
class Renewal:
    """What a lease renewal learned: whether another replica asked the job to stop (cancel or DELETE)."""

    cancel_requested: bool
    delete_pending: bool


@runtime_checkable
class JobStoreProtocol(Protocol):
    """Records of video jobs plus their input and result files. Thread-safe; every call is one short transaction.

    ``shared`` says whether several replicas use the store at once: then the job manager claims work with leases
    instead of running every job it accepts, and a restart does not fail the ``in_progress`` jobs (their holders
    may be alive; an expired lease returns them to the queue).
    """

    shared: bool
    secret: bytes

    # files
    def inputs_dir(self, job_id: str) -> Path: ...
    def remove_inputs(self, job_id: str) -> None: ...
    def result_path(self, job_id: str, ext: str) -> Path: ...
    def write_result(self, job_id: str, ext: str, write: Callable[[Path], Any]) -> Path: ...
    def checkpoint_stem(self, job_id: str, token: int, step: int) -> Path: ...
    def remove_checkpoints(self, job_id: str, token: int | None = None, keep: Path | None = None) -> None: ...

    # records
    def insert(self, record: dict[str, Any], request: dict[str, Any], *, kind: str = "video",
               idempotency_key: str | None = None, body_hash: str | None = None,
               owner: str | None = None) -> None: ...
    def get_owner(self, job_id: str) -> tuple[bool, str | None]: ...
    def get(self, job_id: str) -> dict[str, Any] | None: ...
    def get_request(self, job_id: str) -> dict[str, Any] | None: ...
    def get_result_path(self, job_id: str) -> Path | None: ...
    def update(self, job_id: str, *, result_path: Path | None = None, fence: int | None = None,
               **changes: Any) -> dict[str, Any] | None: ...
    def mark_delete_pending(self, job_id: str) -> None: ...
    def delete_pending(self, job_id: str) -> bool: ...
    def delete(self, job_id: str) -> bool: ...
    def find_idempotent(self, key: str) -> tuple[str, str | None] | None: ...
    def list(self, *, after: str | None = None, limit: int = 20, order: str = "desc", status: str | None = None,
             kind: str = "video", owner: str | None = None,
             all_owners: bool = True) -> tuple[builtins.list[dict[str, Any]], bool]: ...
    def ids_with_status(self, *statuses: str) -> builtins.list[str]: ...

    # leases
    def claim(self, holder: str, models: Sequence[str], lease_s: float) -> Claim | None: ...
    def renew(self, job_id: str, token: int, lease_s: float) -> Renewal | None: ...
    def release(self, job_id: str, token: int) -> bool: ...
    def cancel_unheld(self, job_id: str, error: dict[str, str]) -> dict[str, Any] | None: ...
    def set_checkpoint(self, job_id: str, token: int, path: Path, step: int) -> None: ...
    def get_checkpoint(self, job_id: str) -> tuple[Path, int] | None: ...
    def queue_position(self, job_id: str) -> int | None: ...
    def mean_run_s(self, model: str, last: int = 20) -> float | None: ...

    # restart and retention
    def recover(self, served_models: tuple[str, ...]) -> builtins.list[str]: ...
    def expire(self, ttl_s: float, now: float | None = None) -> builtins.list[str]: ...
    def close(self) -> None: ...
