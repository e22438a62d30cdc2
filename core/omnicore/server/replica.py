"""One replica among several that share a job store (``--store postgresql://...``).

With a shared store no replica owns the queue: ``POST /v1/videos`` only records the job (``queued``) and every
replica's :class:`Claimer` pulls work for the models it serves, ``claim_slots`` jobs at a time, with
``SELECT ... FOR UPDATE SKIP LOCKED`` (:meth:`~omnicore.jobstore.base.JobStoreProtocol.claim`). A claim is a lease
renewed every third of ``--lease``; the job manager passes the claim's fencing token with every write, so a
replica that stalls past its lease (the job was re-claimed elsewhere) has each late write rejected and stops the
job. A replica that dies holds nothing once its leases expire: the next claim re-runs the job from its stored
request (same seed, so the same output).

Cross-replica cancel: DELETE or cancel on a replica that is not running the job cancels it outright when nobody
holds it, else sets ``cancel_requested`` in the store; the holder sees it on its next step write (the step
boundary) or renewal and stops the job there.

Cross-replica events: an SSE stream on any replica polls the job's row every :data:`POLL_S` (bounded latency, one
primary-key read per stream per interval) and sends what changed. Polling rather than LISTEN/NOTIFY because the row
is the truth either way (a reconnecting client needs the state, not the notifications it missed), it needs no
dedicated connection per replica through poolers, and the same code serves the SQLite store.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import attrs

from ..jobstore.base import TERMINAL, Claim
from .errors import ApiError
from .jobs import PROGRESS_KEYS, LiveJob
from .sse import encode_event

logger = logging.getLogger("omnicore.server")

POLL_S = 0.25  # the bound on a cross-replica event's latency (and on a claim after a job is submitted elsewhere)


def is_shared(ctx: Any) -> bool:
    """Whether this server shares its store with other replicas (then it claims work instead of owning it)."""
    return bool(getattr(ctx.store, "shared", False))


class Claimer:
    """Pulls queued jobs from the shared store into this replica's job manager and keeps their leases alive."""

    def __init__(self, ctx: Any, models: tuple[str, ...], rebuild_request: Any) -> None:
        self.ctx = ctx
        self.models = models
        # (routes_videos.rebuild_request, handed in by the app: the routes import this module, not the reverse)
        self.rebuild_request = rebuild_request
        self.lease_s = float(ctx.settings.lease_s) or 30.0
        self.slots = int(ctx.settings.claim_slots)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.held: dict[str, LiveJob] = {}
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="omnicore-claimer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()
        self._thread.join(10)

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        next_renew = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_renew:
                    self._renew()
                    next_renew = time.monotonic() + self.lease_s / 3
                self._fill()
            except Exception:  # the claimer must never die (a database blip is retried next round)
                logger.exception("claimer: a round failed")
            self.wake.wait(POLL_S)
            self.wake.clear()

    def _fill(self) -> None:
        jobs = self.ctx.jobs
        while not self._stop.is_set() and jobs is not None and not jobs.stopping and self.ctx.readiness.ok:
            with self._lock:
                if len(self.held) >= self.slots:
                    return
            claim = self.ctx.store.claim(self.holder, self.models, self.lease_s)
            if claim is None:
                return
            self._start(claim)

    def _start(self, claim: Claim) -> None:
        rebuild_request = self.rebuild_request
        ctx, store = self.ctx, self.ctx.store
        record = store.get(claim.job_id) or {}
        if claim.claims > 1:
            logger.warning("job %s: re-claimed (claim %d, token %d): its previous holder's lease ended",
                           claim.job_id, claim.claims, claim.token)
        try:
            served = ctx.served_for(record.get("model")) if getattr(ctx, "pool", None) is not None else None
            request = rebuild_request(ctx, claim.job_id, served) if served is not None else \
                rebuild_request(ctx, claim.job_id)
            body = (store.get_request(claim.job_id) or {}).get("body", {})
            fields: dict[str, Any] = {"id": claim.job_id, "kind": "video", "task": "video.generate",
                                      "persisted": True, "deadline_s": body.get("timeout_s"),
                                      "owner": store.get_owner(claim.job_id)[1], "fence": claim.token}
            if "model" in attrs.fields_dict(LiveJob):  # (several models: the engine routes by it)
                fields["model"] = ctx.model_key(served) if served is not None else None
            live = LiveJob(**fields)
            live.created = float(record.get("created_at") or time.time())
            with self._lock:
                self.held[claim.job_id] = live
            ctx.jobs.submit(live, request)
        except Exception as exc:
            with self._lock:
                self.held.pop(claim.job_id, None)
            message = exc.message if isinstance(exc, ApiError) else f"{type(exc).__name__}: {exc}"
            code = exc.code if isinstance(exc, ApiError) else "requeue_failed"
            try:
                store.update(claim.job_id, fence=claim.token, status="failed", updated_at=int(time.time()),
                             queue_position=None, phase=None, error={"code": code, "message": message})
            except Exception:
                logger.exception("job %s: recording the failed start failed", claim.job_id)
            return
        effective = {"total_steps": request.params.num_inference_steps}
        try:
            store.update(claim.job_id, fence=claim.token, **effective)
        except Exception:  # a lost lease is handled by the next write on the job's own path
            pass

    def released(self, live: LiveJob) -> None:
        """The job manager finished with ``live`` (any end): free its slot and look for more work now."""
        with self._lock:
            if self.held.get(live.id) is live:
                del self.held[live.id]
        self.wake.set()

    def _renew(self) -> None:
        with self._lock:
            held = list(self.held.values())
        for live in held:
            if live.done.is_set() or live.fence is None:
                continue
            renewal = self.ctx.store.renew(live.id, live.fence, self.lease_s)
            if renewal is None:
                logger.warning("job %s: lease lost (token %d); stopping it here", live.id, live.fence)
                self.ctx.jobs.lose_lease(live)
            elif renewal.cancel_requested and not live.cancel_requested:
                self.ctx.jobs.cancel(live.id, reason="a request through another replica")

    def give_back(self) -> None:
        """Draining: return the jobs this replica holds but has not started to the queue, for other replicas."""
        with self._lock:
            held = list(self.held.values())
        for live in held:
            if live.status == "queued" and live.fence is not None and self.ctx.store.release(live.id, live.fence):
                logger.info("job %s: returned to the shared queue (draining)", live.id)


