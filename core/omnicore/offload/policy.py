"""Apply the engine's ``offload`` option to a loaded pipeline using what the pipeline declares.

- ``"layerwise"``: the blocks of ``pipeline.block_loop`` (a :class:`~omnicore.cache.BlockLoop`) visit the device
  one at a time, the next one prefetched.
- ``"model"``: each module of ``pipeline.offload_modules`` (a mapping name -> module whose ``forward`` is its
  entry point) visits the device for its forward and leaves afterwards.

Parameters that stay resident, outside the transfer set: those named by ``pipeline.offload_excluded_prefixes``
and, when the ``adaln_schedule`` cache method is enabled, the ``linear`` of every projection its controller
owns (the cache may offload those weights itself; docs/contracts-status.md C1.7). Prefixes are relative to each
offloaded module (a block, or a whole model).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import UnsupportedFeature

OFFLOAD_MODES = ("none", "model", "layerwise")


def cache_owned_prefixes(pipeline: Any, roots: Sequence[Any], cache_methods: Iterable[str]) -> tuple[str, ...]:
    """Parameter-name prefixes (relative to each of ``roots``) that enabled cache methods own."""
    if "adaln_schedule" not in set(cache_methods):
        return ()
    from ..cache.adaln_schedule import AdaLNScheduleController

    controller = getattr(pipeline, "adaln_schedule", None)
    if not isinstance(controller, AdaLNScheduleController):
        return ()
    owned = {id(p) for p in controller.projections}
    prefixes: list[str] = []
    for root in roots:
        for name, module in root.named_modules():
            if id(module) in owned:
                prefix = f"{name}.linear." if name else "linear."
                if prefix not in prefixes:
                    prefixes.append(prefix)
    return tuple(prefixes)


def apply_offload(pipeline: Any, mode: str, device: Any, cache_methods: Iterable[str] = ()) -> list[Any]:
    """Offload per ``mode``; returns handles whose ``remove()`` puts everything back on the device."""
    if mode == "none":
        return []
    declared = tuple(getattr(pipeline, "offload_excluded_prefixes", ()) or ())
    methods = tuple(cache_methods)
    name = getattr(getattr(pipeline, "spec", None), "name", type(pipeline).__name__)
    if mode == "layerwise":
        from ..blocks import BlockLoop
        from ..offload import apply_layerwise_offload

        loop = getattr(pipeline, "block_loop", None)
        if not isinstance(loop, BlockLoop):
            raise UnsupportedFeature("offload", f"model {name!r} declares no block loop (pipeline.block_loop); "
                                                "layer-wise offload needs one")
        blocks = loop.resolve(pipeline)
        excluded = declared + cache_owned_prefixes(pipeline, blocks, methods)
        return [apply_layerwise_offload(blocks, device=device, excluded_prefixes=excluded)]
    if mode == "model":
        from ..offload import apply_model_offload

        modules = getattr(pipeline, "offload_modules", None)
        if not modules:
            raise UnsupportedFeature("offload", f"model {name!r} declares no offload_modules; "
                                                "model-level offload needs them")
        handles = []
        try:
            for module in dict(modules).values():
                excluded = declared + cache_owned_prefixes(pipeline, [module], methods)
                handles.append(apply_model_offload(module, device=device, excluded_prefixes=excluded))
        except Exception:
            for handle in handles:
                handle.remove()
            raise
        return handles
    raise UnsupportedFeature("offload", f"unknown mode {mode!r}; expected one of {list(OFFLOAD_MODES)}")
