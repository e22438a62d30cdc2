"""``--cache first_block_cache`` on a diffusers pipeline, through diffusers' own first-block cache hooks.

omnicore's own first-block cache needs the engine to drive the transformer blocks (``block_loop``); a stock
diffusers pipeline runs its loop itself, so the adapter enables diffusers' ``FirstBlockCacheConfig`` on the
denoiser instead (``threshold``: diffusers' relative-L1 threshold on the first block's residual). To report
``cache_reused_steps`` the adapter records each decision of diffusers' head-block hook: a step whose every
denoiser call skipped the remaining blocks counts as reused. ``force_hits`` and the other keys of omnicore's step
caches have no counterpart in diffusers' hook and are refused by name.
"""

from __future__ import annotations

from typing import Any

from omnicore.plugin import ConfigError, UnsupportedFeature

KEYS = ("threshold",)


def _threshold(config: Any) -> float:
    if config is None:
        return 0.05  # diffusers' default
    items = dict(config) if isinstance(config, dict) else {k: v for k, v in vars(config).items() if v is not None}
    unknown = sorted(k for k in items if k not in KEYS)
    if unknown:
        raise ConfigError(unknown[0], f"{', '.join(unknown)}: diffusers' first-block cache takes only "
                                      f"{', '.join(KEYS)} (with the diffusers adapter)")
    value = items.get("threshold", 0.05)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError("threshold", f"must be a number > 0, got {value!r}")
    return float(value)


class DiffusersFirstBlockCache:
    """The enabled cache; ``remove()`` disables it on every denoiser and stops recording decisions."""

    def __init__(self, pipeline: Any, threshold: float) -> None:
        from diffusers.hooks import FirstBlockCacheConfig, HookRegistry

        self.pipeline = pipeline
        self.denoisers = [m for m in pipeline.denoisers if hasattr(m, "enable_cache")]
        if not self.denoisers:
            raise UnsupportedFeature("cache_methods", f"{type(pipeline.pipe).__name__}'s denoiser has no diffusers "
                                                      "cache support (CacheMixin)")
        self.decisions: list[bool] = []  # True = the remaining blocks were computed
        try:
            for model in self.denoisers:
                model.enable_cache(FirstBlockCacheConfig(threshold=threshold))
                for module in model.modules():
                    registry = getattr(module, "_diffusers_hook", None)
                    hook = registry.get_hook("fbc_leader_block_hook") if isinstance(registry, HookRegistry) else None
                    if hook is not None:
                        self._record(hook)
        except Exception as exc:
            self.remove()
            raise UnsupportedFeature("cache_methods", f"diffusers' first-block cache does not apply to "
                                                      f"{type(pipeline.pipe).__name__}: {exc}") from exc
        pipeline.cache_decisions = self.decisions

    def _record(self, hook: Any) -> None:
        decide = hook._should_compute_remaining_blocks

        def recorded(*args: Any, **kwargs: Any) -> bool:
            answer = bool(decide(*args, **kwargs))
            self.decisions.append(answer)
            return answer

        hook._should_compute_remaining_blocks = recorded

    def remove(self) -> None:
        for model in self.denoisers:
            if getattr(model, "is_cache_enabled", False):
                model.disable_cache()
        if getattr(self.pipeline, "cache_decisions", None) is self.decisions:
            self.pipeline.cache_decisions = None


def enable(pipeline: Any, method: Any, config: Any) -> Any:
    """Enable ``method`` on the adapter's ``pipeline``: the first-block cache here, diffusers' other hook caches
    through :mod:`omni_diffusers.hook_caches`; omnicore's own methods (TeaCache, ...) are refused by name."""
    from .hook_caches import ALL_CACHES, HOOK_CACHES, DiffusersHookCache

    if method.name in HOOK_CACHES:
        return DiffusersHookCache(pipeline, method.name, config)
    if method.name != "first_block_cache":
        raise UnsupportedFeature("cache_methods", f"the diffusers adapter supports {', '.join(ALL_CACHES)} "
                                                  f"(diffusers' hooks), not {method.name!r}")
    return DiffusersFirstBlockCache(pipeline, _threshold(config))
