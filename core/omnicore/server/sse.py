"""Server-sent events: a thread-safe hub that fans job events out to asyncio subscribers.

Engine callbacks run on worker threads; :meth:`EventHub.publish` hands each event to every subscriber's
event loop with ``call_soon_threadsafe``, so nothing blocks the engine and nothing touches a loop from the
wrong thread. Event ids increase per job, and recent events are buffered, so a client that reconnects with
``Last-Event-ID`` gets what it missed.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections import defaultdict, deque

import attrs


@attrs.frozen
class Event:
    id: int
    type: str
    data: dict[str, object]

    def encode(self) -> bytes:
        return f"id: {self.id}\nevent: {self.type}\ndata: {json.dumps(self.data, separators=(',', ':'))}\n\n".encode()


def encode_event(event_id: int, event_type: str, data: dict[str, object]) -> bytes:
    return Event(event_id, event_type, data).encode()


class Subscription:
    """One client's queue of events for one job."""

    def __init__(self, hub: EventHub, job_id: str) -> None:
        self.hub = hub
        self.job_id = job_id
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    async def get(self, timeout: float | None = None) -> Event | None:
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def close(self) -> None:
        self.hub._unsubscribe(self)


class EventHub:
    """Per-job event ids, fan-out to subscribers, and a bounded buffer of each active job's recent events.

    The buffer lets a client that reconnects with ``Last-Event-ID`` receive exactly the events it missed
    (:meth:`since`); when they are no longer all buffered, the route sends a fresh snapshot instead. A
    job's buffer is dropped with its final event: after that the stored record is the whole story.
    """

    def __init__(self, buffer_size: int = 256) -> None:
        self.buffer_size = buffer_size
        self._lock = threading.Lock()
        self._subs: dict[str, list[Subscription]] = defaultdict(list)
        self._counters: dict[str, int] = {}
        self._buffers: dict[str, deque[Event]] = {}

    def _next(self, job_id: str, after: int = 0) -> int:  # call with the lock held
        value = max(self._counters.get(job_id, 0), after) + 1
        self._counters[job_id] = value
        return value

    def next_id(self, job_id: str, after: int = 0) -> int:
        """A fresh id for ``job_id``, above every id handed out so far and above ``after`` (a client's
        ``Last-Event-ID``, which may come from before a restart)."""
        with self._lock:
            return self._next(job_id, after)

    def since(self, job_id: str, last_id: int) -> list[Event] | None:
        """The buffered events after ``last_id``, or ``None`` when some of them are no longer buffered."""
        with self._lock:
            buf = self._buffers.get(job_id)
            if not buf or buf[0].id > last_id + 1 or last_id >= self._counters.get(job_id, 0):
                return None  # trimmed away, or ids this process never issued (a client from before a restart)
            return [e for e in buf if e.id > last_id]

    def subscribe(self, job_id: str) -> Subscription:
        sub = Subscription(self, job_id)
        with self._lock:
            self._subs[job_id].append(sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.job_id)
            if subs and sub in subs:
                subs.remove(sub)
            if subs is not None and not subs:
                del self._subs[sub.job_id]

    def publish(self, job_id: str, event_type: str, data: dict[str, object], *, final: bool = False) -> None:
        """Deliver to every subscriber of ``job_id`` (callable from any thread); ``final`` ends its buffer."""
        with self._lock:
            subs = list(self._subs.get(job_id, ()))
            event = Event(self._next(job_id), event_type, data)
            if final:
                self._buffers.pop(job_id, None)
            else:
                self._buffers.setdefault(job_id, deque(maxlen=self.buffer_size)).append(event)
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, event)
            except RuntimeError:  # the subscriber's loop is closed: it is gone
                self._unsubscribe(sub)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._counters.pop(job_id, None)
            self._buffers.pop(job_id, None)
