"""``omnicore generate MODEL PROMPT -o out.png|out.mp4``: one request through the engine, with a progress bar."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Settings, flags_from_args, resolve_settings
from ..errors import InvalidRequest
from .checks import as_cli, precheck
from .progress import ProgressPrinter

if TYPE_CHECKING:
    from ..engine.request import MediaInput
    from ..plugin_host.host import PluginHost

_SAMPLING_FLAGS = ("height", "width", "num_frames", "fps", "duration", "num_inference_steps", "guidance_scale",
                   "flow_shift", "seed")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings of a ``generate`` run: its flags (declared in ``config.OPTIONS``), the environment, defaults."""
    return resolve_settings(flags_from_args(args, "global", "engine"))


def make_host(settings: Settings) -> PluginHost:
    """The plugin host for a CLI run (installed plugins, the CLI's settings). Tests replace this."""
    from ..plugin_host.host import PluginHost

    return PluginHost(settings)


def parse_extra(items: list[str]) -> dict[str, Any]:
    """``KEY=JSON`` pairs; a value that is not JSON is taken as a plain string."""
    extra: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise InvalidRequest("extra", f"expected KEY=VALUE, got {item!r}")
        try:
            extra[key.strip()] = json.loads(raw)
        except ValueError:
            extra[key.strip()] = raw
    return extra


def media_inputs_from_args(args: argparse.Namespace) -> tuple[MediaInput, ...]:
    """``--first-frame``/``--last-frame`` (images), ``--reference`` (kind read from the file's content), in that
    order; ``--image`` is passed separately (the model's default image role). A file that cannot be read or
    recognised is an ``InvalidRequest`` naming the flag, before any model is loaded."""
    from ..engine.request import MediaInput
    from ..media import sniff_kind

    inputs = []
    for flag, role in (("first_frame", "first_frame"), ("last_frame", "last_frame")):
        path = getattr(args, flag, None)
        if path is not None:
            name = "--" + flag.replace("_", "-")
            if sniff_kind(path, field=name) != "image":
                raise InvalidRequest(name, f"{path} is not an image")
            inputs.append(MediaInput("image", role, path))
    for i, path in enumerate(getattr(args, "reference", None) or ()):
        inputs.append(MediaInput(sniff_kind(path, field=f"--reference[{i}]"), "reference", path))
    for path in getattr(args, "image", None) or ():
        if sniff_kind(path, field="--image") != "image":
            raise InvalidRequest("--image", f"{path} is not an image")
    return tuple(inputs)


def input_flags(args: argparse.Namespace) -> list[str]:
    """The flag each input of the request came from, in the request's order (``media_inputs_from_args``, then
    ``--image``), so errors about ``inputs[i]`` name the flag and file."""
    flags = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in ("first_frame", "last_frame")
             if getattr(args, name, None) is not None]
    flags += [f"--reference {p}" for p in getattr(args, "reference", None) or ()]
    flags += [f"--image {p}" for p in getattr(args, "image", None) or ()]
    return flags


def engine_kwargs(args: argparse.Namespace, model: str | None = None) -> dict[str, Any]:
    """The Engine keywords shared by ``generate`` and ``serve`` (caches, offload, model options, VAE precision,
    parallel layout, compilation, quantization); ``model``: the model as resolved (serve's ``auto``), for
    ``--parallel auto``."""
    from ..engine.model_options import parse_option_args
    from ..parallel.config import ParallelConfig

    auto: dict[str, Any] = {}
    if str(getattr(args, "parallel", None) or "").strip().lower() == "auto":  # omnicore plan picks, before loading
        from .plan_cmd import resolve_auto

        extra = parse_extra(getattr(args, "extra", None) or []) if hasattr(args, "extra") else None
        auto = resolve_auto(args, extra, model=model)
        print(f"parallel auto: {auto.pop('_auto_placement')} (omnicore plan {model or args.model} shows why)",
              file=sys.stderr)
    quantization = auto.pop("quantization", getattr(args, "quantization", None))
    device_memory = auto.pop("device_memory", getattr(args, "device_memory", None))  # auto: the limit it planned
    return {"cache_methods": tuple(getattr(args, "cache", ()) or ()),
            "offload": auto.pop("offload", None) or getattr(args, "offload", "none") or "none",
            "model_options": parse_option_args(getattr(args, "model_option", None) or ()),
            "vae_decode_precision": getattr(args, "vae_decode_precision", None),
            "parallel": auto["parallel"] if auto else ParallelConfig.parse(getattr(args, "parallel", None)),
            "compile": getattr(args, "compile", "none") or "none",
            # only when asked for, so an engine without quantization or warm-up sees the keywords it always did
            **({"quantization": quantization} if quantization not in (None, "none") else {}),
            **({"warmup": True} if getattr(args, "warmup", False) else {}),
            **({"device_memory": device_memory} if device_memory is not None else {})}


def output_type_for(path: str) -> str:
    """The output kind the file suffix asks for (models that make both images and video decide by it).

    An unsupported suffix is an ``InvalidRequest`` on ``output``, raised before any model is loaded."""
    from ..outputs.writers import format_for

    return "video" if format_for(Path(path).suffix, field="output") == "mp4" else "image"


def run(args: argparse.Namespace) -> int:
    sampling = {name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name, None) is not None}
    sampling["output_type"] = output_type_for(args.output)
    settings = settings_from_args(args)
    host = make_host(settings)
    host.select_platform()  # an unknown or unavailable --platform fails here: one line, nothing loaded
    from ..engine.request import GenerationRequest, SamplingParams  # torch-free: checks run before torch loads
    from .lora_args import check_model_takes_lora, generate_loras

    loras, lora_kwargs = generate_loras(args)  # --lora: parsed, found and read before anything loads
    request = GenerationRequest(args.prompt, params=SamplingParams(**sampling), images=tuple(args.image),
                                inputs=media_inputs_from_args(args), negative_prompt=args.negative_prompt,
                                extra=parse_extra(args.extra), quality=getattr(args, "quality", None) or "standard",
                                loras=loras)
    kwargs = {**engine_kwargs(args), **lora_kwargs}
    flags = input_flags(args)
    # everything the spec declares is checked before the load, under the CLI's flag names, once: the engine takes
    # the checked request as it is, and checks the model options itself before it reads any weight
    spec, checked = precheck(args.model, host, request, flags)
    check_model_takes_lora(spec, loras)
    from ..engine.api import Engine  # imports torch: only once the platform and the request are known to be usable

    t0 = time.perf_counter()
    try:
        engine = Engine(args.model, host=host, settings=settings, **kwargs)
    except InvalidRequest as exc:  # a --lora adapter that does not fit the loaded model (checked at load)
        raise as_cli(exc, flags) from None
    with engine:
        listener = None if args.no_progress else ProgressPrinter(sys.stderr)
        try:
            outputs = engine.submit(checked, on_event=listener).result()
        except InvalidRequest as exc:  # the model's own rules, after the load: still under the CLI's names
            raise as_cli(exc, flags) from None
    out = outputs[0]
    path = out.save(args.output)
    print(f"wrote {path} ({out.kind} {out.width}x{out.height}"
          + (f", {out.num_frames} frames at {out.fps:g} fps" if out.kind == "video" else "")
          + f", seed {out.seed}, {time.perf_counter() - t0:.1f} s)")
    if out.text:  # text the model wrote before drawing (HunyuanImage-3's think / recaption): kept beside the output
        text_path = Path(path).with_suffix(Path(path).suffix + ".txt")
        text_path.write_text(out.text + "\n", encoding="utf-8")
        print(f"wrote {text_path} (the model's text):\n{out.text}")
    return 0
