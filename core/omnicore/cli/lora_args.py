"""LoRA on the command line: ``generate --lora NAME_OR_PATH[:SCALE]`` (repeatable) and the server's adapter
settings (``--lora-modules NAME=PATH``, ``--lora-dir DIR``, ``--max-lora-bytes N``, declared in ``config.OPTIONS``).

``generate`` runs on the user's own machine, so its adapters are paths: each one becomes a preloaded adapter named
by the text given (the registry then opens exactly those paths and nothing else). A path that does not exist, or is
not an adapter the core can read, is refused naming ``--lora`` before the model loads. Torch-free until an adapter
file is opened.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequest
from ..json_types import JSONObject

if TYPE_CHECKING:
    from ..config import Settings
    from ..lora.records import LoRA
    from ..specs import ModelSpec

LORA_HELP = ("a LoRA adapter applied to this request without merging (repeatable: adapters compose): a PEFT/diffusers "
             "directory (adapter_config.json + adapter_model.safetensors) or one kohya/A1111/diffusers .safetensors "
             "file; only a trailing :NUMBER is a scale, so C:\\loras\\x and ./a:b stay paths (default scale 1; "
             "default: none)")


def add_lora_flag(parser: argparse._ActionsContainer) -> None:  # a parser or an argument group
    """``--lora`` on ``generate``."""
    parser.add_argument("--lora", action="append", default=[], metavar="NAME_OR_PATH[:SCALE]", help=LORA_HELP)


def parse_lora_flags(values: Sequence[str], flag: str = "--lora") -> tuple[LoRA, ...]:
    """``NAME_OR_PATH[:SCALE]`` texts -> :class:`~omnicore.lora.LoRA` records; a bad scale, an empty name or too
    many adapters is an :class:`InvalidRequest` naming ``flag`` and the text given."""
    from ..lora.records import LoRA, as_loras

    loras = []
    for text in values:
        head, sep, tail = text.rpartition(":")
        try:
            scale = float(tail) if sep and head else None
        except ValueError:  # "C:\\x", "./a:b": no number after the last colon, so it is all name
            scale = None
        try:  # a number after the last colon is the scale, checked (a NaN or 1e9 is an error, not a file name)
            loras.append(LoRA(head, scale) if scale is not None else LoRA(text))
        except InvalidRequest as exc:
            raise InvalidRequest(flag, f"{text!r}: {exc.rule}") from None
    try:
        return as_loras(loras)
    except InvalidRequest as exc:
        raise InvalidRequest(flag, exc.rule) from None


def generate_lora_modules(loras: Sequence[LoRA], flag: str = "--lora") -> tuple[tuple[str, str], ...]:
    """The adapters ``generate`` preloads: each ``--lora`` path, named by the text given (so the request's
    ``LoRA(name)`` resolves to it). A path that does not exist is refused here, naming the flag."""
    modules: dict[str, str] = {}
    for lora in loras:
        path = Path(lora.name_or_path).expanduser()
        if not path.exists():
            raise InvalidRequest(flag, f"{lora.name_or_path}: no such file or directory (generate reads adapters from "
                                       "paths; adapter names are a server's --lora-modules)")
        modules[lora.name_or_path] = str(path)
    return tuple(modules.items())


def check_adapter_files(loras: Sequence[LoRA], modules: Sequence[tuple[str, str]], flag: str = "--lora") -> None:
    """Read each adapter once with the core's reader (layout, safetensors only, config) so a file that can never
    load fails before the model does; what depends on the model (module names, shapes) is checked after the
    load, at admission, and reported under the same flag."""
    from ..lora.errors import LoRAError
    from ..lora.formats import read_adapter

    paths = dict(modules)
    for lora in loras:
        try:
            read_adapter(Path(paths[lora.name_or_path]).resolve(), lora.name_or_path)
        except LoRAError as exc:
            raise InvalidRequest(flag, exc.rule) from None


def generate_loras(args: argparse.Namespace) -> tuple[tuple[LoRA, ...], dict[str, Any]]:
    """``generate``'s adapters and the Engine keywords that serve them: ``(loras, {"lora_registry": ...})``, or
    ``((), {})`` without ``--lora``. Every adapter is parsed, found and read here, before the model loads."""
    loras = parse_lora_flags(getattr(args, "lora", None) or ())
    if not loras:
        return (), {}
    from ..lora.registry import AdapterRegistry

    modules = generate_lora_modules(loras)
    check_adapter_files(loras, modules)
    return loras, {"lora_registry": AdapterRegistry(modules=dict(modules))}


def check_model_takes_lora(spec: ModelSpec | None, loras: Sequence[LoRA], flag: str = "--lora") -> None:
    """A model whose spec declares no adaptable modules refuses ``--lora`` before it loads."""
    if loras and spec is not None and getattr(spec, "lora", None) is None:
        raise InvalidRequest(flag, f"model {spec.name} does not take LoRA adapters")


def as_cli_lora(exc: InvalidRequest, flag: str = "--lora") -> InvalidRequest:
    """A LoRA refusal raised after the load (``loras``), reported under the CLI's flag."""
    if exc.field == "loras" or exc.field.startswith(("loras.", "loras[")):
        return InvalidRequest(flag, exc.rule)
    return exc


