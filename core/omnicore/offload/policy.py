"""Apply the engine's ``offload`` option to a loaded pipeline using what the pipeline declares.

- ``"layerwise"``: the blocks of ``pipeline.block_loop`` (a :class:`~omnicore.cache.BlockLoop`) visit the device
  one at a time, the next one prefetched.
- ``"model"``: each module of ``pipeline.offload_modules`` (a mapping name -> module whose ``forward`` is its
  entry point) visits the device for its forward and leaves afterwards.

Parameters that stay resident, outside the transfer set: those named by ``pipeline.offload_excluded_prefixes``
and those of the ``resident`` modules the caller passes: the modules an enabled cache method owns (it may offload
those weights itself; docs/contracts-status.md C1.7), as each method declares them
(:meth:`omnicore.specs.CacheMethodSpec.resident_modules`) — offload knows no cache method by name. Prefixes are
relative to each offloaded module (a block, or a whole model).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..errors import UnsupportedFeature

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .layerwise import LayerwiseOffload
    from .model import ModelOffload

OFFLOAD_MODES = ("none", "model", "layerwise")


def resident_prefixes(roots: Sequence[nn.Module], resident: Iterable[nn.Module]) -> tuple[str, ...]:
    """Parameter-name prefixes (relative to each of ``roots``) of the ``resident`` modules found under them."""
    owned = {id(m) for m in resident}
    if not owned:
        return ()
    prefixes: list[str] = []
    for root in roots:
        for name, module in root.named_modules():
            if id(module) in owned:
                prefix = f"{name}." if name else ""
                if prefix not in prefixes:
                    prefixes.append(prefix)
    return tuple(prefixes)


def apply_offload(pipeline: object, mode: str, device: torch.device | str,
                  resident: Iterable[nn.Module] = ()) -> list[LayerwiseOffload | ModelOffload]:
    """Offload per ``mode``; returns handles whose ``remove()`` puts everything back on the device. The parameters
    of ``resident`` modules (what enabled cache methods own) stay where they are."""
    if mode == "none":
        return []
    declared = tuple(getattr(pipeline, "offload_excluded_prefixes", ()) or ())
    owned = tuple(resident)
    name = getattr(getattr(pipeline, "spec", None), "name", type(pipeline).__name__)
    if mode == "layerwise":
        from ..blocks import BlockLoop
        from ..offload import apply_layerwise_offload

        loop = getattr(pipeline, "block_loop", None)
        if not isinstance(loop, BlockLoop):
            raise UnsupportedFeature("offload", f"model {name!r} declares no block loop (pipeline.block_loop); "
                                                "layer-wise offload needs one")
        blocks = loop.resolve(pipeline)
        excluded = declared + resident_prefixes(blocks, owned)
        return [apply_layerwise_offload(blocks, device=device, excluded_prefixes=excluded)]
    if mode == "model":
        from ..offload import apply_model_offload

        modules = getattr(pipeline, "offload_modules", None)
        if not modules:
            raise UnsupportedFeature("offload", f"model {name!r} declares no offload_modules; "
                                                "model-level offload needs them")
        handles: list[LayerwiseOffload | ModelOffload] = []
        try:
            for module in dict(modules).values():
                excluded = declared + resident_prefixes([module], owned)
                handles.append(apply_model_offload(module, device=device, excluded_prefixes=excluded))
        except Exception:
            for handle in handles:
                handle.remove()
            raise
        return handles
    raise UnsupportedFeature("offload", f"unknown mode {mode!r}; expected one of {list(OFFLOAD_MODES)}")
