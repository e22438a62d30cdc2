"""Shared machinery of step caches: the denoise-hook plugin, the reuse rules and request-scoped state.

How a step cache plugs in. ``apply(pipeline, config)`` builds a :class:`StepCache` and registers it on the
plugin host's pluggy manager as a plugin object with two ``omnicore_denoise`` implementations:

* a ``tryfirst`` one that decides, for this pipeline only, whether step ``step`` may reuse; on a reuse it
  returns ``pipeline.update(state, step, reused_prediction)`` (the model is skipped), otherwise ``None`` so
  the call falls through to the model (the core's ``trylast`` ``denoise_step``);
* a ``wrapper`` that, after a computed step, records what the cache needs (``state.last_prediction``).

The host comes from ``config.host`` or, when that is unset, ``pipeline.host``; with neither the method
cannot be enabled (:class:`~omnicore.errors.ConfigError` on ``host``). ``handle.remove()`` unregisters the
plugin object and undoes every change, leaving the pipeline as it was.

Rules every step cache obeys (tested): no reuse during the first ``warmup_steps`` steps; the last step
(``state.num_steps - 1``) is always computed; nothing is reused before something was computed for this
state; at most ``max_consecutive_hits`` reuses in a row; per-state bookkeeping is keyed by the state object
itself, so a new batch (a new state object) or a step index that does not advance starts afresh.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import attrs

from ..errors import ConfigError
from ..hookspecs import hookimpl

if TYPE_CHECKING:
    import pluggy
    import torch

    from ..engine.protocol import DenoiseState, Pipeline
    from ..registry import Registry
    from ..specs import PlatformSpec


class PluginHostLike(Protocol):
    """What a cache method needs of the plugin host (:class:`omnicore.plugin_host.PluginHost`)."""

    @property
    def pm(self) -> pluggy.PluginManager: ...

    @property
    def platforms(self) -> Registry[PlatformSpec]: ...


def _frozen_steps(value: Iterable[int] | None) -> frozenset[int] | None:
    if value is None:
        return None
    steps = frozenset(value)
    for s in steps:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ConfigError("force_hits", f"must hold non-negative step indices, got {s!r}")
    return steps


def _check_non_negative(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(attribute.name, f"must be a non-negative integer, got {value!r}")


def _check_optional_positive(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(attribute.name, f"must be a positive integer or None, got {value!r}")


@attrs.define(kw_only=True)
class StepCacheConfig:
    """Fields shared by every step cache.

    - ``host``: the plugin host whose ``omnicore_denoise`` hook the cache joins (default: ``pipeline.host``).
    - ``warmup_steps``: the first steps that are always computed (the latent changes fastest there).
    - ``force_hits``: a fixed set of step indices to reuse, replacing the similarity test (benchmarks and
      tests); the rules above still apply, so a forced index in the warm-up or at the last step computes.
    - ``max_consecutive_hits``: cap on reuses in a row (``None`` = no cap).
    """

    host: PluginHostLike | None = None
    warmup_steps: int = attrs.field(default=1, validator=_check_non_negative)
    force_hits: frozenset[int] | None = attrs.field(default=None, converter=_frozen_steps)
    max_consecutive_hits: int | None = attrs.field(default=None, validator=_check_optional_positive)


@attrs.define
class StepStats:
    """What happened to one state: which steps ran the model and which reused."""

    computed: list[int] = attrs.Factory(list)
    reused: list[int] = attrs.Factory(list)


@attrs.define
class RequestState:
    """Per-state bookkeeping; subclasses' data lives in ``data`` (owned by the concrete cache)."""

    last_step: int = -1
    consecutive_hits: int = 0
    pending_step: int | None = None  # a computed step whose prediction the wrapper still has to record
    stats: StepStats = attrs.Factory(StepStats)
    data: dict[str, Any] = attrs.Factory(dict)


class _StateTable:
    """Request states keyed by the denoise-state object: weakly where possible, else only the latest."""

    def __init__(self) -> None:
        self._weak: weakref.WeakKeyDictionary[DenoiseState, RequestState] = weakref.WeakKeyDictionary()
        self._latest: tuple[DenoiseState, RequestState] | None = None

    def get(self, state: DenoiseState) -> RequestState | None:
        try:
            return self._weak.get(state)
        except TypeError:
            latest = self._latest
            return latest[1] if latest is not None and latest[0] is state else None

    def put(self, state: DenoiseState, rs: RequestState) -> None:
        try:
            self._weak[state] = rs
        except TypeError:
            self._latest = (state, rs)

    def clear(self) -> None:
        self._weak = weakref.WeakKeyDictionary()
        self._latest = None


def _note_reuse(state: DenoiseState, step: int) -> None:
    """Tell the batch's state that ``step`` was reused (the engine reports the count as cache_reused_steps)."""
    steps = getattr(state, "reused_steps", None)
    if isinstance(steps, list):
        steps.append(step)


C = TypeVar("C", bound=attrs.AttrsInstance)
S = TypeVar("S", bound="StepCache")


def coerce_config(cls: type[C], config: object, method: str) -> C:
    """A cache method's config from ``None`` (defaults), an instance, or a dict of its fields; anything else,
    or an unknown field, is a :class:`ConfigError` naming the method and the known fields."""
    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    if isinstance(config, dict):
        known = [a.name for a in attrs.fields(cls)]
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ConfigError(method, f"unknown option(s) {unknown}; known: {', '.join(known)}")
        return cls(**config)
    raise ConfigError(method, f"expected {cls.__name__}, a dict or None, got {type(config).__name__}")


