"""Readiness (serving-api.md §5): ``loading`` -> ``warming_up`` -> ``ok`` -> ``draining``, or ``unhealthy``.

The listener binds before the model loads; routes ask :meth:`Readiness.require_ready` and get a 503 in the
contract's shape (``not_ready`` or ``draining``) with ``Retry-After`` until the server is ``ok``.
"""

from __future__ import annotations

import threading

from .errors import ApiError

STATES = ("loading", "warming_up", "ok", "draining", "unhealthy")


class Readiness:
    def __init__(self, state: str = "loading") -> None:
        self._lock = threading.Lock()
        self._state = state
        self.error: str | None = None

    @property
    def state(self) -> str:
        return self._state

    def set(self, state: str, error: str | None = None) -> None:
        assert state in STATES, state
        with self._lock:
            if self._state == "draining" and state != "unhealthy":
                return  # draining is final for this process
            self._state = state
            if error is not None:
                self.error = error

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
