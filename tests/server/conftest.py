"""Fixtures for server tests: a real uvicorn on 127.0.0.1 (free port, background thread) around a toy engine."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from omnicore.hookspecs import hookimpl


class SlowSteps:
    """Test plugin: a denoise wrapper that sleeps ``delay_s`` per step, so a test can act during denoise."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    @hookimpl(wrapper=True)
    def omnicore_denoise(self, pipeline: Any, state: Any, step: int) -> Any:
        time.sleep(self.delay_s)
        return (yield)


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1 with an OS-chosen port (``port=0``: no races), in a daemon thread.

    (Handing uvicorn a pre-bound socket instead cost ~40 ms per response here: Nagle + delayed ACK.)
    """

    def __init__(self, app: Any) -> None:
        import uvicorn
        from omnicore.server.lifecycle import DrainingServer

        self.app = app
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=10)
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


@pytest.fixture(scope="session")
def toy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache dir per session: the tiny:toy preset is built once."""
    return tmp_path_factory.mktemp("toy-cache")


@pytest.fixture
def make_server(toy_cache: Path, tmp_path: Path) -> Iterator[Callable[..., LiveServer]]:
    """``make_server(state_dir=..., step_delay_s=..., **ServerSettings fields)`` -> a started LiveServer."""
    from omnicore.config import Settings
    from omnicore.server import ServerSettings, create_app
    from toy import toy_engine, toy_host

    started: list[LiveServer] = []

    def make(*, state_dir: Path | None = None, step_delay_s: float = 0.0, engine_settings: dict | None = None,
             **server_settings: Any) -> LiveServer:
        s = Settings(cache_dir=str(toy_cache), **(engine_settings or {}))
        host = toy_host(s)
        if step_delay_s:
            host.add_plugin(SlowSteps(step_delay_s), "slow-steps")
        engine = toy_engine(toy_cache, host=host, **(engine_settings or {}))
        ss = ServerSettings(state_dir=state_dir or tmp_path / "state", **server_settings)
        srv = LiveServer(create_app(engine, ss)).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        if srv.thread.is_alive():
            srv.stop()


@pytest.fixture
def client_for() -> Iterator[Callable[[LiveServer], httpx.Client]]:
    clients: list[httpx.Client] = []

    def make(srv: LiveServer, **kw: Any) -> httpx.Client:
        c = httpx.Client(base_url=srv.url, timeout=60, **kw)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


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
