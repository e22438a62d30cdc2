"""``omnicore`` entry point: argument parsing and dispatch to lazily imported subcommands."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from .._version import PLUGIN_API_VERSION, __version__
from ..config import add_flags
from ..errors import OmnicoreError

# subcommand -> "module:function" (imported only when that subcommand runs)
_COMMANDS = {
    "plugins": "omnicore.cli.plugins_cmd:run",
    "generate": "omnicore.cli.generate_cmd:run",
    "serve": "omnicore.cli.serve_cmd:run",
    "models": "omnicore.cli.models_cmd:run",
}


def parse_cache_arg(text: str) -> str | tuple[str, dict[str, Any]]:
    """``--cache NAME`` or ``--cache NAME:KEY=VALUE[,KEY=VALUE...]``; values are JSON when they parse as JSON
    (``0.3``, ``true``, ``[2,3]``), else plain strings. Options are checked by the cache method itself."""
    name, sep, rest = text.partition(":")
    name = name.strip()
    if not name:
        raise argparse.ArgumentTypeError(f"--cache needs a method name, got {text!r}")
    if not sep:
        return name
    options: dict[str, Any] = {}
    for item in _split_top_level(rest):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(f"--cache {name}: expected KEY=VALUE, got {item!r}")
        try:
            options[key.strip()] = json.loads(raw)
        except ValueError:
            options[key.strip()] = raw
    return name, options


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets, so ``force_hits=[2,3],warmup_steps=1`` gives two items."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "[{("
        depth -= ch in "]})"
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item.strip()]


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    add_flags(g, "engine")  # settings flags, all declared in config.OPTIONS
    g.add_argument("--cache", action="append", default=[], metavar="METHOD[:KEY=VALUE,...]", type=parse_cache_arg,
                   help="enable a cache method (repeatable): teacache, first_block_cache, adaln_schedule ...; "
                        "options after a colon, e.g. teacache:rel_l1_thresh=0.3 or adaln_schedule:offload_weights=true")
    g.add_argument("--offload", choices=("none", "model", "layerwise"), default="none",
                   help="CPU offload of weights between uses")
    g.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a deployment option the model declares (repeatable); `omnicore models` lists them")
    g.add_argument("--vae-decode-precision", choices=("fp32", "fp16", "bf16"),
                   help="precision of the VAE decode, for models that support another one than the DiT's")
    g.add_argument("--parallel", metavar="DIM=N[,DIM=N]", default=None,
                   help="run over several worker processes on torch.distributed (gloo on CPU, NCCL on CUDA, HCCL "
                        "on NPU): cfg=2 puts the two guidance branches on two ranks, ulysses=N shards the sequence "
                        "over N ranks; e.g. cfg=2,ulysses=2 (4 processes). Under torchrun, attaches to its ranks")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnicore",
        description="Serve and run diffusion models (images, video, video+audio) through plugins.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and installed plugins")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show third-party progress bars and warnings (diffusers, transformers ...)")
    add_flags(parser, "global")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    m = sub.add_parser("models", help="list registered models: modes, input roles, presets and options")
    m.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("plugins", help="list installed plugins and what they register")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--requirements", action="store_true", help="print name==version lines to reinstall plugins")

    g = sub.add_parser("generate", help="generate an image or a video from a prompt")
    g.add_argument("model", help="tiny:<preset>, a local checkpoint directory, or a Hugging Face repo id")
    g.add_argument("prompt")
    g.add_argument("-o", "--output", required=True, help="output file: .png/.webp for images, .mp4 for video")
    g.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="input image in the model's default image role (repeatable)")
    g.add_argument("--first-frame", metavar="PATH", help="image conditioning the first frame")
    g.add_argument("--last-frame", metavar="PATH", help="image conditioning the last frame")
    g.add_argument("--reference", action="append", default=[], metavar="PATH",
                   help="reference image, video or audio (kind read from the file's content; repeatable)")
    g.add_argument("--duration", type=float, metavar="SECONDS", help="video length in seconds")
    g.add_argument("--quality", choices=("draft", "standard", "high"), default="standard",
                   help="quality tier the model may trade speed for (default standard)")
    g.add_argument("--negative-prompt")
    g.add_argument("--height", type=int)
    g.add_argument("--width", type=int)
    g.add_argument("--num-frames", type=int)
    g.add_argument("--fps", type=float)
    g.add_argument("--steps", type=int, dest="num_inference_steps")
    g.add_argument("--guidance", type=float, dest="guidance_scale")
    g.add_argument("--flow-shift", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--extra", action="append", default=[], metavar="KEY=JSON",
                   help="model-specific field (repeatable), e.g. --extra batch_cfg=true")
    g.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    g.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="show third-party progress bars and warnings")
    _add_engine_flags(g)

    s = sub.add_parser("serve", help="run the OpenAI-style HTTP server")
    s.add_argument("model", help="tiny:<preset>, a local checkpoint directory, or a Hugging Face repo id")
    s.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="show third-party progress bars and warnings")
    add_flags(s, "server", title="server (flag > OMNICORE_* env > default)")
    _add_engine_flags(s)
    return parser


def _version_text() -> str:
    from ..plugins import LOADED, default_host

    lines = [f"omnicore {__version__} (plugin API {PLUGIN_API_VERSION})"]
    for rec in default_host().records.values():
        if rec.name != "omnicore":
            status = "" if rec.status == LOADED else f" [{rec.status}]"
            lines.append(f"  {rec.name}: {rec.dist} {rec.version}{status}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_level:
        logging.basicConfig(level=args.log_level.upper())
    if args.version:
        print(_version_text())
        return 0
    if not args.command:
        parser.print_help()
        return 0
    if not args.verbose:
        from .quiet import silence_third_party

        silence_third_party()
    module_name, _, func_name = _COMMANDS[args.command].partition(":")
    handler = getattr(importlib.import_module(module_name), func_name)
    try:
        code = int(handler(args) or 0)
        sys.stdout.flush()  # here, so a closed pipe is caught below and not at interpreter exit
        return code
    except BrokenPipeError:  # `omnicore plugins --json | head`: the reader has what it wanted
        _discard_stdout()
        return 0
    except OmnicoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _discard_stdout() -> None:
    """Point stdout at /dev/null so Python's final flush does not raise again on the closed pipe."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
