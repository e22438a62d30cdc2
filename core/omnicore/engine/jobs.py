"""``Job``: the handle a caller gets for one admitted request (status, progress, result, cancellation).

Thread-safe. Listeners run on the thread that emits the event (the caller's thread for ``preprocess`` and
``queued``, the engine worker otherwise) while the job's lock is held, so each listener sees events in
order; they must be quick and must not block (hand work to another thread or an event loop).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import Cancelled
from .progress import TERMINAL_PHASES, ProgressEvent, phase_progress

if TYPE_CHECKING:
    from ..outputs.output import Output
    from .request import GenerationRequest
    from .step_checkpoint import CheckpointPlan

logger = logging.getLogger("omnicore.engine")

Listener = Callable[[ProgressEvent], Any]


class Job:
    """One request's lifecycle: ``queued`` -> ``running`` -> ``succeeded`` | ``failed`` | ``cancelled``."""

    def __init__(self, request: GenerationRequest, canceller: Callable[[Job], None] | None = None) -> None:
        self.id: str = request.request_id
        self.request = request
        self.status = "queued"
        self.progress: ProgressEvent | None = None
        self.error: BaseException | None = None
        self.outputs: list[Output] = []
        self.created_at = time.time()
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.metrics: dict[str, float] = {}  # engine-side timings (preprocess_s, queue_s ...)
        self.admitted_at: float | None = None  # perf_counter() when it entered the queue
        self._t0 = time.perf_counter()
        self._lock = threading.RLock()
        self._done = threading.Condition(self._lock)
        self._listeners: list[Listener] = []
        self._cancel_requested = False
        self._canceller = canceller
        # step checkpoints of this job (engine.step_checkpoint): set by the engine at admission, read by the runner
        self.checkpoint: CheckpointPlan | None = None

    # ------------------------------------------------------------------ caller side
    @property
    def done(self) -> bool:
        return self.status in ("succeeded", "failed", "cancelled")

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    def cancel(self) -> bool:
        """Ask the engine to stop this job; a queued job ends at once, a running one between two steps.

        Returns ``False`` when the job had already finished.
        """
        with self._lock:
            if self.done:
                return False
            self._cancel_requested = True
            canceller = self._canceller
        if canceller is not None:
            canceller(self)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job finishes (``True``) or ``timeout`` seconds pass (``False``)."""
        with self._done:
            return self._done.wait_for(lambda: self.done, timeout)

    def result(self, timeout: float | None = None) -> list[Output]:
        """The outputs; raises :class:`Cancelled`, the job's error, or ``TimeoutError``."""
        if not self.wait(timeout):
            raise TimeoutError(f"job {self.id} did not finish within {timeout} s")
        if self.status == "cancelled":
            raise Cancelled(self.id)
        if self.status == "failed":
            assert self.error is not None
            raise self.error
        return list(self.outputs)

    def add_listener(self, callback: Listener, *, replay: bool = True) -> None:
        """Call ``callback(event)`` for every later event; with ``replay`` it first gets the latest one."""
        with self._lock:
            self._listeners.append(callback)
            if replay and self.progress is not None:
                self._call(callback, self.progress)

    def remove_listener(self, callback: Listener) -> None:
        with self._lock:
            if callback in self._listeners:
                self._listeners.remove(callback)

    def __repr__(self) -> str:
        return f"Job({self.id!r}, status={self.status!r})"

    # ------------------------------------------------------------------ engine side
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def emit(self, phase: str, *, step: int = 0, total_steps: int = 0, eta_s: float | None = None,
             message: str | None = None) -> ProgressEvent | None:
        """Record and deliver an event; ignored once the job finished, or for ``queued`` after it started."""
        with self._lock:
            if self.done and phase not in TERMINAL_PHASES:
                return None
            if phase == "queued" and self.status != "queued":
                return None
            last = self.progress.progress if self.progress is not None else 0.0
            event = ProgressEvent(job_id=self.id, phase=phase, step=step, total_steps=total_steps,
                                  elapsed_s=self.elapsed(), eta_s=eta_s,
                                  progress=max(last, phase_progress(phase, step, total_steps)), message=message)
            self.progress = event
            for callback in list(self._listeners):
                self._call(callback, event)
            return event

    def _call(self, callback: Listener, event: ProgressEvent) -> None:
        try:
            callback(event)
        except Exception:  # a listener must never break the engine
            logger.exception("progress listener of job %s raised", self.id)

    def mark_running(self) -> bool:
        with self._lock:
            if self.done:
                return False
            self.status = "running"
            self.started_at = time.time()
            return True

    def finish(self, status: str, *, outputs: list[Output] | None = None, error: BaseException | None = None,
               on_finish: Callable[[], None] | None = None) -> bool:
        """Move to a terminal status exactly once (later calls are ignored and return ``False``).

        ``on_finish`` runs on that transition before waiters wake (the engine updates its counters there).
        """
        assert status in ("succeeded", "failed", "cancelled")
        with self._lock:
            if self.done:
                return False
            if on_finish is not None:
                on_finish()
            self.outputs = list(outputs or [])
            self.error = error
            self.finished_at = time.time()
            self.status = status
            phase = {"succeeded": "done", "failed": "failed", "cancelled": "cancelled"}[status]
            self.emit(phase, step=self.progress.step if self.progress else 0,
                      total_steps=self.progress.total_steps if self.progress else 0,
                      eta_s=0.0 if status == "succeeded" else None,
                      message=None if error is None else f"{type(error).__name__}: {error}")
            self._done.notify_all()
            self._listeners.clear()
            return True
