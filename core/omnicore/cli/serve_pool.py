"""``omnicore serve A B C`` and ``omnicore serve --models models.toml``: several models behind one server.

The models become the entries of a :class:`~omnicore.pool.ModelPool` (one engine each, one device memory budget,
idle models swapped out; see :mod:`omnicore.pool.pool` for the policy); the request's ``model`` routes. Models
given as arguments take the engine flags of the command line (``--cache``, ``--offload``, ``--model-option`` ...);
``models.toml`` entries carry their own. Every model is resolved before the listener binds (an unknown one ends
``serve`` with one line and exit 2); weights load in the background as they fit the budget.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..config import Settings
    from ..plugin_host.host import PluginHost
    from ..pool.entries import ModelEntry
    from ..pool.pool import ModelPool


def pool_entries(args: argparse.Namespace, models: list[str],
                 settings: Settings) -> tuple[list[ModelEntry], int | None, int | None]:
    """The pool's entries and its ``(memory_budget, host_memory_budget)``: flags win over ``[pool]``."""
    from ..pool.entries import check_unique, entries_from_args, load_models_file
    from .generate_cmd import engine_kwargs

    entries: list[ModelEntry] = []
    budget, host_budget = settings.memory_budget, settings.host_memory_budget
    if settings.models_file:
        found = load_models_file(settings.models_file)
        entries.extend(found.entries)
        budget = budget if budget is not None else found.memory_budget
        host_budget = host_budget if host_budget is not None else found.host_memory_budget
    if models:
        if getattr(args, "warmup", False):
            raise ConfigError("--warmup", "is not supported with several models yet (each would warm up at load)")
        for entry in entries_from_args(models):
            # --parallel auto plans each model on its own (the pool swaps idle models out, so each is planned for
            # the whole device); its limit becomes that engine's device_memory, as --device-memory does for all
            kwargs = engine_kwargs(args, model=entry.checkpoint)
            parallel = kwargs["parallel"]
            entries.append(attrs.evolve(entry, caches=tuple(kwargs["cache_methods"]), offload=kwargs["offload"],
                                        options=dict(kwargs["model_options"]),
                                        vae_decode_precision=kwargs["vae_decode_precision"],
                                        parallel=parallel if parallel.enabled else None,
                                        compile=kwargs["compile"], quantization=kwargs.get("quantization"),
                                        device_memory=kwargs.get("device_memory")))
    check_unique(entries)
    if getattr(settings, "lora_modules", ()) or getattr(settings, "lora_dirs", ()):
        raise ConfigError("--lora-modules", "is not supported with several models yet; serve the model that uses "
                                            "adapters on its own")
    return entries, budget, host_budget


def prepare_pool(args: argparse.Namespace, models: list[str], host: PluginHost,
                 settings: Settings) -> tuple[list[str], Callable[[Settings], ModelPool]]:
    """Check every model without loading it; return the served names and the factory of their
    :class:`~omnicore.pool.pool.ModelPool` (``serve_cmd`` serves it as it serves one engine)."""
    from ..engine.model_options import resolve_model_options
    from .checks import resolve_before_load

    entries, budget, host_budget = pool_entries(args, models, settings)
    for entry in entries:  # a model that names nothing, or a bad option, fails here: one line, exit 2
        spec, _ = resolve_before_load(entry.checkpoint, host)
        if spec is not None:
            resolve_model_options(spec, entry.options)

    def make_pool(settings: Settings) -> ModelPool:
        from ..pool.pool import ModelPool

        return ModelPool(entries, host=host, settings=settings, memory_budget=budget, host_memory_budget=host_budget)

    return [e.name for e in entries], make_pool
