"""``omnicore models [--json]``: every registered model with its modes, input roles, presets (and their request
defaults), request defaults and deployment options — from the specs alone, so torch is never imported.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from ..plugin_host import PluginHost


def preset_card(preset: Any) -> dict[str, Any]:
    """A :class:`~omnicore.specs.PresetSpec` as listed: its ``tiny:`` name, description, request defaults and the
    modes it serves (``None``: all of the model's)."""
    name = preset.name if preset.name.startswith("tiny:") else f"tiny:{preset.name}"
    modes = getattr(preset, "modes", None)
    return {"name": name, "description": preset.description,
            "defaults": None if preset.defaults is None else preset.defaults.to_json(),
            "modes": None if modes is None else list(modes)}


def model_card(spec: Any) -> dict[str, Any]:
    """A JSON-ready description of a :class:`~omnicore.specs.ModelSpec` (no implementation is imported)."""
    caps = spec.capabilities
    return {
        "name": spec.name,
        "provider": spec.provider,
        "description": spec.description,
        "aliases": list(spec.aliases),
        "modes": list(caps.modes),
        "outputs": list(caps.outputs),
        "inputs": [r.to_json() for r in caps.input_roles()],
        "max_inputs": caps.max_inputs,
        "max_outputs_per_request": caps.max_outputs_per_request,
        "supports_batching": caps.supports_batching,
        "cache_methods": list(caps.cache_methods),
        "step_checkpoints": bool(getattr(caps, "checkpointable", False)),  # --checkpoint-every applies to it
        "limits": {"size_multiple_of": caps.size_multiple_of, "max_pixels": caps.max_pixels,
                   "max_frames": caps.max_frames, "frame_rule": caps.frame_rule,
                   "fps_range": None if caps.fps_range is None else list(caps.fps_range)},
        "defaults": spec.defaults.to_json(),
        "presets": [preset_card(p) for p in spec.presets],
        "options": [o.to_json() for o in spec.options],
        "request_fields": [o.to_json() for o in getattr(spec, "request_fields", ())],
        "lora": lora_targets_card(getattr(spec, "lora", None)),
    }


def lora_targets_card(targets: Any) -> dict[str, Any] | None:
    """What LoRA adapters may target in a model (``None``: it takes none)."""
    if targets is None:
        return None
    return {"root": targets.root, "modules": list(targets.modules), "adaln": list(targets.adaln)}


def _defaults_text(d: dict[str, Any]) -> str:
    size = f"{d['width']}x{d['height']}"
    frames = f", {d['num_frames']} frames @ {d['fps']:g} fps" if d["num_frames"] > 1 else ""
    seed = f", seed {d['seed']}" if d.get("seed") is not None else ""
    return f"{size}{frames}, {d['num_inference_steps']} steps, guidance {d['guidance_scale']:g}{seed}"


def _field_rule(f: dict[str, Any]) -> str:
    """``"one of a, b; REQUIRED for t2va unless height and width are given; "`` for a request field."""
    parts = [f"one of {', '.join(map(str, f['choices']))}"] if f.get("choices") else [f["type"]]
    if f.get("required_for"):
        unless = f" (the model may derive it from {' and '.join(f['unless'])})" if f.get("unless") else ""
        parts.append(f"REQUIRED for {', '.join(f['required_for'])}{unless}")
    return "; ".join(parts) + "; "


def render(cards: list[dict[str, Any]]) -> str:
    lines: list[str] = []
    for c in cards:
        lines.append(f"{c['name']}  ({c['provider'] or '-'})  {c['description']}")
        lines.append(f"  modes: {', '.join(c['modes'])}; outputs: {', '.join(c['outputs'])}; "
                     f"up to {c['max_outputs_per_request']} per request"
                     + ("; step checkpoints" if c.get("step_checkpoints") else ""))
        if c["inputs"]:
            roles = "; ".join(f"{r['role']} ({'/'.join(r['kinds'])}, max {r['max_count']})" for r in c["inputs"])
            total = f" (at most {c['max_inputs']} in total)" if c["max_inputs"] is not None else ""
            lines.append(f"  inputs: {roles}{total}")
        else:
            lines.append("  inputs: none")
        lines.append(f"  defaults: {_defaults_text(c['defaults'])}")
        for p in c["presets"]:
            own = f" [defaults: {_defaults_text(p['defaults'])}]" if p["defaults"] else ""
            modes = f" [serves {', '.join(p['modes'])}]" if p.get("modes") else ""
            lines.append(f"  preset {p['name']}: {p['description']}{own}{modes}")
        for o in c["options"]:
            choices = f" one of {', '.join(map(str, o['choices']))};" if o["choices"] else ""
            lines.append(f"  option {o['name']} ({o['type']},{choices} default {o['default']!r}): {o['help']}")
        for f in c.get("request_fields", ()):
            lines.append(f"  field {f['name']} (--extra {f['name']}=...): {_field_rule(f)}{f['help']}")
        if c.get("lora"):
            lines.append(f"  lora: adapters may target {c['lora']['root']}.{{{', '.join(c['lora']['modules'])}}}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n" if lines else "no model plugin is installed\n"


def make_host() -> Any:
    """The host whose models are listed (installed plugins). Tests replace this."""
    return PluginHost()


def run(args: argparse.Namespace) -> int:
    log = logging.getLogger("omnicore.plugin_host")
    previous = log.level
    log.setLevel(logging.ERROR)  # problems are printed once below, as `omnicore plugins` does
    try:
        host = make_host()
    finally:
        log.setLevel(previous)
    for line in host.problems:
        print(f"error: {line}", file=sys.stderr)
    if getattr(args, "model", None):
        return describe_checkpoints(args.model, host, as_json=args.json)
    cards = [model_card(spec) for spec in host.models]
    from ..config import resolve_settings
    from .lora_args import describe_adapter, render_adapters

    # --lora-modules, else OMNICORE_LORA_MODULES: the adapters `serve` would preload
    modules = resolve_settings({"lora_modules": getattr(args, "lora_modules", None)}).lora_modules
    adapters = [describe_adapter(name, path) for name, path in modules]
    if args.json:
        print(json.dumps({"models": cards, **({"loras": adapters} if modules else {})}, indent=2, sort_keys=True))
    else:
        sys.stdout.write(render(cards) + render_adapters(adapters))
    return 0


def checkpoint_card(model: str, host: Any) -> dict[str, Any]:
    """The card of one checkpoint as a loaded engine serves it: the plugin's spec narrowed to the checkpoint (a
    diffusers pipeline's own modes, roles, defaults and ``extra`` keywords), plus where it was found."""
    from ..engine.api import Engine

    with Engine(model, host=host) as engine:
        card = model_card(engine.spec)
        card["checkpoint"] = {"model": model, "path": str(engine.resolved.path), "plugin": engine.spec.name}
    return card


def describe_checkpoints(models: list[str], host: Any, *, as_json: bool) -> int:
    """``omnicore models MODEL ...``: load each and print its card; a model that fails to load is one error line
    (exit 1) and the others are still described."""
    from ..errors import OmnicoreError

    cards, failed = [], 0
    for model in models:
        try:
            cards.append(checkpoint_card(model, host))
        except (OmnicoreError, OSError, ValueError) as exc:
            print(f"error: {model}: {exc}", file=sys.stderr)
            failed += 1
    if as_json:
        print(json.dumps({"models": cards}, indent=2, sort_keys=True))
    else:
        for card in cards:
            sys.stdout.write(f"{card['checkpoint']['model']} ({card['checkpoint']['path']})\n")
        sys.stdout.write(render(cards))
    return 1 if failed else 0
