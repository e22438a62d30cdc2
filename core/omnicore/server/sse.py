"""Server-sent events: a thread-safe hub that fans job events out to asyncio subscribers.

Engine callbacks run on worker threads; :meth:`EventHub.publish` hands each event to every subscriber's
event loop with ``call_soon_threadsafe``, so nothing blocks the engine and nothing touches a loop from the
wrong thread. Event ids increase per job, so a reconnecting client (``Last-Event-ID``) can tell new from old.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections import defaultdict
from typing import Any

import attrs


@attrs.frozen
class Event:
    id: int
    type: str
    data: dict[str, Any]

    def encode(self) -> bytes:
        return f"id: {self.id}\nevent: {self.type}\ndata: {json.dumps(self.data, separators=(',', ':'))}\n\n".encode()


def encode_event(event_id: int, event_type: str, data: dict[str, Any]) -> bytes:
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
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: dict[str, list[Subscription]] = defaultdict(list)
        self._counters: dict[str, itertools.count] = {}

    def next_id(self, job_id: str) -> int:
        with self._lock:
            return next(self._counters.setdefault(job_id, itertools.count(1)))

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

    def publish(self, job_id: str, event_type: str, data: dict[str, Any]) -> None:
        """Deliver to every subscriber of ``job_id`` (callable from any thread)."""
        with self._lock:
            subs = list(self._subs.get(job_id, ()))
            event = Event(next(self._counters.setdefault(job_id, itertools.count(1))), event_type, data)
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(sub.queue.put_nowait, event)
            except RuntimeError:  # the subscriber's loop is closed: it is gone
                self._unsubscribe(sub)

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._counters.pop(job_id, None)
