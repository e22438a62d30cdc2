"""The engine's check of a request against the model's declared capabilities, before dispatch (every surface).

:func:`check_request` gives role-less inputs the model's default role for their kind, then checks each input's
role, kind, count (per role and in total) and duration, the outputs asked for (modalities, output type, outputs
per request), an explicit fps against the declared range and the ``extra`` keys against the declared
``ModelSpec.extra_fields`` (:func:`check_extra`). It is pure and idempotent, so a model's
``preprocess`` may call it too (for callers that bypass the engine). Model-specific rules (which combination
selects which task) stay in the model's ``preprocess``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from ..errors import InvalidRequest

if TYPE_CHECKING:
    from ..specs import InputRole, ModelCapabilities, ModelSpec
    from .request import GenerationRequest, MediaInput

_UNSUPPORTED = "unsupported_for_model"


def _roles_text(roles: tuple[InputRole, ...]) -> str:
    if not roles:
        return "none (the model takes no conditioning media)"
    return ", ".join(f"{r.role} ({'/'.join(r.kinds)}, up to {r.max_count})" for r in roles)


def resolve_roles(request: GenerationRequest, caps: ModelCapabilities, model: str) -> GenerationRequest:
    """Give every role-less input the model's default role for its kind (the first declared role taking it)."""
    if all(m.role is not None for m in request.inputs):
        return request
    import attrs

    roles = caps.input_roles()
    inputs = []
    for i, m in enumerate(request.inputs):
        if m.role is None:
            role = caps.default_role(m.kind)
            if role is None:
                raise InvalidRequest(f"inputs[{i}].kind", f"model {model} takes no {m.kind} inputs; it accepts: "
                                                          f"{_roles_text(roles)}", code=_UNSUPPORTED)
            m = attrs.evolve(m, role=role.role)
        inputs.append(m)
    return request.evolve(inputs=tuple(inputs))


def _input_names(fields: Sequence[str] | None) -> Callable[[int, str], str]:
    """How errors name input ``i``: ``inputs[i]<part>``, or the caller's ``fields[i]`` (an HTTP form field)."""
    if fields is None:
        return lambda i, part: f"inputs[{i}]{part}"
    return lambda i, part: fields[i]


def _checked_role(i: int, inputs: Sequence[MediaInput], roles: Mapping[str, InputRole], counts: dict[str, int],
                  model: str, name: Callable[[int, str], str]) -> InputRole:
    """Input ``i``'s declared role, after its role, kind and per-role count are checked (``counts`` updated)."""
    m = inputs[i]
    spec = roles.get(m.role or "")
    if spec is None:
        raise InvalidRequest(name(i, ".role"), f"model {model} does not accept role {m.role!r}; it accepts: "
                                               f"{_roles_text(tuple(roles.values()))}", code=_UNSUPPORTED)
    if m.kind not in spec.kinds:
        raise InvalidRequest(name(i, ".kind"), f"role {m.role!r} of model {model} takes "
                                               f"{' or '.join(spec.kinds)}, not {m.kind}", code=_UNSUPPORTED)
    counts[spec.role] = counts.get(spec.role, 0) + 1
    if counts[spec.role] > spec.max_count:
        code = "too_many_input_images" if m.kind == "image" else None
        given = sum(1 for x in inputs if x.role == spec.role)
        raise InvalidRequest(name(i, ""), f"model {model} takes at most {spec.max_count} {spec.role} "
                                          f"input(s), got {given}", code=code)
    return spec


def _check_total(inputs: Sequence[MediaInput], caps: ModelCapabilities, model: str,
                 fields: Sequence[str] | None) -> None:
    total = len(inputs)
    if caps.max_inputs is not None and total > caps.max_inputs:
        raise InvalidRequest(fields[caps.max_inputs] if fields is not None else "inputs",
                             f"model {model} takes at most {caps.max_inputs} inputs in total, got {total}")


def check_input_roles(inputs: Sequence[MediaInput], caps: ModelCapabilities, model: str,
                      fields: Sequence[str] | None = None) -> None:
    """Role, kind, per-role and total counts of ``inputs``, reading no media (``data`` may still be undecoded).

    Errors name ``inputs[i].role`` / ``inputs[i].kind`` / ``inputs[i]`` (``inputs`` for the total), or
    ``fields[i]`` when given: the HTTP server passes each input's form field and runs this before decoding."""
    roles = {r.role: r for r in caps.input_roles()}
    counts: dict[str, int] = {}
    name = _input_names(fields)
    for i in range(len(inputs)):
        _checked_role(i, inputs, roles, counts, model, name)
    _check_total(inputs, caps, model, fields)


