"""Fixtures for the job-store contract and the multi-replica tests: a throwaway PostgreSQL for the session.

Without PostgreSQL's server binaries the PostgreSQL cases skip with one line saying how to install them; `make
install` installs Debian's `postgresql` when it runs as root with apt-get (CI does).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

_db_names = itertools.count()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """A running :class:`~omnicore.testing.postgres.ThrowawayPostgres`, stopped at the end of the session."""
    from omnicore.testing.postgres import INSTALL_HINT, ThrowawayPostgres, find_bin_dir

    if find_bin_dir() is None:
        pytest.skip(INSTALL_HINT)
    pytest.importorskip("psycopg", reason="psycopg not installed: pip install 'omnicore[postgres]'")
    pytest.importorskip("psycopg_pool", reason="psycopg_pool not installed: pip install 'omnicore[postgres]'")
    pg = ThrowawayPostgres()
    pg.start()
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture
def pg_url(postgres: Any) -> str:
    """The URL of a fresh, empty database (each test gets its own schema)."""
    return str(postgres.new_database(f"t{next(_db_names)}"))


@pytest.fixture(params=["sqlite", "postgresql"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def open_store(store_kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """``open_store()`` -> a new store of the parametrized kind on this test's database / directory (a second
    call opens a second handle on the same data: another replica for PostgreSQL, a reopen for SQLite)."""
    from omnicore.jobstore import open_store as open_

    url = request.getfixturevalue("pg_url") if store_kind == "postgresql" else None
    opened: list[Any] = []

    def make() -> Any:
        store = open_(url, tmp_path / "state", storage_url=str(tmp_path / "shared"))
        opened.append(store)
        return store

    yield make
    for s in opened:
        s.close()


@pytest.fixture
def store(open_store: Any) -> Any:
    return open_store()


@pytest.fixture(scope="module")
def toy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("toy-cache-replicas")


@pytest.fixture
def replicas(toy_cache: Path, tmp_path: Path, pg_url: str) -> Iterator[Callable[..., list[Any]]]:
    """``replicas(n, step_delay_s=..., **ServerSettings)`` -> n started servers (``_server_helpers.LiveServer``, real
    uvicorn around toy engines, in this process) on one database and directory."""
    from _server_helpers import LiveServer, SlowSteps
    from omnicore.config import Settings
    from omnicore.server import ServerSettings, create_app
    from toy import toy_engine, toy_host

    started: list[LiveServer] = []

    def make(n: int, *, step_delay_s: float = 0.0, **server_settings: Any) -> list[LiveServer]:
        out = []
        for i in range(n):
            host = toy_host(Settings(cache_dir=str(toy_cache)))
            slow = SlowSteps(step_delay_s) if step_delay_s else None
            if slow is not None:
                host.add_plugin(slow, "slow-steps")
            engine = toy_engine(toy_cache, host=host)
            ss = ServerSettings(state_dir=tmp_path / f"state{i}", store=pg_url, storage_url=str(tmp_path / "shared"),
                                **server_settings)
            srv = LiveServer(create_app(engine, ss)).start()
            srv.slow_steps = slow  # its step clock (starts), when steps are slowed
            started.append(srv)
            out.append(srv)
        return out

    yield make
    for srv in started:
        if srv.thread.is_alive():
            srv.stop()
