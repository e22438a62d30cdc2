"""Apply the engine's ``offload`` option to a loaded pipeline using what the pipeline declares.

- ``"layerwise"``: the blocks of ``pipeline.block_loop`` (a :class:`~omnicore.cache.BlockLoop`) visit the device
  one at a time, the next one prefetched.
- ``"model"``: each module of ``pipeline.offload_modules`` (a mapping name -> module whose ``forward`` is its
  entry point) visits the device for its forward and leaves afterwards.

Parameters named by ``pipeline.offload_excluded_prefixes`` (e.g. weights a cache owns) stay resident.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedFeature

OFFLOAD_MODES = ("none", "model", "layerwise")


def apply_offload(pipeline: Any, mode: str, device: Any) -> list[Any]:
    """Offload per ``mode``; returns handles whose ``remove()`` puts everything back on the device."""
    if mode == "none":
        return []
    excluded = tuple(getattr(pipeline, "offload_excluded_prefixes", ()) or ())
    name = getattr(getattr(pipeline, "spec", None), "name", type(pipeline).__name__)
    if mode == "layerwise":
        from ..cache.first_block_cache import BlockLoop
        from ..offload import apply_layerwise_offload

        loop = getattr(pipeline, "block_loop", None)
        if not isinstance(loop, BlockLoop):
            raise UnsupportedFeature("offload", f"model {name!r} declares no block loop (pipeline.block_loop); "
                                                "layer-wise offload needs one")
        return [apply_layerwise_offload(loop.resolve(pipeline), device=device, excluded_prefixes=excluded)]
    if mode == "model":
        from ..offload import apply_model_offload

        modules = getattr(pipeline, "offload_modules", None)
        if not modules:
            raise UnsupportedFeature("offload", f"model {name!r} declares no offload_modules; "
                                                "model-level offload needs them")
        handles = []
        try:
            for module in dict(modules).values():
                handles.append(apply_model_offload(module, device=device, excluded_prefixes=excluded))
        except Exception:
            for handle in handles:
                handle.remove()
            raise
        return handles
    raise UnsupportedFeature("offload", f"unknown mode {mode!r}; expected one of {list(OFFLOAD_MODES)}")
