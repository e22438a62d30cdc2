"""Helpers for server tests, importable from any test (``from _server_helpers import LiveServer``).

They live here rather than in ``conftest.py``: a ``from conftest import ...`` resolves to whichever
``conftest`` module pytest imported last, so it broke when another directory's tests were collected first.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from omnicore.hookspecs import hookimpl


class SlowSteps:
    """Test plugin: a denoise wrapper that sleeps ``delay_s`` per step, so a test can act during denoise."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.starts: list[float] = []  # time.monotonic() at the start of every step (a test's step clock)

    @hookimpl(wrapper=True)
    def omnicore_denoise(self, pipeline: Any, state: Any, step: int) -> Any:
        self.starts.append(time.monotonic())
        time.sleep(self.delay_s)
        return (yield)


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1 with an OS-chosen port (``port=0``: no races), in a daemon thread.

    (Handing uvicorn a pre-bound socket instead cost ~40 ms per response here: Nagle + delayed ACK.)
    """

    def __init__(self, app: Any) -> None:
        from omnicore.server.http_edge import uvicorn_config
        from omnicore.server.lifecycle import DrainingServer

        self.app = app
        config = uvicorn_config(app, host="127.0.0.1", port=0, log_level="warning", shutdown_grace_s=5,
                                read_timeout_s=app.state.ctx.settings.read_timeout_s)  # what `omnicore serve` uses
        self.server = DrainingServer(config, app.state.ctx)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.port = 0
        self.url = ""

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def stop(self) -> None:
        """What SIGTERM does: drain first, then uvicorn's shutdown and the app's lifespan shutdown."""
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(30)
        assert not self.thread.is_alive(), "uvicorn did not stop"

    @property
    def ctx(self) -> Any:
        return self.app.state.ctx


def read_events(resp: httpx.Response, stop: Callable[[dict], bool] | None = None) -> list[dict]:
    """Parse an SSE response into ``{"id", "event", "data"}`` dicts until ``stop(event)`` or the stream ends."""
    events: list[dict] = []
    cur: dict = {}
    for line in resp.iter_lines():
        if line:
            key, _, value = line.partition(": ")
            cur[key] = value
            continue
        if cur:
            ev = {"id": int(cur["id"]), "event": cur["event"], "data": json.loads(cur["data"])}
            events.append(ev)
            cur = {}
            if stop is not None and stop(ev):
                break
    return events
