"""A small, deterministic, test-only model plugin (never shipped in any distribution).

``toy_host()`` gives an isolated :class:`PluginHost` with the toy registered; ``toy_engine()`` an Engine on it.
Importable as ``toy`` because ``tests/`` is on ``sys.path`` under pytest (benchmarks add it themselves).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omnicore.config import Settings

from .adaln import TOY_ADALN_SPEC, ToyAdaLNConfig, ToyAdaLNPipeline
from .model import ToyConfig, ToyDenoiser
from .pipeline import ToyFailure, ToyPipeline, build_toy_checkpoint
from .plugin import TOY_SPEC, ToyPlugin


def toy_host(settings: Settings | None = None, *, plugin: Any = None) -> Any:
    """An isolated host (built-ins only, no entry points) with the toy plugin added."""
    from omnicore.plugin_host.host import PluginHost

    host = PluginHost(settings if settings is not None else Settings(), autoload=False)
    host.add_plugin(plugin if plugin is not None else ToyPlugin(), "toy")
    return host


def toy_engine(cache_dir: str | Path, model: str = "tiny:toy", *, host: Any = None, **settings: Any) -> Any:
    """An Engine on the toy model; ``settings`` are :class:`Settings` fields (max_num_seqs ...)."""
    from omnicore.engine.api import Engine

    s = Settings(cache_dir=str(cache_dir), **settings)
    host = host if host is not None else toy_host(s)
    return Engine(model, host=host, settings=s)


__all__ = ["TOY_ADALN_SPEC", "TOY_SPEC", "ToyAdaLNConfig", "ToyAdaLNPipeline", "ToyConfig", "ToyDenoiser", "ToyFailure", "ToyPipeline", "ToyPlugin",
           "build_toy_checkpoint", "toy_engine", "toy_host"]
