"""Checks the CLI runs before it loads a model (or binds a port), so a mistake costs seconds, not a model load.

What can be known without loading anything is checked here: the model argument itself (a ``tiny:`` preset,
a checkpoint directory whose spec is detected from its config files, or a Hugging Face repo id), the sizes
against the model's declared multiple and pixel cap, the input files, roles and counts and the model-specific
fields the spec declares as required. Errors name the CLI flags (``--image``, ``--height``, ``--extra
aspect_ratio``), not the engine's field names (``images[0]``, ``params.height``). Each check runs once: the
request goes on to ``Engine.submit`` as a ``CheckedRequest`` (not checked again), and the deployment options
(``--model-option``) are the Engine's to check, before it reads any weight.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidRequest, UnknownName

if TYPE_CHECKING:
    from ..engine.inputs import CheckedRequest
    from ..engine.request import GenerationRequest
    from ..plugin_host.host import PluginHost
    from ..specs import ModelSpec, PresetSpec

#: engine field -> the ``omnicore generate`` flag that sets it
_FLAG_OF = {
    "params.height": "--height", "params.width": "--width", "params.num_frames": "--num-frames",
    "params.fps": "--fps", "params.duration": "--duration", "params.num_inference_steps": "--steps",
    "params.guidance_scale": "--guidance", "params.flow_shift": "--flow-shift", "params.seed": "--seed",
    "params.output_type": "-o/--output", "negative_prompt": "--negative-prompt", "prompt": "PROMPT",
    "quality": "--quality", "extra": "--extra", "loras": "--lora",
}
_INPUT_FIELD = re.compile(r"^inputs\[(\d+)\](?:\.(\w+))?$")


class ModelArgumentError(InvalidRequest):
    """The model argument names nothing loadable (a bare model family, a typo, a missing directory)."""


def _family(host: PluginHost, text: str) -> ModelSpec | None:
    """The spec whose name or alias is ``text`` (a model family, not something loadable by itself)."""
    low = text.lower()
    return next((s for s in host.models if low == s.name.lower() or low in (a.lower() for a in s.aliases)), None)


def resolve_before_load(model: str, host: PluginHost) -> tuple[ModelSpec | None, PresetSpec | None]:
    """``(spec, preset)`` that will serve ``model``, found without loading anything (``preset`` is ``None`` but
    for ``tiny:``), or ``(None, None)`` for a Hugging Face repo id (its spec is known after the download). An
    argument that cannot name a model raises here, saying what to pass: a bare family name (``lingbot``) gets
    its ``tiny:`` presets and "or a checkpoint directory"."""
    from ..engine.loading import (
        _REPO_ID,
        TINY_PREFIX,
        detect_spec,
        explicit_model,
        find_preset,
        known_models,
        preset_spec,
    )

    text = os.fspath(model)
    if text.lower().startswith(TINY_PREFIX):
        spec, preset = find_preset(host, text)
        return preset_spec(spec, preset), preset
    explicit = explicit_model(host, text)
    if explicit is not None:  # <model>:<dir or repo id>: that model serves it, no detection
        spec, rest = explicit
        where = Path(rest).expanduser()
        if where.is_dir() or (_REPO_ID.match(rest) and not where.exists()):
            return spec, None
        raise ModelArgumentError("model", f"{text}: {rest!r} is neither a checkpoint directory nor a Hugging Face "
                                          "repo id")
    path = Path(text).expanduser()
    if path.is_dir():
        return detect_spec(host, path), None
    family = _family(host, text)
    if family is not None and not path.exists():
        presets = [_ref(p) for p in family.presets]
        tiny = f"{' or '.join(presets)} (random-weight test preset{'s' if len(presets) > 1 else ''}), " \
            if presets else ""
        raise ModelArgumentError("model", f"{text!r} is a model family, not something to load: pass {tiny}a local "
                                          f"checkpoint directory of {family.name}, or a Hugging Face repo id")
    if _REPO_ID.match(text) and not path.exists():
        return None, None
    if path.exists():
        raise ModelArgumentError("model", f"{text} is a file, not a checkpoint directory")
    if os.sep in text or text.startswith((".", "~")):
        raise ModelArgumentError("model", f"no checkpoint directory at {text}")
    raise UnknownName("model", text, known_models(host),
                      hint="pass tiny:<preset>, a local checkpoint directory, or a Hugging Face repo id")


def cli_field(field: str, input_flags: list[str]) -> str:
    """The CLI flag a field of the engine's request came from (``inputs[2].role`` -> ``--reference``)."""
    m = _INPUT_FIELD.match(field)
    if m is not None:
        i = int(m.group(1))
        return input_flags[i] if i < len(input_flags) else field
    if field in _FLAG_OF:
        return _FLAG_OF[field]
    if field.startswith("extra."):
        return f"--extra {field[len('extra.'):]}"
    return field


def as_cli(exc: InvalidRequest, input_flags: list[str]) -> InvalidRequest:
    """``exc`` re-raised under the CLI flag's name, the message otherwise unchanged."""
    flag = cli_field(exc.field, input_flags)
    if flag == exc.field:
        return exc
    rule = exc.rule
    for i, name in enumerate(input_flags):  # the rule may mention other inputs by index
        rule = rule.replace(f"inputs[{i}]", name)
    return InvalidRequest(flag, rule, code=getattr(exc, "code", None))