def check_inputs(request: GenerationRequest, caps: ModelCapabilities, model: str) -> None:
    """Role, kind, per-role and total counts (as :func:`check_input_roles`), and declared durations of every
    input, input by input."""
    from ..media import media_duration

    roles = {r.role: r for r in caps.input_roles()}
    counts: dict[str, int] = {}
    name = _input_names(None)
    for i, m in enumerate(request.inputs):
        spec = _checked_role(i, request.inputs, roles, counts, model, name)
        if m.kind != "image" and (spec.max_duration_s is not None or spec.min_duration_s is not None):
            duration = media_duration(m.kind, m.data, field=f"inputs[{i}]")
            if duration is not None and spec.max_duration_s is not None and duration > spec.max_duration_s + 1e-6:
                raise InvalidRequest(f"inputs[{i}]", f"the {m.kind} lasts {duration:.3g} s; role {spec.role!r} of "
                                                     f"model {model} takes at most {spec.max_duration_s:g} s")
            if duration is not None and spec.min_duration_s is not None and duration < spec.min_duration_s - 1e-6:
                raise InvalidRequest(f"inputs[{i}]", f"the {m.kind} lasts {duration:.3g} s; role {spec.role!r} of "
                                                     f"model {model} needs at least {spec.min_duration_s:g} s")
    _check_total(request.inputs, caps, model, None)


def check_outputs(request: GenerationRequest, caps: ModelCapabilities, model: str) -> None:
    """Modalities and output type the model produces, and the outputs-per-request cap."""
    p = request.params
    if request.modalities is not None:
        bad = [m for m in request.modalities if m not in caps.outputs]
        if bad:
            raise InvalidRequest("modalities", f"model {model} produces {', '.join(caps.outputs)}; "
                                               f"not {', '.join(map(str, bad))}", code=_UNSUPPORTED)
    if p.output_type != "auto" and p.output_type not in caps.outputs:
        raise InvalidRequest("params.output_type", f"model {model} produces {', '.join(caps.outputs)}, "
                                                   f"not {p.output_type}", code=_UNSUPPORTED)
    if p.num_outputs > caps.max_outputs_per_request:
        raise InvalidRequest("params.num_outputs", f"model {model} makes at most {caps.max_outputs_per_request} "
                                                   f"outputs per request, got {p.num_outputs}")


def check_fps(request: GenerationRequest, caps: ModelCapabilities, model: str) -> None:
    """An explicit fps within the declared range (sizes, frames and steps are checked on the resolved request
    after ``preprocess``, by :mod:`omnicore.engine.limits`)."""
    p = request.params
    if caps.fps_range is not None and p.fps is not None:
        lo, hi = caps.fps_range
        if not lo <= p.fps <= hi:
            raise InvalidRequest("params.fps", f"model {model} takes fps in [{lo:g}, {hi:g}], got {p.fps:g}")


#: the error code of a model-specific field the model does not declare (HTTP 400 ``unknown_parameter``)
UNKNOWN_PARAMETER = "unknown_parameter"


def check_extra(extra: Mapping[str, object], spec: ModelSpec) -> None:
    """Refuse every ``extra`` key the model does not declare in ``ModelSpec.extra_fields`` (it would otherwise be
    dropped silently): one :class:`InvalidRequest` naming the first unknown field and listing every unknown one
    and every accepted one. A spec that declares nothing (``None``) is not checked here."""
    fields = getattr(spec, "extra_fields", None)
    if fields is None:
        return
    unknown = sorted(set(extra) - set(fields))
    if unknown:
        names = ", ".join(repr(k) for k in unknown)
        raise InvalidRequest(f"extra.{unknown[0]}", f"unknown {spec.name} field{'s' if len(unknown) > 1 else ''} "
                                                    f"{names}; accepted: {', '.join(fields) or 'none'}",
                             code=UNKNOWN_PARAMETER)


def check_request(request: GenerationRequest, spec: ModelSpec) -> GenerationRequest:
    """Everything a request must satisfy from the model's declared capabilities; returns it with roles filled."""
    caps = spec.capabilities
    check_extra(request.extra, spec)
    request = resolve_roles(request, caps, spec.name)
    check_inputs(request, caps, spec.name)
    check_outputs(request, caps, spec.name)
    check_fps(request, caps, spec.name)
    return request


@attrs.frozen
class CheckedRequest:
    """A request already through :func:`check_request` against ``spec`` (roles filled), by a caller that checks
    before anything loads (the CLI). ``Engine.submit`` takes it and does not check it again when ``spec`` is the
    spec it serves (it checks anything else)."""

    request: GenerationRequest
    spec: ModelSpec

    @classmethod
    def of(cls, request: GenerationRequest, spec: ModelSpec) -> CheckedRequest:
        return cls(check_request(request, spec), spec)
