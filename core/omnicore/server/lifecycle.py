"""Readiness (serving-api.md §5): ``loading`` -> ``warming_up`` -> ``ok`` -> ``draining``, or ``unhealthy``.

The listener binds before the model loads; routes ask :meth:`Readiness.require_ready` and get a 503 in the
contract's shape (``not_ready`` or ``draining``) with ``Retry-After`` until the server is ``ok``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from .errors import ApiError

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
    """``uvicorn.Server`` that starts draining the app the moment a shutdown signal arrives (§11).

    uvicorn closes its listener and waits for open connections before it runs the app's lifespan shutdown;
    draining here first means in-flight connections already see ``draining`` and the shutdown grace counts
    from the signal. The drain runs on its own thread: a signal handler must not take locks the interrupted
    main thread may hold.
    """

    def __init__(self, config: uvicorn.Config, ctx: Any) -> None:
        super().__init__(config)
        self.ctx = ctx

    def handle_exit(self, sig: int, frame: Any) -> None:
        threading.Thread(target=self.ctx.begin_drain, name="omnicore-drain", daemon=True).start()
        super().handle_exit(sig, frame)
