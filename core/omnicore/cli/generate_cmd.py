"""``omnicore generate MODEL PROMPT -o out.png|out.mp4``: one request through the engine, with a progress bar."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..config import Settings, flags_from_args, resolve_settings
from ..errors import InvalidRequest
from .progress import ProgressPrinter

_SAMPLING_FLAGS = ("height", "width", "num_frames", "fps", "num_inference_steps", "guidance_scale", "flow_shift",
                   "seed")
def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings of a ``generate`` run: its flags (declared in ``config.OPTIONS``), the environment, defaults."""
    return resolve_settings(flags_from_args(args, "global", "engine"))


def make_host(settings: Settings) -> Any:
    """The plugin host for a CLI run (installed plugins, the CLI's settings). Tests replace this."""
    from ..plugins.host import PluginHost

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
    from ..engine.api import Engine, make_request  # imports torch: only once the platform is known to be usable

    request = make_request(args.prompt, images=tuple(args.image), negative_prompt=args.negative_prompt,
                           extra=parse_extra(args.extra), **sampling)
    t0 = time.perf_counter()
    with Engine(args.model, host=host, settings=settings, cache_methods=tuple(args.cache),
                offload=args.offload) as engine:
        listener = None if args.no_progress else ProgressPrinter(sys.stderr)
        outputs = engine.submit(request, on_event=listener).result()
    out = outputs[0]
    path = out.save(args.output)
    print(f"wrote {path} ({out.kind} {out.width}x{out.height}"
          + (f", {out.num_frames} frames at {out.fps:g} fps" if out.kind == "video" else "")
          + f", seed {out.seed}, {time.perf_counter() - t0:.1f} s)")
    return 0
