"""Readiness: ``loading`` -> ``warming_up`` -> ``ok`` -> ``draining``, or ``unhealthy``.

The listener binds before the model loads; routes ask :meth:`Readiness.require_ready` and get a 503 in the
contract's shape (``not_ready`` or ``draining``) with ``Retry-After`` until the server is ``ok``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import uvicorn

from .errors import ApiError

if TYPE_CHECKING:
    from types import FrameType

    from .app import ServerContext

STATES = ("loading", "warming_up", "ok", "draining", "unhealthy")


class Readiness:
    def __init__(self, state: str = "loading") -> None:
        self._lock = threading.Lock()
        self._state = state
        self.error: str | None = None
        self._listeners: list[Callable[[str], None]] = []

    def on_change(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(new_state)`` on every change, in the thread that made it (e.g. to announce readiness)."""
        self._listeners.append(listener)

    @property
    def state(self) -> str:
        return self._state

    def set(self, state: str, error: str | None = None) -> None:
        assert state in STATES, state
        with self._lock:
            if self._state == "draining" and state != "unhealthy":
                return  # draining is final for this process
            changed = state != self._state
            self._state = state
            if error is not None:
                self.error = error
        if changed:
            for listener in list(self._listeners):
                listener(state)

    @property
    def ok(self) -> bool:
        return self._state == "ok"

    def require_ready(self) -> None:
        state = self._state
        if state == "ok":
            return
        if state == "draining":
            raise ApiError(503, "draining", "the server is shutting down and admits no new work",
                           headers={"Retry-After": "5"})
        if state == "unhealthy":
            raise ApiError(503, "worker_unavailable", f"the server is unhealthy: {self.error}",
                           headers={"Retry-After": "30"})
        raise ApiError(503, "not_ready", f"the model is {state.replace('_', ' ')}; retry shortly",
                       headers={"Retry-After": "5"})


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose shutdown signal starts a visible drain before the listener closes.

    On the first SIGTERM/SIGINT the app drains (``/health`` says ``draining``, new work gets 503) while the
    listener stays open, so clients can still read job status, stream events and download results; once the
    running work finished, or ``shutdown_grace_s`` passed and it was stopped, uvicorn's own shutdown starts.
    A second signal skips the wait. The drain runs on its own thread: a signal handler must not take locks
    the interrupted main thread may hold.
    """

    def __init__(self, config: uvicorn.Config, ctx: ServerContext) -> None:
        super().__init__(config)
        self.ctx = ctx
        self._drain_thread: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_thread is not None:  # a second signal: stop waiting
            super().handle_exit(sig, frame)
            return
        self._drain_thread = threading.Thread(target=self._drain_then_exit, args=(sig, frame), name="omnicore-drain",
                                              daemon=True)
        self._drain_thread.start()

    def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
        try:
            self.ctx.begin_drain()
            jobs = getattr(self.ctx, "jobs", None)
            if jobs is not None:  # running work may finish within the grace; then it is stopped at a step
                jobs.shutdown(self.ctx.settings.shutdown_grace_s)
        finally:
            if not self.should_exit:
                super().handle_exit(sig, frame)
