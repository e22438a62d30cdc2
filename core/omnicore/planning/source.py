"""Where a plan's model comes from: a ``real:`` preset (configs only), a ``tiny:`` preset, a checkpoint
directory or a Hub repository's metadata mirror (the header reader is :mod:`omnicore.planning.headers`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from .._lazy import resolve
from ..errors import InvalidRequest, UnknownName
from ..specs import ModelSpec, PresetSpec
from .headers import MAX_HEADER, ByteCounter, read_safetensors_header
from .hub import looks_like_repo_id, mirror_hub_repo

if TYPE_CHECKING:
    from ..config import Settings
    from ..plugin_host.host import PluginHost

REAL_PREFIX = "real:"
#: safetensors dtype names -> bytes per element
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
__all__ = ["MAX_HEADER", "ByteCounter", "PlanSource", "read_safetensors_header"]


@attrs.frozen
class PlanSource:
    """The model to plan: its spec, its directory, where it came from and the plugin's planning functions."""

    spec: ModelSpec
    root: Path
    kind: str  # "real" | "preset" | "local" | "hub"
    name: str
    profile: Any  # the plugin module holding plan_model / plan_request


def header_parameters(root: Path, counter: ByteCounter | None = None) -> dict[str, dict[str, int]]:
    """Per folder (relative to ``root``; ``.`` for the root itself): declared elements and bytes of every tensor
    in its safetensors files, from the headers alone."""
    out: dict[str, dict[str, int]] = {}
    for path in sorted(root.rglob("*.safetensors")):
        header = read_safetensors_header(path, counter)
        folder = str(path.parent.relative_to(root)) or "."
        entry = out.setdefault(folder, {"params": 0, "bytes": 0, "tensors": 0})
        for info in header.values():
            numel = 1
            for d in info["shape"]:
                numel *= int(d)
            entry["params"] += numel
            entry["bytes"] += numel * _DTYPE_BYTES.get(info["dtype"], 4)
            entry["tensors"] += 1
    return out


def profile_module(spec: ModelSpec) -> Any:
    """The module of the spec's tiny presets, which holds its planning functions (``None`` if it has none)."""
    for preset in spec.presets:
        module = resolve(preset.builder.partition(":")[0])  # the module alone
        if hasattr(module, "plan_model") and hasattr(module, "plan_request"):
            return module
    return None


def real_presets(host: PluginHost) -> dict[str, tuple[ModelSpec, str]]:
    """Every ``real:<model>`` preset the installed model plugins ship: name -> (spec, builder path)."""
    found: dict[str, tuple[ModelSpec, str]] = {}
    for spec in host.models:
        try:
            module = profile_module(spec)
        except ImportError:
            continue
        for name, builder in dict(getattr(module, "REAL_PRESETS", {}) or {}).items():
            found[name] = (spec, builder)
    return found


def resolve_source(model: str, host: PluginHost, settings: Settings) -> PlanSource:
    """``real:<model>`` (configs written once into the cache, no weights), ``tiny:<preset>``, a directory, or a
    Hub repository id (its metadata mirror: :mod:`omnicore.planning.hub`)."""
    from ..engine.loading import detect_spec, ensure_preset, find_preset

    text = str(model)
    if text.lower().startswith(REAL_PREFIX):
        presets = real_presets(host)
        if text.lower() not in presets:
            raise UnknownName("model", text, {k: v[0].provider for k, v in presets.items()})
        spec, builder = presets[text.lower()]
        root = ensure_preset(spec, PresetSpec(name=text.lower(), builder=builder), settings.cache_path)
        kind = "real"
    elif text.lower().startswith("tiny:"):
        spec, preset = find_preset(host, text)
        root = ensure_preset(spec, preset, settings.cache_path)
        kind = "preset"
    elif hub_repo_id(text) is not None:  # configs + safetensors headers over HTTP range reads, no tensor data
        repo, _, revision = str(hub_repo_id(text)).partition("@")
        root = mirror_hub_repo(repo, Path(settings.cache_path), revision=revision or None)
        spec = detect_spec(host, root)
        kind = "hub"
    else:
        root = Path(text).expanduser()
        if not root.is_dir():
            raise InvalidRequest("model", f"{text!r} is not a real:<model> preset, a tiny:<preset>, a local "
                                          "checkpoint directory nor a Hub repository id (org/name)")
        spec = detect_spec(host, root)
        kind = "local"
    profile = profile_module(spec)
    if profile is None:
        raise InvalidRequest("model", f"model {spec.name} ({spec.provider}) does not describe itself to the planner "
                                      "(its presets module has no plan_model / plan_request)")
    return PlanSource(spec=spec, root=Path(root), kind=kind, name=text, profile=profile)


def hub_repo_id(text: str) -> str | None:
    """``org/name`` or ``org/name@revision`` (``hf://`` prefix allowed) that is not a local path, else None."""
    body = text[len("hf://"):] if text.startswith("hf://") else text
    return body if looks_like_repo_id(body.partition("@")[0]) else None


def call(profile: Any, name: str) -> Callable[..., Any]:
    fn: Callable[..., Any] = getattr(profile, name)
    return fn
