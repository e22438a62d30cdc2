"""``adaln_schedule`` as a cache method: prepare once per batch, pass the step index on every step.

The pipeline declares two things:

- ``pipeline.adaln_schedule`` — the model's :class:`AdaLNScheduleController`;
- ``pipeline.adaln_schedule_plan(state) -> (plan, key)`` — per step the unique timesteps (on the model
  device) and the schedule key (see :func:`~omnicore.cache.adaln_schedule.keys.schedule_key`).

The handle joins the ``omnicore_denoise`` hook (``tryfirst``, always returning ``None``): at the first step
of a new state it loads the weights of a model-offloaded module holding the projections (the reference's
"prepare for request caches"), prepares the controller (``offload_weights`` from the config) and stores
the result in ``state.extras["adaln_schedule"]``; on every step it sets ``state.extras["adaln_step_index"]`` to the step
while a schedule is active (removing the key otherwise) — the pipeline's ``predict`` passes it to the model
as ``adaln_step_index``. ``handle.remove()`` leaves the hook and clears the controller (weights restored).

When weight offload moved bytes off the device, the handle releases that device's allocator cache through the
platform serving it (``Platform.empty_cache``: ``torch.cuda.empty_cache`` on CUDA, the NPU's equivalent, a no-op
on the CPU): ``pipeline.platform`` when the pipeline keeps one for that device type, else the host's highest
priority available platform of that device type.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import attrs

from ...errors import ConfigError, UnsupportedFeature
from ...hookspecs import hookimpl
from .._step import coerce_config, resolve_host
from .controller import AdaLNScheduleController

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ...engine.protocol import DenoiseState, Pipeline
    from ...platforms.base import Platform
    from .._step import PluginHostLike

METHOD_NAME = "adaln_schedule"
STATE_CACHE_KEY = "adaln_schedule"
STATE_STEP_KEY = "adaln_step_index"


@attrs.define(kw_only=True)
class AdaLNScheduleConfig:
    """``offload_weights``: after the tables are installed, free the projection weights' device storage
    (only when the tables are smaller). ``host``: the plugin host (default ``pipeline.host``)."""

    host: PluginHostLike | None = None
    offload_weights: bool = False


class AdaLNScheduleHandle:
    method = METHOD_NAME

    def __init__(self, pipeline: Any, config: AdaLNScheduleConfig) -> None:  # a pipeline with a schedule
        controller = getattr(pipeline, "adaln_schedule", None)
        if not isinstance(controller, AdaLNScheduleController) or not callable(
                getattr(pipeline, "adaln_schedule_plan", None)):
            raise UnsupportedFeature(METHOD_NAME, f"{type(pipeline).__name__} declares no AdaLN schedule "
                                                  f"(pipeline.adaln_schedule and adaln_schedule_plan)")
        self.pipeline = pipeline
        self.config = config
        self.controller = controller
        self.host = resolve_host(pipeline, config, METHOD_NAME)
        self._seen: weakref.WeakSet[DenoiseState] = weakref.WeakSet()
        self._name = f"omnicore.cache.{METHOD_NAME}@{id(pipeline):x}"
        if self.host.pm.get_plugin(self._name) is not None:
            raise ConfigError("cache_methods", f"{METHOD_NAME!r} is already enabled on this pipeline")
        self.host.pm.register(self, name=self._name)
        self._platforms: dict[str, Platform | None] = {}
        self._previous_release = controller.release_cached_memory
        controller.release_cached_memory = self.release_cached_memory

    def platform_for(self, device: torch.device | str) -> Platform | None:
        """The platform whose allocator owns ``device`` (see the module docstring); ``None`` when none is known."""
        kind = getattr(device, "type", str(device))
        if kind in self._platforms:
            return self._platforms[kind]
        platform = getattr(self.pipeline, "platform", None)
        if getattr(platform, "device_type", None) != kind:
            platform = None
            specs = sorted((s for s in self.host.platforms if s.device_type == kind),
                           key=lambda s: (-s.priority, s.name))
            for spec in specs:
                if spec.unavailable_reason() is None:
                    platform = spec.load_impl()()
                    break
        self._platforms[kind] = platform
        return platform

    def release_cached_memory(self, device: torch.device) -> None:
        """After the projections' weights left ``device``: give the freed blocks back to it."""
        platform = self.platform_for(device)
        if platform is not None:
            platform.empty_cache()

    @hookimpl(tryfirst=True, specname="omnicore_denoise")
    def _denoise(self, pipeline: Any, state: DenoiseState, step: int) -> None:
        if pipeline is not self.pipeline:
            return None
        extras = state.extras
        if state not in self._seen or STATE_CACHE_KEY not in extras:
            self._seen.add(state)
            self._materialize()
            plan, key = pipeline.adaln_schedule_plan(state)
            # prepare runs under no_grad (not inference_mode): the cursor and restored weights must stay
            # writable/usable by an engine that runs steps under plain no_grad.
            extras[STATE_CACHE_KEY] = self.controller.prepare(plan, key,
                                                              offload_weights=self.config.offload_weights)
        if extras[STATE_CACHE_KEY] is not None:
            extras[STATE_STEP_KEY] = step
        else:
            extras.pop(STATE_STEP_KEY, None)
        return None

    def _materialize(self) -> None:
        """Load the weights of model-offloaded modules holding the projections, so that building the tables
        (time embedder + projections) sees real weights; the module's next forward releases them again."""
        modules = getattr(self.pipeline, "offload_modules", None)
        if not modules:
            return
        from ...offload import materialize

        owned = {id(p) for p in self.controller.projections}
        for module in dict(modules).values():
            if any(id(m) in owned for m in module.modules()):
                materialize(module)

    def remove(self) -> None:
        if self.host.pm.get_plugin(self._name) is self:
            self.host.pm.unregister(self, name=self._name)
        self.controller.clear()
        if self.controller.release_cached_memory == self.release_cached_memory:
            self.controller.release_cached_memory = self._previous_release


def resident_modules(pipeline: object) -> list[nn.Module]:
    """The linears of the pipeline's AdaLN projections: this method owns their weights (it may offload them
    itself), so weight offload leaves them resident (``CacheMethodSpec.resident``)."""
    controller = getattr(pipeline, "adaln_schedule", None)
    if not isinstance(controller, AdaLNScheduleController):
        return []
    return [projection.linear for projection in controller.projections]


def apply_adaln_schedule(pipeline: Pipeline, config: AdaLNScheduleConfig | dict[str, object] | None = None
                         ) -> AdaLNScheduleHandle:
    return AdaLNScheduleHandle(pipeline, coerce_config(AdaLNScheduleConfig, config, METHOD_NAME))
