"""FIFO scheduler with the admission-wait policy (reference: docs/contracts-status.md C6) and batch-compatibility keys.

The scheduler is plain data + pure decisions: it is not thread-safe (the engine calls it under its lock)
and it never reads a clock — every decision takes ``now`` so tests can probe exact boundary times.

Batch size is counted in **outputs** (the sum of ``num_outputs``), since that is what the denoiser's batch
dimension holds: a batch holds at most ``max_num_seqs`` outputs, except that a single request asking for
more runs alone. The queue limit (``max_queue``) is counted in requests.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

import attrs

from ..config import finite_non_negative
from ..errors import ConfigError, QueueFull

T = TypeVar("T")

STABLE_WINDOW_S = 0.05
WAIT_POLL_S = 0.002


@attrs.frozen
class AdmissionDecision:
    """Whether to hold the queue before forming a batch, and until when."""

    should_wait: bool
    deadline: float | None
    stable_window_s: float
    max_batch: int


@attrs.frozen
class _Entry(Generic[T]):
    item: T
    key: Hashable
    size: int


class Scheduler(Generic[T]):
    """Queue of admitted items (the engine's jobs) and the batching rules.

    :param max_num_seqs: largest batch, in outputs.
    :param max_queue: most items waiting; one more raises :class:`QueueFull`.
    :param request_batch_max_wait_ms: admission wait (finite, >= 0; 0 disables waiting).
    :param supports_batching: the model's capability; ``False`` makes every batch a single request.
    """

    def __init__(self, *, max_num_seqs: int, max_queue: int, request_batch_max_wait_ms: float = 0.0,
                 supports_batching: bool = True) -> None:
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ConfigError("max_num_seqs", f"must be a positive integer, got {max_num_seqs!r}")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ConfigError("max_queue", f"must be a positive integer, got {max_queue!r}")
        self.max_wait_ms = finite_non_negative("request_batch_max_wait_ms", request_batch_max_wait_ms)
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        self.supports_batching = supports_batching
        self.running = False  # a batch is executing (set by the engine loop)
        self._queue: deque[_Entry[T]] = deque()

    # ------------------------------------------------------------------ queue
    def add(self, item: T, *, key: Hashable, size: int = 1, quality: Hashable = None) -> None:
        """Append ``item``; ``quality`` is folded into the key so a batch never mixes quality levels (the one place
        that rule lives: models' batch keys, the runner and the VAE fast-path gates rely on it)."""
        if len(self._queue) >= self.max_queue:
            raise QueueFull(self.max_queue)
        self._queue.append(_Entry(item, (quality, key), max(1, int(size))))

    def remove(self, item: T) -> bool:
        for entry in self._queue:
            if entry.item is item:
                self._queue.remove(entry)
                return True
        return False

    def drain(self) -> list[T]:
        items = [e.item for e in self._queue]
        self._queue.clear()
        return items

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[T]:
        return iter([e.item for e in self._queue])

    @property
    def waiting(self) -> int:
        """Outputs waiting (the unit of ``max_num_seqs``)."""
        return sum(e.size for e in self._queue)

    @property
    def max_batch(self) -> int:
        return self.max_num_seqs if self.supports_batching else 1

    def next_batch(self) -> list[T]:
        """Pop the head and every later item with an equal key that still fits, in FIFO order.

        Items with other keys keep their place (the next batch starts with the oldest of them), so
        nothing starves.
        """
        if not self._queue:
            return []
        head = self._queue.popleft()
        batch, total = [head], head.size
        if self.supports_batching:
            for entry in list(self._queue):
                if total >= self.max_num_seqs:
                    break
                if entry.key == head.key and total + entry.size <= self.max_num_seqs:
                    self._queue.remove(entry)
                    batch.append(entry)
                    total += entry.size
        return [e.item for e in batch]

    # ------------------------------------------------------------------ admission wait (pure)
    def get_admission_wait_decision(self, now: float) -> AdmissionDecision:
        """Hold for up to ``request_batch_max_wait_ms`` unless waiting is off or a batch runs."""
        if self.running or self.max_wait_ms == 0.0:
            return AdmissionDecision(False, None, STABLE_WINDOW_S, self.max_batch)
        return AdmissionDecision(True, now + self.max_wait_ms / 1000.0, STABLE_WINDOW_S, self.max_batch)

    def should_end_admission_wait(self, decision: AdmissionDecision, now: float, stable_since: float) -> bool:
        """End on a full batch, a queue unchanged for the stable window, or the deadline."""
        waiting = self.waiting
        if waiting >= decision.max_batch:
            return True
        if waiting > 0 and now - stable_since >= decision.stable_window_s:
            return True
        return decision.deadline is not None and now >= decision.deadline


def admission_wait(scheduler: Scheduler[T], cond: threading.Condition, decision: AdmissionDecision,
                   clock: Callable[[], float], stop: Callable[[], bool]) -> float:
    """The engine's wait loop (call with ``cond`` held); returns the seconds waited.

    Polls at most every 2 ms; ``stable_since`` restarts whenever the queue grows.
    """
    start = stable_since = clock()
    last = scheduler.waiting
    while not stop():
        now = clock()
        waiting = scheduler.waiting
        if waiting > last:
            stable_since = now
        last = waiting
        if scheduler.should_end_admission_wait(decision, now, stable_since):
            break
        remaining = decision.deadline - now if decision.deadline is not None else math.inf
        cond.wait(min(max(remaining, 0.0), WAIT_POLL_S))
    return clock() - start
