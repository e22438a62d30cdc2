"""diffusers' other step caches on the adapter: ``--cache taylorseer_cache`` / ``pyramid_attention_broadcast`` /
``faster_cache`` / ``mag_cache``, each enabled through the denoiser's own ``enable_cache`` with diffusers' config.

They are registered as omnicore cache methods by this plugin (``omnicore_register_cache_methods``), so the
names are known to ``--cache``, ``omnicore models`` and the server like the core's methods; they apply only to
the diffusers adapter's pipelines (another model refuses them at load, since its spec does not list them). The
config keys are the fields of diffusers' config dataclass (``--cache taylorseer_cache:cache_interval=3``);
an unknown key is refused naming it. Methods that gate on the timestep (pyramid attention broadcast, faster cache)
read it from the pipeline's ``current_timestep``, set by diffusers' loop. These hooks decide inside the
denoiser's blocks, so omnicore cannot count the reused steps: ``cache_reused_steps`` is ``None`` (unknown) with
them.
``mag_cache`` needs the per-model ``mag_ratios`` of diffusers' calibration (a required key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from omnicore.plugin import CacheMethodSpec, ConfigError, UnsupportedFeature

#: omnicore method name -> (diffusers config class in ``diffusers.hooks``, whether it takes a timestep callback)
HOOK_CACHES: dict[str, tuple[str, bool]] = {
    "taylorseer_cache": ("TaylorSeerCacheConfig", False),
    "pyramid_attention_broadcast": ("PyramidAttentionBroadcastConfig", True),
    "faster_cache": ("FasterCacheConfig", True),
    "mag_cache": ("MagCacheConfig", False),
}
ALL_CACHES = ("first_block_cache", *HOOK_CACHES)

_DESCRIPTIONS = {
    "taylorseer_cache": "diffusers' TaylorSeer: full steps every cache_interval, Taylor-extrapolated outputs between",
    "pyramid_attention_broadcast": "diffusers' pyramid attention broadcast: attention outputs reused across steps",
    "faster_cache": "diffusers' FasterCache: attention reuse plus skipping the unconditional branch",
    "mag_cache": "diffusers' MagCache: residual reuse by calibrated magnitude ratios (needs mag_ratios)",
}


def register(add: Callable[[CacheMethodSpec], None]) -> None:
    """The method records (one job: the names; :func:`enable` does the work on the adapter's pipelines)."""
    for name in HOOK_CACHES:
        add(CacheMethodSpec(name=name, impl="omni_diffusers.hook_caches:refuse_elsewhere",
                            conflicts=tuple(n for n in ALL_CACHES if n != name),
                            description=_DESCRIPTIONS[name] + " (diffusers adapter only)",
                            provider="omni-plugin-diffusers"))


def refuse_elsewhere(pipeline: Any, config: Any) -> Any:
    """The core's fallback ``impl``: reached only for a pipeline that is not the adapter's."""
    raise UnsupportedFeature("cache_methods", f"diffusers' hook caches apply to the diffusers adapter's pipelines "
                                              f"only, not {type(pipeline).__name__}")


def _items(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    return {k: v for k, v in vars(config).items() if v is not None}


def build_config(name: str, config: Any, timestep: Callable[[], Any] | None = None) -> Any:
    """diffusers' config object for method ``name`` from omnicore's ``config`` (fields checked by name)."""
    import diffusers.hooks as hooks

    class_name, takes_timestep = HOOK_CACHES[name]
    cls = getattr(hooks, class_name)
    fields = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    managed = {"current_timestep_callback"} if takes_timestep else set()
    items = _items(config)
    unknown = sorted(k for k in items if k not in fields or k in managed)
    if unknown:
        raise ConfigError(unknown[0], f"{', '.join(unknown)}: not a field of diffusers' {class_name} (fields: "
                                      f"{', '.join(sorted(fields - managed))})")
    if takes_timestep:
        items["current_timestep_callback"] = timestep
    try:
        return cls(**items)
    except (TypeError, ValueError) as exc:
        raise ConfigError(name, f"diffusers' {class_name} refused the config: {exc}") from None


class DiffusersHookCache:
    """An enabled hook cache; ``remove()`` disables it on every denoiser."""

    def __init__(self, pipeline: Any, name: str, config: Any) -> None:
        self.denoisers = [m for m in pipeline.denoisers if hasattr(m, "enable_cache")]
        if not self.denoisers:
            raise UnsupportedFeature("cache_methods", f"{type(pipeline.pipe).__name__}'s denoiser has no diffusers "
                                                      "cache support (CacheMixin)")
        pipe, self.pipeline = pipeline.pipe, pipeline
        try:
            for model in self.denoisers:
                model.enable_cache(build_config(name, config, lambda: pipe.current_timestep))
            pipeline.uncounted_cache = True
        except ConfigError:
            self.remove()
            raise
        except Exception as exc:
            self.remove()
            raise UnsupportedFeature("cache_methods", f"diffusers' {name} does not apply to "
                                                      f"{type(pipe).__name__}: {exc}") from exc

    def remove(self) -> None:
        for model in self.denoisers:
            if getattr(model, "is_cache_enabled", False):
                model.disable_cache()
        self.pipeline.uncounted_cache = False


__all__ = ["ALL_CACHES", "HOOK_CACHES", "DiffusersHookCache", "build_config", "register"]