# ---------------------------------------------------------------------------------------------- routes' helpers
def accepted(ctx: Any, record: dict[str, Any]) -> dict[str, Any]:
    """The creation answer of a job recorded in the shared queue (some replica will claim it)."""
    claimer = getattr(ctx, "claimer", None)
    if claimer is not None:
        claimer.wake.set()
    position = ctx.store.queue_position(record["id"])
    return dict(record, queue_position=position if position is not None else 0)


async def cancel_remote(ctx: Any, job_id: str, reason: str) -> bool:
    """Stop a job this replica does not run. ``True`` once it stopped (or was never started), ``False`` when its
    holder did not stop it within ``--cancel-wait``."""
    error = {"code": "cancelled", "message": f"cancelled by {reason}"}
    if ctx.store.cancel_unheld(job_id, error) is not None:
        return True
    ctx.store.update(job_id, cancel_requested=True, updated_at=int(time.time()))
    deadline = time.monotonic() + float(ctx.settings.cancel_wait_s)
    while time.monotonic() < deadline:
        record = ctx.store.get(job_id)
        if record is None or record["status"] in TERMINAL:
            return True
        if ctx.store.cancel_unheld(job_id, error) is not None:  # its holder died meanwhile
            return True
        await asyncio.sleep(POLL_S / 2)
    return False


async def poll_events(ctx: Any, job_id: str, snapshot: dict[str, Any], sent: int,
                      overlay: Any) -> AsyncIterator[bytes]:
    """The SSE stream of a job wherever it runs: the store's row every :data:`POLL_S`, a ``video.progress``
    event when its progress changed, a heartbeat every ``--heartbeat-interval``, the terminal event last."""
    tick_s = float(ctx.settings.heartbeat_interval_s)
    last = {k: snapshot.get(k) for k in PROGRESS_KEYS}
    quiet_since = time.monotonic()
    while True:
        await asyncio.sleep(POLL_S)
        record = ctx.store.get(job_id)
        if record is None:
            return
        record = overlay(ctx, record)
        sent += 1
        if record["status"] in TERMINAL:
            yield encode_event(sent, f"video.{record['status']}", record)
            return
        now = {k: record.get(k) for k in PROGRESS_KEYS if k != "updated_at"}
        if now != {k: v for k, v in last.items() if k != "updated_at"}:
            last = {k: record.get(k) for k in PROGRESS_KEYS}
            quiet_since = time.monotonic()
            yield encode_event(sent, "video.progress", {"id": job_id, **last})
        elif time.monotonic() - quiet_since >= tick_s:
            quiet_since = time.monotonic()
            yield encode_event(sent, "video.heartbeat", {"id": job_id, "phase": record.get("phase"),
                                                         "updated_at": int(time.time())})
        else:
            sent -= 1