def resolve_host(pipeline: object, config: object, method: str) -> PluginHostLike:
    host = getattr(config, "host", None) or getattr(pipeline, "host", None)
    if host is None or not hasattr(host, "pm"):
        raise ConfigError("host", f"cache method {method!r} needs the plugin host: pass it as config.host or "
                                  f"set pipeline.host")
    return host


class StepCache:
    """Base of the step caches; subclasses implement :meth:`decide` and may extend :meth:`record`."""

    method = "step_cache"

    def __init__(self, pipeline: Pipeline, config: StepCacheConfig) -> None:
        self.pipeline = pipeline
        self.config = config
        self.host = resolve_host(pipeline, config, self.method)
        self._states = _StateTable()
        self.last_stats: StepStats | None = None
        self._registered_name: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def register(self: S) -> S:
        name = f"omnicore.cache.{self.method}@{id(self.pipeline):x}"
        if self.host.pm.get_plugin(name) is not None:
            raise ConfigError("cache_methods", f"{self.method!r} is already enabled on this pipeline")
        self.host.pm.register(self, name=name)
        self._registered_name = name
        return self

    def remove(self) -> None:
        """Leave the denoise hook and forget every request state (idempotent)."""
        if self._registered_name is not None:
            plugin = self.host.pm.get_plugin(self._registered_name)
            if plugin is self:
                self.host.pm.unregister(self, name=self._registered_name)
            self._registered_name = None
        self._states.clear()

    @property
    def active(self) -> bool:
        return self._registered_name is not None

    def stats(self, state: DenoiseState) -> StepStats | None:
        rs = self._states.get(state)
        return rs.stats if rs is not None else None

    # ------------------------------------------------------------------ hook implementations
    @hookimpl(tryfirst=True, specname="omnicore_denoise")
    def _denoise_decide(self, pipeline: Pipeline, state: DenoiseState, step: int) -> DenoiseState | None:
        if pipeline is not self.pipeline:
            return None
        rs = self._states.get(state)
        if rs is None or step <= rs.last_step:
            rs = RequestState()
            self._states.put(state, rs)
            self.on_new_state(rs, state)
        rs.last_step = step
        rs.pending_step = None
        self.last_stats = rs.stats
        permitted = self.may_reuse(rs, state, step)
        result = self.decide(rs, state, step, permitted)
        if result is not None:
            rs.consecutive_hits += 1
            rs.stats.reused.append(step)
            _note_reuse(state, step)
        else:
            rs.pending_step = step
        return result

    @hookimpl(wrapper=True, specname="omnicore_denoise")
    def _denoise_record(self, pipeline: Pipeline, state: DenoiseState,
                        step: int) -> Generator[None, DenoiseState | None, DenoiseState | None]:
        result = yield
        if pipeline is self.pipeline:
            rs = self._states.get(state)
            if rs is not None and rs.pending_step == step:
                rs.pending_step = None
                if self.record(rs, state if result is None else result, step):
                    rs.consecutive_hits += 1
                    rs.stats.reused.append(step)
                    _note_reuse(state, step)
                else:
                    rs.consecutive_hits = 0
                    rs.stats.computed.append(step)
        return result

    # ------------------------------------------------------------------ rules and extension points
    def may_reuse(self, rs: RequestState, state: DenoiseState, step: int) -> bool:
        """The rules shared by all step caches (see the module docstring)."""
        num_steps = getattr(state, "num_steps", None)
        if step < self.config.warmup_steps:
            return False
        if num_steps is None or step >= num_steps - 1:
            return False
        if not self.has_cached(rs):
            return False
        cap = self.config.max_consecutive_hits
        return cap is None or rs.consecutive_hits < cap

    def forced(self, step: int) -> bool | None:
        """``True``/``False`` when a forced pattern decides this step, ``None`` when the cache's test does."""
        pattern = self.config.force_hits
        return None if pattern is None else step in pattern

    def on_new_state(self, rs: RequestState, state: DenoiseState) -> None:
        """A new batch starts (override to reset model-side state)."""

    def has_cached(self, rs: RequestState) -> bool:
        return "prediction" in rs.data

    def decide(self, rs: RequestState, state: DenoiseState, step: int, permitted: bool) -> DenoiseState | None:
        raise NotImplementedError

    def record(self, rs: RequestState, state: DenoiseState, step: int) -> bool:
        """After a step that ran the model: keep the prediction the pipeline left in ``state.last_prediction``.

        Returns ``True`` when the step turned out to be a reuse after all (a cache that skips inside the
        model, like the first-block cache), else ``False``.
        """
        prediction = getattr(state, "last_prediction", None)
        if prediction is None:
            raise RuntimeError(
                f"{self.method}: step {step} was computed but the pipeline left no state.last_prediction; "
                f"step caches need denoise_step to record the model's prediction there"
            )
        rs.data["prediction"] = prediction
        return False

    def reuse(self, state: DenoiseState, step: int, prediction: torch.Tensor) -> DenoiseState:
        """Finish a reused step through the pipeline's sampler update."""
        if hasattr(state, "last_prediction"):
            state.last_prediction = prediction
        return self.pipeline.update(state, step, prediction)