def _near(value: int, multiple: int) -> str:
    low = value - value % multiple
    return str(value) if not value % multiple else f"{max(multiple, low)} or {low + multiple}"


def check_size(request: GenerationRequest, spec: ModelSpec) -> None:
    """``--height``/``--width`` against the declared multiple (naming the nearest valid sizes, as the HTTP
    server does) and the pixel cap of one frame."""
    caps = spec.capabilities
    p = request.params
    m = caps.size_multiple_of
    for flag, value in (("--height", p.height), ("--width", p.width)):
        if value is not None and m and value % m:
            raise InvalidRequest(flag, f"{value} is not a multiple of {m} for model {spec.name}; nearest: "
                                       f"{_near(value, m)}")
    if p.height is not None and p.width is not None and caps.max_pixels and p.height * p.width > caps.max_pixels:
        raise InvalidRequest("--height", f"{p.width}x{p.height} has {p.width * p.height} pixels, more than "
                                         f"model {spec.name} takes ({caps.max_pixels})")


def _ref(preset: PresetSpec) -> str:
    return preset.name if preset.name.startswith("tiny:") else f"tiny:{preset.name}"


def request_modes(request: GenerationRequest, spec: ModelSpec) -> tuple[str, ...]:
    """The model's modes ``request`` may be in, from its inputs' roles (``InputRole.modes``); a request without
    inputs is in the model's text-only modes (named ``t2...``: t2i, t2v, t2va)."""
    caps = spec.capabilities
    if not request.inputs:
        return tuple(m for m in caps.modes if m.startswith("t2"))
    roles = {r.role: r for r in caps.input_roles()}
    modes: tuple[str, ...] = tuple(caps.modes)
    for m in request.inputs:
        role = roles.get(m.role or "")
        if role is not None and role.modes:
            modes = tuple(x for x in modes if x in role.modes)
    return modes


def check_served_modes(request: GenerationRequest, spec: ModelSpec, preset: PresetSpec | None,
                       input_flags: list[str]) -> None:
    """An input whose role only serves modes the loaded checkpoint lacks (``--reference`` on a t2va/fl2va
    partition) names the presets and the option values that serve those modes."""
    served = preset.modes if preset is not None else None
    if preset is None or not served:
        return
    roles = {r.role: r for r in spec.capabilities.input_roles()}
    for i, m in enumerate(request.inputs):
        role = roles.get(m.role or "")
        if role is None or not role.modes or any(x in served for x in role.modes):
            continue
        wanted = role.modes
        presets = [_ref(p) for p in spec.presets if p.modes and any(x in p.modes for x in wanted)]
        options = [f"--model-option {o.name}={c}" for o in spec.options for c in (o.choices or ()) if c in wanted]
        where = " or ".join([*(f"use {p}" for p in presets),
                             *(f"a checkpoint loaded with {o}" for o in options)]) or "another checkpoint"
        flag = input_flags[i] if i < len(input_flags) else f"inputs[{i}]"
        raise InvalidRequest(flag, f"{role.role} inputs are for {'/'.join(wanted)}, but {_ref(preset)} serves "
                                   f"{', '.join(served)}; for {'/'.join(wanted)} {where}")


def check_required_fields(request: GenerationRequest, spec: ModelSpec) -> None:
    """Model-specific fields the spec declares required for the request's mode (``ModelOption.required_for`` of
    ``ModelSpec.request_fields``) must be given with ``--extra``, unless the request gives every parameter the
    field's ``unless`` names (the model then decides, e.g. from an explicit height and width)."""
    modes = request_modes(request, spec)
    for rf in getattr(spec, "request_fields", ()):
        required_for = getattr(rf, "required_for", ())
        if not required_for or rf.name in request.extra or not modes or not all(m in required_for for m in modes):
            continue
        unless = getattr(rf, "unless", ())
        if unless and all(getattr(request.params, name, None) is not None for name in unless):
            continue
        choices = f" (one of {', '.join(map(str, rf.choices))})" if rf.choices else ""
        example = f", e.g. --extra {rf.name}={rf.example}" if getattr(rf, "example", None) is not None else ""
        alt = f", or give {' and '.join('--' + n for n in unless)}" if unless else ""
        raise InvalidRequest(f"--extra {rf.name}", f"model {spec.name} requires {rf.name}{choices} for "
                                                   f"{'/'.join(modes)}{example}{alt}")


def precheck(model: str, host: PluginHost, request: GenerationRequest,
             input_flags: list[str] | None = None) -> tuple[ModelSpec | None, GenerationRequest | CheckedRequest]:
    """Check ``request`` against what the spec of ``model`` declares, before any load. Returns ``(spec,
    CheckedRequest)`` (default roles filled; ``Engine.submit`` does not check it again), or ``(None, request)``
    when the spec is only known after a download (the engine checks it at submit). Errors name the CLI flags."""
    from ..engine.inputs import CheckedRequest

    flags = list(input_flags or ())
    spec, preset = resolve_before_load(model, host)
    if spec is None:
        return None, request
    try:
        checked = CheckedRequest.of(request, spec)
        check_served_modes(checked.request, spec, preset, flags)
        check_size(checked.request, spec)
        check_required_fields(checked.request, spec)
    except InvalidRequest as exc:
        raise as_cli(exc, flags) from None
    return spec, checked
