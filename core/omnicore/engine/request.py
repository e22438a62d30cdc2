"""Requests: :class:`GenerationRequest` and :class:`SamplingParams` (attrs, frozen, validated at construction).

Fields a caller leaves unset are ``None`` and get the model's defaults in ``preprocess`` via
:meth:`SamplingParams.with_defaults` — no magic sentinel values. Errors are :class:`InvalidRequest` naming the
field (dotted, e.g. ``params.height``) and the rule.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Hashable, Mapping
from typing import Any

import attrs

from ..errors import InvalidRequest
from ..specs import RequestDefaults

OUTPUT_TYPES = ("auto", "image", "video")
QUALITIES = ("draft", "standard", "high")
MAX_SEED = 2**63 - 1


def _opt_int(lo: int, hi: int | None = None) -> Any:
    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequest(f"params.{attr.name}", f"must be an integer, got {value!r}")
        if value < lo or (hi is not None and value > hi):
            bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise InvalidRequest(f"params.{attr.name}", f"must be {bound}, got {value}")
    return check


def _opt_float(lo: float, *, strict: bool = False, hi: float | None = None) -> Any:
    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequest(f"params.{attr.name}", f"must be a finite number, got {value!r}")
        if value < lo or (strict and value == lo) or (hi is not None and value > hi):
            rule = f"> {lo}" if strict else f">= {lo}"
            if hi is not None:
                rule += f" and <= {hi}"
            raise InvalidRequest(f"params.{attr.name}", f"must be {rule}, got {value}")
    return check


def _opt_float_conv(value: Any) -> Any:
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


@attrs.frozen
class SamplingParams:
    """How to sample. ``None`` = "use the model's default" (filled in by :meth:`with_defaults`)."""

    height: int | None = attrs.field(default=None, validator=_opt_int(16, 16384))
    width: int | None = attrs.field(default=None, validator=_opt_int(16, 16384))
    num_frames: int | None = attrs.field(default=None, validator=_opt_int(1, 100_000))
    fps: float | None = attrs.field(default=None, converter=_opt_float_conv,
                                    validator=_opt_float(0.0, strict=True, hi=240.0))
    duration: float | None = attrs.field(default=None, converter=_opt_float_conv,
                                         validator=_opt_float(0.0, strict=True, hi=3600.0))
    num_inference_steps: int | None = attrs.field(default=None, validator=_opt_int(1, 1000))
    guidance_scale: float | None = attrs.field(default=None, converter=_opt_float_conv,
                                               validator=_opt_float(0.0, hi=100.0))
    flow_shift: float | None = attrs.field(default=None, converter=_opt_float_conv,
                                           validator=_opt_float(0.0, strict=True, hi=100.0))
    seed: int | None = attrs.field(default=None, validator=_opt_int(0, MAX_SEED))
    num_outputs: int = attrs.field(default=1, validator=_opt_int(1, 64))
    output_type: str = attrs.field(default="auto")

    @output_type.validator
    def _check_output_type(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in OUTPUT_TYPES:
            raise InvalidRequest("params.output_type", f"must be one of {list(OUTPUT_TYPES)}, got {value!r}")

    def __attrs_post_init__(self) -> None:
        if self.seed is not None and self.seed + self.num_outputs - 1 > MAX_SEED:  # outputs use seed + i
            raise InvalidRequest("params.seed", f"must leave room for {self.num_outputs} output seeds "
                                                f"(seed + num_outputs - 1 <= {MAX_SEED}), got {self.seed}")

    def with_defaults(self, defaults: RequestDefaults, **overrides: Any) -> SamplingParams:
        """Fill every unset field from the model's defaults (explicit ``overrides`` win over both)."""
        filled = {
            "height": self.height if self.height is not None else defaults.height,
            "width": self.width if self.width is not None else defaults.width,
            "num_frames": self.num_frames if self.num_frames is not None else defaults.num_frames,
            "fps": self.fps if self.fps is not None else defaults.fps,
            "num_inference_steps": self.num_inference_steps if self.num_inference_steps is not None
            else defaults.num_inference_steps,
            "guidance_scale": self.guidance_scale if self.guidance_scale is not None else defaults.guidance_scale,
            "flow_shift": self.flow_shift if self.flow_shift is not None else defaults.flow_shift,
        }
        filled.update(overrides)
        return attrs.evolve(self, **filled)


def _new_id() -> str:
    return "req_" + uuid.uuid4().hex[:24]


def _freeze_mapping(value: Mapping[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequest("extra", f"must be a mapping of model-specific fields, got {type(value).__name__}")
    return dict(value)


def _tuple(value: Any) -> tuple[Any, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)


@attrs.frozen
class GenerationRequest:
    """One generation request: prompt, references and sampling parameters.

    ``prompt`` may be a string or (for models that accept structured captions) a mapping. ``images`` holds
    reference images (``PIL.Image.Image`` or file paths); ``videos``/``audios`` likewise. ``extra`` carries
    model-specific fields validated by the model's ``preprocess``. ``prepared`` is set by preprocess and lets
    the engine assert it ran exactly once.
    """

    prompt: str | Mapping[str, Any] = attrs.field()
    params: SamplingParams = attrs.field(factory=SamplingParams)
    negative_prompt: str | None = None
    images: tuple[Any, ...] = attrs.field(factory=tuple, converter=_tuple)
    videos: tuple[Any, ...] = attrs.field(factory=tuple, converter=_tuple)
    audios: tuple[Any, ...] = attrs.field(factory=tuple, converter=_tuple)
    modalities: tuple[str, ...] | None = attrs.field(default=None, converter=lambda v: None if v is None else _tuple(v))
    quality: str = attrs.field(default="standard")
    extra: dict[str, Any] = attrs.field(factory=dict, converter=_freeze_mapping)
    request_id: str = attrs.field(factory=_new_id)
    prepared: bool = False

    @prompt.validator
    def _check_prompt(self, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, str):
            if not value.strip():
                raise InvalidRequest("prompt", "must be a non-empty string")
        elif not isinstance(value, Mapping):
            raise InvalidRequest("prompt", f"must be a string or a mapping, got {type(value).__name__}")

    @quality.validator
    def _check_quality(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in QUALITIES:
            raise InvalidRequest("quality", f"must be one of {list(QUALITIES)}, got {value!r}")

    @params.validator
    def _check_params(self, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, SamplingParams):
            raise InvalidRequest("params", f"must be SamplingParams, got {type(value).__name__}")

    def evolve(self, **changes: Any) -> GenerationRequest:
        return attrs.evolve(self, **changes)

    def batch_key(self) -> Hashable:
        """Requests may share a batch only when these are equal (shapes, schedule, quality, references)."""
        p = self.params
        return (p.height, p.width, p.num_frames, p.num_inference_steps, p.guidance_scale, p.flow_shift,
                p.output_type, self.quality, len(self.images), len(self.videos), len(self.audios),
                self.modalities)
