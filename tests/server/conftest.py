"""Fixtures for server tests: a real uvicorn on 127.0.0.1 (free port, background thread) around a toy engine.

Shared helpers (``LiveServer``, ``SlowSteps``, ``read_events``) live in ``_server_helpers.py``; import them from there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _server_helpers import LiveServer, SlowSteps


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
