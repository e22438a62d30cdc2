"""Suite-wide fixtures. Keep this minimal; the conformance fixtures (``omnicore_host``) come from
``omnicore.testing``'s pytest plugin."""

from __future__ import annotations

import importlib
import itertools
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

_counter = itertools.count()

# Triton decides at decoration time whether a kernel runs compiled or in its CPU interpreter, and any test may
# import the CUDA backend's kernels first (the engine binds every registered op at start-up). So the choice is
# made here, before anything is collected: without a usable CUDA device the kernels run interpreted.
try:
    from omni_backends_cuda.probe import probe as _cuda_probe
except ImportError:  # the CUDA backend plugin is not installed
    _cuda_probe = None
if _cuda_probe is not None and _cuda_probe() is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest runs with --import-mode=importlib (pyproject.toml): nothing is added to sys.path per test file, so test
# modules may share basenames across directories. What tests import by name goes on sys.path here, once: the
# tests/ folder (the ``toy`` package) and every folder holding helper modules (``_*.py``). Helper module names
# must therefore be unique across the suite (``_server_helpers``, ``_lingbot_helpers``, ...), checked here.
_TESTS = Path(__file__).resolve().parent
_HELPERS = sorted(p for p in _TESTS.rglob("_*.py") if p.name != "__init__.py" and "toy" not in p.parts)
_dupes = sorted({p.name for p in _HELPERS if [q.name for q in _HELPERS].count(p.name) > 1})
assert not _dupes, f"helper module names must be unique across tests/: {_dupes}"
for _folder in [_TESTS, *sorted({p.parent for p in _HELPERS})]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


@pytest.fixture
def make_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., str]]:
    """``make_module(source, prefix=...)`` writes an importable module with a unique name and returns the name.

    Lets tests point lazy ``"module:attr"`` paths and entry points at real code; forgotten afterwards.
    """
    root = tmp_path / "_modules"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    created: list[str] = []

    def make(source: str, prefix: str = "omnitest_mod") -> str:
        name = f"{prefix}_{os.getpid()}_{next(_counter)}"
        (root / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        created.append(name)
        return name

    yield make
    for name in created:
        sys.modules.pop(name, None)


# ---------------------------------------------------------------- toy model plugin (engine tests)
# ``tests/`` is on sys.path (this conftest is outside a package), so the test-only plugin imports as ``toy``.


@pytest.fixture
def toy_settings(tmp_path: Path):
    """Settings with the cache dir inside the test's tmp dir (presets are built there)."""
    from omnicore.config import Settings

    return Settings(cache_dir=str(tmp_path / "cache"))


@pytest.fixture
def toy_host(toy_settings):
    """Isolated PluginHost(autoload=False) with the toy model plugin added (see tests/toy)."""
    from toy import toy_host as make_toy_host

    return make_toy_host(toy_settings)


@pytest.fixture
def client_for() -> Iterator[Callable[..., Any]]:
    """``client_for(live_server, **httpx_kwargs)``: an ``httpx.Client`` on a running test server, closed after the
    test (server tests of the core and of each plugin use it)."""
    import httpx

    clients: list[httpx.Client] = []

    def make(srv: Any, **kw: Any) -> httpx.Client:
        c = httpx.Client(base_url=srv.url, timeout=60, **kw)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()
