"""Requests: :class:`GenerationRequest` and :class:`SamplingParams` (attrs, frozen, validated at construction).

Fields a caller leaves unset are ``None`` and get the model's defaults in ``preprocess`` via
:meth:`SamplingParams.with_defaults` — no magic sentinel values. Errors are :class:`InvalidRequest` naming the
field (dotted, e.g. ``params.height``) and the rule.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from ..errors import InvalidRequest
from ..ids import new_id
from ..lora.records import LoRA, as_loras
from ..specs import RequestDefaults

if TYPE_CHECKING:
    from .limits import StageWork

#: the type of a model's own plan record (:meth:`GenerationRequest.plan_as`)
PlanT = TypeVar("PlanT")

OUTPUT_TYPES = ("auto", "image", "video")
QUALITIES = ("draft", "standard", "high")
#: The one seed range: seeds are integers in [0, MAX_SEED] (output i of a request uses seed + i), everywhere — the
#: engine, the HTTP schemas and the plugins' own streams.
MAX_SEED = 2**63 - 1


def random_seed(num_outputs: int = 1) -> int:
    """A seed for a request that gave none, uniform over the seed range with room for ``seed + i`` of every
    output (so the drawn seed always validates)."""
    return secrets.randbelow(MAX_SEED - max(1, num_outputs) + 2)


#: an attrs validator: ``check(instance, attribute, value)`` raises on a bad value
Validator = Callable[[object, attrs.Attribute, object], None]


def _opt_int(lo: int, hi: int | None = None) -> Validator:
    def check(inst: object, attr: attrs.Attribute, value: object) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidRequest(f"params.{attr.name}", f"must be an integer, got {value!r}")
        if value < lo or (hi is not None and value > hi):
            bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise InvalidRequest(f"params.{attr.name}", f"must be {bound}, got {value}")
    return check


def _opt_float(lo: float, *, strict: bool = False, hi: float | None = None) -> Validator:
    def check(inst: object, attr: attrs.Attribute, value: object) -> None:
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


def _opt_float_conv(value: object) -> object:
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
        filled: dict[str, Any] = {
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
    return new_id("req")


def _freeze_mapping(value: Mapping[str, object] | None) -> dict[str, Any]:
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


MEDIA_KINDS = ("image", "video", "audio")
_LEGACY_MEDIA = {"images": "image", "videos": "video", "audios": "audio"}


@attrs.frozen
class MediaInput:
    """One conditioning input: its ``kind`` (``image``/``video``/``audio``), its ``role`` and its ``data``.

    ``role`` is ``first_frame``, ``last_frame``, ``reference``, ``edit_source`` or any role the model declares
    (:class:`omnicore.specs.InputRole`); ``None`` means "the model's default role for this kind", which the
    engine fills in before the model's ``preprocess`` sees the request. ``data`` is a ``PIL.Image``, a path,
    bytes, a uint8 array (images) or a decoded :class:`~omnicore.media.VideoClip` / :class:`~omnicore.media.AudioClip`;
    :meth:`load` decodes it.
    """

    kind: str = attrs.field()
    role: str | None = attrs.field()
    data: Any = attrs.field(eq=attrs.cmp_using(eq=lambda a, b: a is b or (type(a) is type(b) and _same(a, b))))

    @kind.validator
    def _check_kind(self, attribute: attrs.Attribute, value: object) -> None:
        if value not in MEDIA_KINDS:
            raise InvalidRequest("inputs.kind", f"must be one of {list(MEDIA_KINDS)}, got {value!r}")

    @role.validator
    def _check_role(self, attribute: attrs.Attribute, value: object) -> None:
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise InvalidRequest("inputs.role", f"must be a non-empty string or None, got {value!r}")

    def load(self, **caps: Any) -> Any:
        """The decoded media: RGB ``PIL.Image`` for images, ``VideoClip`` / ``AudioClip`` otherwise (see
        :func:`omnicore.media.load_media`; ``caps`` are its limits)."""
        from ..media import load_media

        return load_media(self.kind, self.data, **caps)


def _same(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except (ValueError, TypeError):  # arrays and other objects without a plain truth value: identity only
        return False


def _inputs(value: object) -> tuple[MediaInput, ...]:
    items = _tuple(value)
    for i, item in enumerate(items):
        if not isinstance(item, MediaInput):
            raise InvalidRequest(f"inputs[{i}]", f"must be a MediaInput(kind, role, data), got {type(item).__name__}")
    return items


def media_inputs(images: object = (), videos: object = (), audios: object = (),
                 inputs: object = ()) -> tuple[MediaInput, ...]:
    """``inputs`` followed by the bare ``images``/``videos``/``audios`` as role-less inputs (role ``None``)."""
    out = list(_inputs(inputs))
    for name, kind in _LEGACY_MEDIA.items():
        out.extend(MediaInput(kind, None, d) for d in _tuple({"images": images, "videos": videos,
                                                              "audios": audios}[name]))
    return tuple(out)


@attrs.frozen(init=False)
class GenerationRequest:
    """One generation request: prompt, conditioning inputs and sampling parameters.

    ``prompt`` may be a string or (for models that accept structured captions) a mapping. ``inputs`` holds the
    conditioning media as :class:`MediaInput` records (kind, role, data); ``images=``/``videos=``/``audios=``
    are still accepted and become inputs without a role (the engine gives them the model's default role), and
    the ``images``/``videos``/``audios`` properties read the data of each kind back. ``extra`` carries
    model-specific fields validated by the model's ``preprocess``. ``prepared`` is set by preprocess and lets
    the engine assert it ran exactly once. ``loras`` lists :class:`~omnicore.lora.LoRA` adapters (a string is
    ``LoRA(string)``; at most :data:`~omnicore.lora.MAX_LORAS_PER_REQUEST`), checked by the engine at admission.

    ``plan`` and ``stages`` are written by the model's ``preprocess`` only (a caller leaves them unset): ``plan``
    is the model's own typed record of what it decided for this request (read back with :meth:`plan_as`),
    ``stages`` the :class:`~omnicore.engine.limits.StageWork` it runs besides the base loop. Neither is part of
    :meth:`batch_key`, equality or the persisted job, and neither ever lands in the caller's ``extra``.
    """

    prompt: str | Mapping[str, Any] = attrs.field()
    params: SamplingParams = attrs.field(factory=SamplingParams)
    negative_prompt: str | None = None
    inputs: tuple[MediaInput, ...] = attrs.field(factory=tuple, converter=_inputs)
    modalities: tuple[str, ...] | None = attrs.field(default=None, converter=lambda v: None if v is None else _tuple(v))
    quality: str = attrs.field(default="standard")
    extra: dict[str, Any] = attrs.field(factory=dict, converter=_freeze_mapping)
    request_id: str = attrs.field(factory=_new_id)
    prepared: bool = False
    #: per-request LoRA adapters, composed (ranks concatenated) and applied without merging; not part of the batch
    #: key, so requests with different adapters share a batch
    loras: tuple[LoRA, ...] = attrs.field(factory=tuple, converter=as_loras)
    plan: object | None = attrs.field(default=None, eq=False, repr=False)
    stages: tuple[StageWork, ...] = attrs.field(default=(), eq=False, repr=False, converter=_tuple)

    @prompt.validator
    def _check_prompt(self, attribute: attrs.Attribute, value: object) -> None:
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
    def _check_params(self, attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, SamplingParams):
            raise InvalidRequest("params", f"must be SamplingParams, got {type(value).__name__}")

    def __init__(self, prompt: str | Mapping[str, Any], params: SamplingParams | None = None,
                 negative_prompt: str | None = None, images: object = (), videos: object = (), audios: object = (),
                 modalities: Iterable[str] | None = None, quality: str = "standard",
                 extra: Mapping[str, Any] | None = None,
                 request_id: str | None = None, prepared: bool = False, *, inputs: object = (),
                 plan: object | None = None, stages: Iterable[StageWork] = (),
                 loras: LoRA | str | Iterable[LoRA | str] | None = ()) -> None:
        self.__attrs_init__(prompt=prompt, params=SamplingParams() if params is None else params,
                            negative_prompt=negative_prompt,
                            inputs=media_inputs(images, videos, audios, inputs), modalities=modalities,
                            quality=quality, extra=extra, request_id=request_id or _new_id(), prepared=prepared,
                            loras=loras, plan=plan, stages=stages)

    @property
    def images(self) -> tuple[Any, ...]:
        """The data of every image input, in order (whatever its role)."""
        return tuple(m.data for m in self.inputs if m.kind == "image")

    @property
    def videos(self) -> tuple[Any, ...]:
        return tuple(m.data for m in self.inputs if m.kind == "video")

    @property
    def audios(self) -> tuple[Any, ...]:
        return tuple(m.data for m in self.inputs if m.kind == "audio")

    def plan_as(self, kind: type[PlanT]) -> PlanT:
        """The plan ``preprocess`` stored, checked to be a ``kind`` (``ValueError`` naming both otherwise: the
        request was not prepared by that model's pipeline)."""
        if not isinstance(self.plan, kind):
            got = "no plan" if self.plan is None else f"a {type(self.plan).__name__}"
            raise ValueError(f"request {self.request_id} carries {got}, not a {kind.__name__}: it was not prepared "
                             f"by the pipeline that reads it (call that pipeline's preprocess first)")
        return self.plan

    def media(self, kind: str | None = None, role: str | None = None) -> tuple[MediaInput, ...]:
        """The inputs of ``kind`` and/or ``role`` (``None`` matches any), in request order."""
        return tuple(m for m in self.inputs if (kind is None or m.kind == kind) and (role is None or m.role == role))

    def seeded(self, default: int | None = None) -> GenerationRequest:
        """This request with a seed: its own when set, else ``default`` (the model's declared default seed), else
        a :func:`random_seed` draw with room for every output. The engine and the model pool fill it this way at
        submission, so a job's seed is known (and reported) before it runs."""
        if self.params.seed is not None:
            return self
        seed = default if default is not None else random_seed(self.params.num_outputs)
        return self.evolve(params=attrs.evolve(self.params, seed=seed))

    def evolve(self, **changes: Any) -> GenerationRequest:
        """A changed copy. ``images=``/``videos=``/``audios=`` replace the inputs of that kind: one for one
        (roles kept) when the count is unchanged, otherwise as role-less inputs."""
        legacy = {k: _tuple(changes.pop(k)) for k in list(changes) if k in _LEGACY_MEDIA}
        if legacy:
            inputs = list(_inputs(changes.get("inputs", self.inputs)))
            for name, data in legacy.items():
                kind = _LEGACY_MEDIA[name]
                mine = [i for i, m in enumerate(inputs) if m.kind == kind]
                if len(mine) == len(data):
                    for i, d in zip(mine, data):
                        inputs[i] = attrs.evolve(inputs[i], data=d)
                else:
                    inputs = [m for m in inputs if m.kind != kind] + [MediaInput(kind, None, d) for d in data]
            changes["inputs"] = tuple(inputs)
        return attrs.evolve(self, **changes)

    def batch_key(self) -> Hashable:
        """Requests may share a batch only when these are equal (shapes, schedule, input layout). Quality is not
        here: the engine's scheduler keeps quality levels apart whatever key a model computes (``Scheduler.add``)."""
        p = self.params
        return (p.height, p.width, p.num_frames, p.num_inference_steps, p.guidance_scale, p.flow_shift,
                p.output_type, tuple((m.kind, m.role) for m in self.inputs), self.modalities)
