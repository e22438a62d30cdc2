"""TeaCache as a generic step cache (Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video
Diffusion Model", 2024).

The model plugin supplies a :class:`TeaCacheAdapter`: a function giving the *modulated input* of the first
transformer block for a step (cheap: embeddings + first AdaLN only), polynomial coefficients that rescale
the raw relative-L1 change of that input to an estimate of the output change, and an optional default
threshold. The cache accumulates the rescaled changes between steps and, while the accumulation stays below
``rel_l1_thresh``, reuses; a computed step resets the accumulator.

What a reuse reuses: the reference's TeaCache (and the thresholds calibrated with it) skips only the transformer
blocks — the model's input embedding and output head run on the current step, around the residual the blocks
added at the last computed step (output minus input of the block stack). A model with that hook declares
``keep_residual`` + ``reuse_residual``. Without it the generic fallback replays the last prediction (or the
last residual over ``adapter.residual_base``) through the sampler update.

The pipeline provides its adapter as ``pipeline.teacache_adapter`` (a :class:`TeaCacheAdapter` or a
zero-argument callable returning one; the callable may raise ``ValueError`` to refuse, e.g. for an
uncalibrated model variant, in which case nothing is enabled), or ``config.adapter`` overrides it.

Over a worker group (``--parallel``) every rank takes rank 0's reuse decision
(:func:`omnicore.parallel.consensus.rank0_flag`), so the ranks never diverge.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import attrs

from ..errors import ConfigError, UnsupportedFeature
from ..parallel.consensus import group_of, rank0_flag
from ._step import RequestState, StepCache, StepCacheConfig, coerce_config

if TYPE_CHECKING:
    import torch

    from ..engine.protocol import DenoiseState, Pipeline

METHOD_NAME = "teacache"
GLOBAL_DEFAULT_THRESHOLD = 0.2


def _float_tuple(value: Iterable[float]) -> tuple[float, ...]:
    return tuple(float(v) for v in value)


@attrs.frozen(kw_only=True)
class TeaCacheAdapter:
    """What a model declares for TeaCache.

    - ``extract(state, step) -> tensor``: the first block's modulated input at ``step`` (batch included).
    - ``coefficients``: polynomial rescale coefficients, highest power first (numpy ``polyval`` order).
    - ``default_threshold``: the model's calibrated ``rel_l1_thresh`` (``None`` → the global 0.2).
    - ``residual_base(state, step) -> tensor``: optional; when given, a reuse returns
      ``residual_base(now) + (prediction - residual_base)`` of the last computed step instead of the bare
      prediction (for models whose output is better extrapolated as a residual over their input).
    - ``keep_residual(state, step)`` and ``reuse_residual(state, step) -> prediction``: optional, together —
      the block-residual reuse. ``keep_residual`` is called before every step that runs the model: that
      forward keeps the residual its transformer blocks add; on a reuse, ``reuse_residual`` returns the step's
      prediction from the current input embedding plus that residual through the output head (blocks skipped).
      Takes precedence over ``residual_base`` and the prediction replay.
    """

    extract: Callable[[DenoiseState, int], torch.Tensor]
    coefficients: tuple[float, ...] = attrs.field(converter=_float_tuple, default=(1.0, 0.0))
    default_threshold: float | None = None
    residual_base: Callable[[DenoiseState, int], torch.Tensor] | None = None
    keep_residual: Callable[[DenoiseState, int], None] | None = None
    reuse_residual: Callable[[DenoiseState, int], torch.Tensor] | None = None

    def __attrs_post_init__(self) -> None:
        if (self.keep_residual is None) != (self.reuse_residual is None):
            raise ConfigError("teacache_adapter", "keep_residual and reuse_residual go together: give both or "
                                                  "neither")

    @property
    def reuses_block_residual(self) -> bool:
        """True when a reuse skips only the blocks (the reference's rule), False for the prediction replay."""
        return self.reuse_residual is not None


@attrs.define(kw_only=True)
class TeaCacheConfig(StepCacheConfig):
    """TeaCache settings (plus the shared step-cache fields).

    - ``rel_l1_thresh``: reuse while the accumulated rescaled change is below it. ``None`` → the adapter's
      default → 0.2. Larger is faster and lossier.
    - ``coefficients``: override the adapter's polynomial (highest power first).
    - ``adapter``: override the pipeline's adapter.
    """

    rel_l1_thresh: float | None = None
    coefficients: Sequence[float] | None = None
    adapter: TeaCacheAdapter | None = None


def resolve_threshold(config_value: float | None, model_default: float | None) -> float:
    """Explicit value, else the model's default, else 0.2; a non-positive or non-finite result is an error."""
    value = config_value if config_value is not None else (
        model_default if model_default is not None else GLOBAL_DEFAULT_THRESHOLD)
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ConfigError("rel_l1_thresh", f"rel_l1_thresh must be positive, got {value}")
    return value


def polyval(coefficients: Sequence[float], x: float) -> float:
    """Evaluate a polynomial given highest power first (Horner)."""
    acc = 0.0
    for c in coefficients:
        acc = acc * x + c
    return acc


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """mean|current - previous| / mean|previous| (infinite when the previous input is all zeros)."""
    current, previous = current.detach(), previous.detach()
    num = float((current - previous).abs().mean())
    den = float(previous.abs().mean())
    return num / den if den > 0 else math.inf


def _adapter_of(pipeline: Pipeline, config: TeaCacheConfig) -> TeaCacheAdapter:
    adapter = config.adapter if config.adapter is not None else getattr(pipeline, "teacache_adapter", None)
    if adapter is not None and not isinstance(adapter, TeaCacheAdapter) and callable(adapter):
        adapter = adapter()
    if not isinstance(adapter, TeaCacheAdapter):
        raise UnsupportedFeature(METHOD_NAME, f"{type(pipeline).__name__} provides no TeaCacheAdapter "
                                              f"(pipeline.teacache_adapter)")
    return adapter


class TeaCache(StepCache):
    method = METHOD_NAME

    def __init__(self, pipeline: Pipeline, config: TeaCacheConfig) -> None:
        adapter = _adapter_of(pipeline, config)
        self.adapter = adapter
        self.threshold = resolve_threshold(config.rel_l1_thresh, adapter.default_threshold)
        coeffs = tuple(float(c) for c in (config.coefficients if config.coefficients is not None
                                          else adapter.coefficients))
        if not coeffs:
            raise ConfigError("coefficients", "need at least one polynomial coefficient")
        self.coefficients = coeffs
        self.group = group_of(pipeline)
        super().__init__(pipeline, config)

    def decide(self, rs: RequestState, state: DenoiseState, step: int, permitted: bool) -> DenoiseState | None:
        forced = self.forced(step)
        if forced is None:
            current = self.adapter.extract(state, step)
            previous = rs.data.get("modulated")
            rs.data["modulated"] = current
            if previous is None or getattr(previous, "shape", None) != getattr(current, "shape", None):
                hit = False  # nothing to compare with: the first step, or the batch was re-packed (a request left)
            else:
                rs.data["accumulated"] = rs.data.get("accumulated", 0.0) + abs(
                    polyval(self.coefficients, relative_l1(current, previous)))
                hit = permitted and rs.data["accumulated"] < self.threshold
            if self.group is not None:  # every rank takes rank 0's decision (the state is replicated)
                hit = rank0_flag(hit, self.group)
            if not hit:
                rs.data["accumulated"] = 0.0
        else:
            hit = permitted and forced
        adapter = self.adapter
        if adapter.reuse_residual is not None:
            if not hit:
                adapter.keep_residual(state, step)  # type: ignore[misc]  # set with reuse_residual (checked)
                return None
            return self.reuse(state, step, adapter.reuse_residual(state, step))
        base = adapter.residual_base(state, step) if adapter.residual_base is not None else None
        if not hit:
            rs.data["base"] = base
            return None
        prediction = rs.data["prediction"] if base is None else base + rs.data["residual"]
        return self.reuse(state, step, prediction)

    def has_cached(self, rs: RequestState) -> bool:
        return "prediction" in rs.data

    def record(self, rs: RequestState, state: DenoiseState, step: int) -> bool:
        super().record(rs, state, step)
        base = rs.data.pop("base", None)
        if base is not None:
            rs.data["residual"] = rs.data["prediction"] - base
        return False


def apply_teacache(pipeline: Pipeline, config: TeaCacheConfig | dict[str, object] | None = None) -> TeaCache:
    """Enable TeaCache on ``pipeline``; ``handle.remove()`` disables it. Nothing is registered on error."""
    return TeaCache(pipeline, coerce_config(TeaCacheConfig, config, METHOD_NAME)).register()


def remove_teacache(handle: TeaCache) -> None:
    handle.remove()
