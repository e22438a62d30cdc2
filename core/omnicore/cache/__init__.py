"""Cache methods: step caches on the ``omnicore_denoise`` hook (TeaCache, first-block cache)
and the exact-schedule AdaLN modulation cache. Each is enabled by ``apply_x(pipeline, config) -> handle``
and undone by ``handle.remove()``; the built-in plugin registers them as ``CacheMethodSpec``s."""

from ..blocks import BlockLoop
from ._step import StepCache, StepCacheConfig, StepStats
from .first_block_cache import FirstBlockCache, FirstBlockCacheConfig, apply_first_block_cache
from .teacache import TeaCache, TeaCacheAdapter, TeaCacheConfig, apply_teacache, resolve_threshold

__all__ = [
    "BlockLoop", "FirstBlockCache", "FirstBlockCacheConfig", "StepCache", "StepCacheConfig", "StepStats",
    "TeaCache", "TeaCacheAdapter", "TeaCacheConfig", "apply_first_block_cache", "apply_teacache",
    "resolve_threshold",
]
