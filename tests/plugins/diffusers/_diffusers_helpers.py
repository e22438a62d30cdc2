"""Helpers shared by the adapter's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLUGIN = "omni_diffusers.plugin"


def make_engine(model: str | Path, settings: Any, **options: Any) -> Any:
    import omnicore
    from omnicore.testing import add_loaded, isolated_host

    host = isolated_host(settings)
    add_loaded(host, PLUGIN)
    return omnicore.Engine(model, host=host, settings=settings, **options)
