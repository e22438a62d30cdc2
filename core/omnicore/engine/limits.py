"""Work limits, checked once on the *resolved* request (after the model's ``preprocess``), before dispatch.

A request can name its size or length in many ways: explicit fields, a duration, model-specific fields
(``extra.size``, ``extra.resolution``), a JSON prompt, or nothing (the model default). Checking the fields a
client sent would miss most of them, so the engine checks the request the model actually resolved, in this
one place, against the tighter of the model's declared limits (:class:`~omnicore.specs.ModelCapabilities`)
and the caller's budget (the server's ``--max-image-pixels`` / ``--max-work``). A violation is a
:class:`LimitExceeded` naming the limit, so the server answers 400 before any work starts.

A model that runs a further stage of its own (LingBot's refiner: another DiT at another size and step count) lists
it as :class:`StageWork` records in ``request.stages`` from its ``preprocess``: each stage is held to
the same per-frame limits, and its work counts into the job's ``--max-work`` total, so a request cannot escape
the budget through model-specific size or step fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from ..errors import InvalidRequest

if TYPE_CHECKING:
    from ..specs import ModelSpec
    from .request import GenerationRequest, SamplingParams


class LimitExceeded(InvalidRequest):
    """The resolved request is larger than a limit. ``limit`` names it (e.g. ``max_frames``, ``--max-work``)."""

    def __init__(self, field: str, rule: str, limit: str) -> None:
        super().__init__(field, rule)
        self.limit = limit
        self.code = "image_too_large" if limit == "max_pixels" else "limit_exceeded"  # the HTTP error code


class MemoryLimitExceeded(LimitExceeded):
    """The request's estimated per-rank memory (weights already resident + its activation peak and caches, from
    :mod:`omnicore.planning.admission`) is over the device memory limit; ``estimate_bytes`` / ``limit_bytes`` /
    ``placement`` say by how much and where. HTTP: 400 ``memory_limit_exceeded``."""

    def __init__(self, field: str, rule: str, *, estimate_bytes: int, limit_bytes: int, placement: str) -> None:
        super().__init__(field, rule, "device_memory")
        self.estimate_bytes, self.limit_bytes, self.placement = estimate_bytes, limit_bytes, placement
        self.code = "memory_limit_exceeded"


@attrs.frozen
class WorkLimits:
    """Caps on one request; ``None`` = no cap. ``source`` says whose limits they are, for messages."""

    max_pixels: int | None = None  # width x height of one frame
    max_frames: int | None = None
    max_steps: int | None = None
    max_pixel_frames: int | None = None  # width x height x frames of one output
    max_work: int | None = None  # width x height x frames x steps x outputs: the whole job
    source: str = "the model"

    @classmethod
    def of_model(cls, spec: ModelSpec) -> WorkLimits:
        """The limits a model spec declares (``ModelCapabilities.max_pixels`` and friends)."""
        caps = spec.capabilities
        return cls(max_pixels=getattr(caps, "max_pixels", None), max_frames=getattr(caps, "max_frames", None),
                   max_steps=getattr(caps, "max_steps", None),
                   max_pixel_frames=getattr(caps, "max_pixel_frames", None), source=f"model {spec.name}")


#: ``GenerationRequest.extra`` key of the :class:`StageWork` records a model's ``preprocess`` declares (deprecated:
#: ``preprocess`` sets ``GenerationRequest.stages`` instead; the key is still read).
STAGES_KEY = "omnicore_stages"


@attrs.frozen
class StageWork:
    """One stage a model runs besides the base denoise loop of ``request.params`` (e.g. a refiner DiT).

    ``size_field`` / ``steps_field`` / ``work_field`` are the request fields an error names (e.g.
    ``extra.refiner_height``): the fields the client changes to make the stage fit.
    """

    name: str
    width: int
    height: int
    num_frames: int = 1
    steps: int = 1
    outputs: int = 1
    size_field: str = "params"
    steps_field: str = "params"
    work_field: str = "params"

    @property
    def work(self) -> int:
        return self.width * self.height * self.num_frames * self.steps * self.outputs


def declared_stages(request: GenerationRequest) -> tuple[StageWork, ...]:
    """The stages a prepared request declares (none unless its model listed some): ``request.stages``, else the
    older ``request.extra[STAGES_KEY]`` (still read for plugins written before the typed slot)."""
    stages = getattr(request, "stages", ()) or (getattr(request, "extra", None) or {}).get(STAGES_KEY, ())
    if isinstance(stages, StageWork):
        stages = (stages,)
    if not isinstance(stages, Sequence) or not all(isinstance(s, StageWork) for s in stages):
        raise TypeError(f"request.stages must be StageWork records, got {stages!r}")
    return tuple(stages)


# (attribute, limit flag or field name used in messages for a server budget)
_SERVER_NAMES = {"max_pixels": "--max-image-pixels", "max_work": "--max-work", "max_frames": "max_frames",
                 "max_steps": "max_steps", "max_pixel_frames": "max_pixel_frames"}


def work_units(params: SamplingParams) -> int:
    """``width x height x frames x steps x outputs``: a proxy for the compute a request asks for."""
    return (int(params.width or 0) * int(params.height or 0) * int(params.num_frames or 1)
            * int(params.num_inference_steps or 1) * int(params.num_outputs or 1))


def _tightest(attr: str, limits: tuple[WorkLimits | None, ...]) -> tuple[int, str] | None:
    """The smallest cap on ``attr`` among ``limits`` and the name of its owner (a server flag or the model)."""
    best: tuple[int, str] | None = None
    for lim in limits:
        cap = getattr(lim, attr) if lim is not None else None
        if cap is None or (best is not None and cap >= best[0]):
            continue
        assert lim is not None  # cap was read from it
        best = (cap, _SERVER_NAMES[attr] if lim.source == "the server" else f"{attr} of {lim.source}")
    return best


def check_limits(request: GenerationRequest, *limits: WorkLimits | None) -> None:
    """Raise :class:`LimitExceeded` when the resolved ``request`` breaks any of ``limits`` (naming the tightest)."""
    p = request.params
    w, h = int(p.width or 0), int(p.height or 0)
    frames = int(p.num_frames or 1)
    steps = int(p.num_inference_steps or 0)
    work = work_units(p)
    checks = (
        ("max_pixels", w * h, "params.width",
         lambda cap: f"the resolved size {w}x{h} has {w * h} pixels per frame, more than the limit {cap}"),
        ("max_frames", frames, "params.num_frames",
         lambda cap: f"the resolved length is {frames} frames, more than the limit {cap}"),
        ("max_steps", steps, "params.num_inference_steps", lambda cap: f"{steps} steps is more than the limit {cap}"),
        ("max_pixel_frames", w * h * frames, "params.num_frames",
         lambda cap: f"{w}x{h} x {frames} frames = {w * h * frames} pixels, more than the limit {cap}"),
        ("max_work", work, "params",
         lambda cap: f"the job is {w}x{h} x {frames} frames x {steps} steps x {p.num_outputs} outputs = {work} "
                     f"work units, more than the budget {cap}"),
    )
    for attr, value, field, text in checks:
        tight = _tightest(attr, limits)
        if tight is not None and value > tight[0]:
            raise LimitExceeded(field, f"{text(tight[0])} ({tight[1]})", attr)
    _check_stages(work, declared_stages(request), limits)


def _check_stages(base_work: int, stages: tuple[StageWork, ...], limits: tuple[WorkLimits | None, ...]) -> None:
    """Each declared stage against the per-frame limits, then the job's total work against ``max_work``."""
    total = base_work
    for st in stages:
        w, h, f = st.width, st.height, st.num_frames
        checks = (  # (limit, value, field, message before "more than the limit N")
            ("max_pixels", w * h, st.size_field, f"the {st.name} stage's size {w}x{h} has {w * h} pixels per frame"),
            ("max_steps", st.steps, st.steps_field, f"the {st.name} stage's {st.steps} steps is"),
            ("max_pixel_frames", w * h * f, st.size_field, f"the {st.name} stage's {w}x{h} x {f} frames = "
                                                           f"{w * h * f} pixels,"),
        )
        for attr, value, field, text in checks:
            tight = _tightest(attr, limits)
            if tight is not None and value > tight[0]:
                raise LimitExceeded(field, f"{text} more than the limit {tight[0]} ({tight[1]})", attr)
        total += st.work
        tight = _tightest("max_work", limits)
        if tight is not None and total > tight[0]:
            raise LimitExceeded(st.work_field, f"the {st.name} stage is {w}x{h} x {f} frames x {st.steps} steps x "
                                               f"{st.outputs} outputs = {st.work} work units, which brings the job "
                                               f"to {total}, more than the budget {tight[0]} ({tight[1]})",
                                "max_work")
