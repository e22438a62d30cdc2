"""``queue_position`` and ``eta_s`` of a job's status, on every replica.

``queue_position`` counts the queued jobs of the same model ahead of this one (from the shared store when replicas
share one, else from this server's own queue). ``eta_s`` is an estimate of the seconds until the job completes,
from measured times: for a running job, the time its completed steps took per step times the steps left; for a
queued job, the mean running time of the model's recent jobs times the rounds of work ahead of it (jobs ahead
divided by the replicas working, plus its own). ``None`` until something was measured.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import ServerContext


def running_eta(record: dict[str, Any], now: float | None = None) -> float | None:
    """Seconds left of a running job, from its own measured steps (``None`` before its first step)."""
    step, total, started = record.get("step"), record.get("total_steps"), record.get("started_at")
    if not step or not total or not started:
        return None
    elapsed = max(0.0, (time.time() if now is None else now) - float(started))
    return round(elapsed / step * max(0, total - step), 1)


def queued_eta(position: int, mean_run_s: float | None, workers: int) -> float | None:
    if mean_run_s is None:
        return None
    return round((position // max(1, workers) + 1) * mean_run_s, 1)


def with_queue_info(ctx: ServerContext, record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with ``queue_position`` (queued jobs) and ``eta_s`` (active jobs) filled in."""
    status = record.get("status")
    if status not in ("queued", "in_progress"):
        return record
    shared = bool(getattr(ctx.store, "shared", False))
    if status == "in_progress":
        return dict(record, eta_s=running_eta(record))
    if shared:
        position = ctx.store.queue_position(record["id"])
        workers = ctx.store.workers()
    else:
        position = ctx.jobs.queue_position(record["id"]) if ctx.jobs is not None else None
        workers = 1
    mean = ctx.store.mean_run_s(record.get("model", ""))
    eta = queued_eta(position, mean, workers) if position is not None else None
    return dict(record, queue_position=position, eta_s=eta)