def registry_config(settings: Settings) -> dict[str, Any]:
    """The adapter registry's arguments from resolved settings (``lora_modules``, ``lora_dirs``, ``max_lora_bytes``,
    ``max_lora_host_bytes``), in :class:`~omnicore.lora.AdapterRegistry`'s names."""
    return {"modules": dict(settings.lora_modules or ()), "lora_dirs": tuple(settings.lora_dirs or ()),
            "max_device_bytes": settings.max_lora_bytes,
            "max_host_bytes": getattr(settings, "max_lora_host_bytes", None)}


def uses_lora(settings: Settings) -> bool:
    return bool(settings.lora_modules or settings.lora_dirs)


_SERVE_FLAG = {"lora_modules": "--lora-modules", "lora_dir": "--lora-dir", "lora_dirs": "--lora-dir",
               "max_lora_bytes": "--max-lora-bytes", "max_lora_host_bytes": "--max-lora-host-bytes"}


def serve_lora_kwargs(settings: Settings, spec: ModelSpec | None = None) -> dict[str, Any]:
    """``serve``'s Engine keywords for its adapters (``{"lora_registry": ...}``; ``{}`` without LoRA settings),
    built before the listener binds: a missing adapter path or directory, or a model that takes no adapters, ends
    ``serve`` with one line naming the flag. The adapters themselves are read and checked against the model when
    it loads (a bad one fails the start-up, naming it)."""
    from ..errors import ConfigError

    config = registry_config(settings)
    if not uses_lora(settings) and config["max_device_bytes"] is None:
        return {}
    if spec is not None and getattr(spec, "lora", None) is None and uses_lora(settings):
        flag = "--lora-modules" if settings.lora_modules else "--lora-dir"
        raise ConfigError(flag, f"model {spec.name} does not take LoRA adapters")
    from ..lora.registry import AdapterRegistry

    try:
        return {"lora_registry": AdapterRegistry(**config)}
    except ConfigError as exc:
        raise ConfigError(_SERVE_FLAG.get(exc.name, exc.name), exc.rule) from None


def add_models_lora_flags(parser: argparse.ArgumentParser) -> None:
    """``omnicore models --lora-modules NAME=PATH`` lists those adapters as ``serve`` would preload them;
    ``OMNICORE_LORA_MODULES`` does the same without the flag."""
    parser.add_argument("--lora-modules", dest="lora_modules", action="append", default=None, metavar="NAME=PATH",
                        help="LoRA adapters to list, as `serve --lora-modules` preloads them: layout, rank, adapted "
                             "modules, base model (env OMNICORE_LORA_MODULES; default: none)")


def describe_adapter(name: str, path: str) -> dict[str, object]:
    """What an adapter file says about itself, read from the safetensors header and ``adapter_config.json`` only
    (no tensor data, no torch): ``layout``, ``rank``, ``modules`` (adapted linears), ``base_model``; a file that
    cannot be read is listed with its ``error``."""
    import json

    from ..lora.formats import PEFT_CONFIG, PEFT_WEIGHTS

    card: dict[str, object] = {"name": name, "path": path}
    root = Path(path).expanduser()
    config: JSONObject = {}
    try:
        weights = root
        if root.is_dir():
            if (root / PEFT_CONFIG).is_file():
                config = json.loads((root / PEFT_CONFIG).read_text(encoding="utf-8"))
                weights = root / PEFT_WEIGHTS
            else:
                found = sorted(root.glob("*.safetensors"))
                if len(found) != 1:
                    raise ValueError(f"expected one .safetensors file, found {len(found)}")
                weights = found[0]
        if weights.suffix != ".safetensors":
            raise ValueError("not a .safetensors file")
        with open(weights, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if not 0 < size <= 100 * 1024 * 1024:
                raise ValueError("not a safetensors file (bad header length)")
            header = json.loads(fh.read(size))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return {**card, "error": f"{type(exc).__name__}: {exc}"}
    downs = {k: v for k, v in header.items() if k != "__metadata__" and (".lora_A" in k or ".lora_down" in k)}
    kohya = any(k.startswith(("lora_unet_", "lora_transformer_", "lora_te")) for k in header)
    layout = "peft" if config else "kohya" if kohya else "diffusers"
    ranks = [int(v["shape"][0]) for v in downs.values() if isinstance(v, dict) and v.get("shape")]
    return {**card, "layout": layout, "rank": max(ranks, default=0), "modules": len(downs),
            "base_model": config.get("base_model_name_or_path")}


def render_adapters(cards: Sequence[dict[str, object]]) -> str:
    """The ``omnicore models`` lines of the adapters listed with ``--lora-modules``."""
    lines = []
    for c in cards:
        if "error" in c:
            lines.append(f"lora {c['name']}: {c['path']} (cannot be read: {c['error']})")
            continue
        base = f", trained on {c['base_model']}" if c.get("base_model") else ""
        lines.append(f"lora {c['name']}: {c['path']} ({c['layout']}, rank {c['rank']}, {c['modules']} modules{base})")
    return "\n".join(lines) + ("\n" if lines else "")


__all__ = [
    "LORA_HELP", "add_lora_flag", "add_models_lora_flags", "as_cli_lora", "check_adapter_files",
    "check_model_takes_lora", "describe_adapter", "generate_lora_modules", "generate_loras", "parse_lora_flags",
    "registry_config", "render_adapters", "serve_lora_kwargs", "uses_lora",
]
