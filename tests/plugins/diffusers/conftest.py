"""Shared fixtures: engines over the adapter's tiny presets, and the same checkpoints loaded by diffusers itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("diffusers")
from _diffusers_helpers import make_engine


@pytest.fixture(scope="session")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from omnicore.config import Settings

    return Settings(cache_dir=str(tmp_path_factory.mktemp("omni-diffusers-cache")))


@pytest.fixture(scope="session")
def engines(settings: Any) -> Iterator[dict[str, Any]]:
    """``engines[name]``: an engine over ``tiny:diffusers-<name>``, started on first use, closed at the end."""
    opened: dict[str, Any] = {}

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, name: str) -> Any:
            opened[name] = make_engine(f"tiny:diffusers-{name}", settings)
            return opened[name]

    yield Lazy()
    for engine in opened.values():
        engine.close()


@pytest.fixture(scope="session")
def direct() -> Any:
    """``direct(engine)``: the engine's checkpoint loaded by ``DiffusionPipeline.from_pretrained`` (cached)."""
    loaded: dict[str, Any] = {}

    def load(engine: Any) -> Any:
        import diffusers

        path = str(engine.resolved.path)
        if path not in loaded:
            pipe = diffusers.DiffusionPipeline.from_pretrained(path)
            pipe.set_progress_bar_config(disable=True)
            loaded[path] = pipe
        return loaded[path]

    return load
