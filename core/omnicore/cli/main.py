"""``omnicore`` entry point: argument parsing and dispatch to lazily imported subcommands."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence

from .._version import PLUGIN_API_VERSION, __version__
from ..config import add_flags
from ..errors import OmnicoreError
from ..json_types import JSONObject

# subcommand -> "module:function" (imported only when that subcommand runs)
_COMMANDS = {
    "plugins": "omnicore.cli.plugins_cmd:run",
    "generate": "omnicore.cli.generate_cmd:run",
    "serve": "omnicore.cli.serve_cmd:run",
    "models": "omnicore.cli.models_cmd:run",
    "plan": "omnicore.cli.plan_cmd:run",
}


def parse_cache_arg(text: str) -> str | tuple[str, JSONObject]:
    """``--cache NAME`` or ``--cache NAME:KEY=VALUE[,KEY=VALUE...]``; values are JSON when they parse as JSON
    (``0.3``, ``true``, ``[2,3]``), else plain strings. Options are checked by the cache method itself."""
    name, sep, rest = text.partition(":")
    name = name.strip()
    if not name:
        raise argparse.ArgumentTypeError(f"--cache needs a method name, got {text!r}")
    if not sep:
        return name
    options: JSONObject = {}
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
                        "options after a colon, e.g. teacache:rel_l1_thresh=0.3 or adaln_schedule:offload_weights=true "
                        "(default: none)")
    g.add_argument("--offload", choices=("none", "model", "layerwise"), default="none",
                   help="CPU offload of weights between uses (default: none)")
    g.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a deployment option the model declares (repeatable); `omnicore models` lists them with "
                        "their defaults (default: none given)")
    g.add_argument("--vae-decode-precision", choices=("fp32", "fp16", "bf16"),
                   help="precision of the VAE decode, for models that support another one than the DiT's "
                        "(default: the model's choice)")
    g.add_argument("--parallel", metavar="DIM=N[,DIM=N]", default=None,
                   help="run over several worker processes on torch.distributed (gloo on CPU, NCCL on CUDA, HCCL "
                        "on NPU): cfg=2 puts the two guidance branches on two ranks, ulysses=N shards the sequence "
                        "over N ranks, tp=N splits heads and MLP widths, ep=N a MoE model's experts; e.g. "
                        "cfg=2,ulysses=2 (4 processes). Under torchrun, attaches to its ranks. "
                        "auto: the placement `omnicore plan` picks for the visible devices and this request "
                        "(a request nothing fits is refused before loading) (default: one process)")
    g.add_argument("--quantization", choices=("none", "int8", "fp8"), default="none",
                   help="weight-only quantization of the model's DiT-block and text-encoder linears (per output "
                        "channel, float32 scales; torchao when installed, else a reference implementation); "
                        "`omnicore plan` shows what it saves (default: none)")
    g.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                   help="per-device memory limit: a request whose estimated peak (the placement's weights + its "
                        "activations and caches, as `omnicore plan` prices them) exceeds it is refused before it "
                        "runs (HTTP 400 memory_limit_exceeded); 0 turns the check off (default: a CUDA device's "
                        "total memory; no check on CPU)")
    g.add_argument("--warmup", action="store_true",
                   help="run one 1-step generation at the model's default request before serving, so one-time costs "
                        "(with --compile: compiling that shape) are paid at start-up (default: off)")
    g.add_argument("--compile", nargs="?", const="blocks", default="none",
                   choices=("none", "blocks", "blocks-cudagraphs"),
                   help="regional torch.compile of the model's repeated transformer blocks (one compiled graph per "
                        "block class; the first request of each new shape compiles); blocks-cudagraphs adds CUDA "
                        "graphs (cuda only). Not with --offload or --parallel (default: none, eager)")


MODEL_HELP = ("tiny:<preset> (a random-weight test model; `omnicore models` lists them), a local checkpoint "
              "directory, or a Hugging Face repo id")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omnicore", allow_abbrev=False,  # `--step 2` is an error, not a silent `--steps 2`
        description="Serve and run diffusion models (images, video, video+audio) through plugins.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and installed plugins")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show third-party progress bars and warnings (diffusers, transformers ...)")
    add_flags(parser, "global")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    m = sub.add_parser("models", help="list registered models: modes, input roles, presets and options",
                       allow_abbrev=False)
    m.add_argument("--json", action="store_true", help="machine-readable output")
    m.add_argument("model", nargs="*", metavar="MODEL",
                   help="describe these checkpoints instead (a directory, tiny:<preset>, diffusers:<dir>): each is "
                        "loaded, so the card is the checkpoint's own (a diffusers pipeline's modes and roles come "
                        "from its signature); this takes as long as loading the model")
    from .lora_args import add_models_lora_flags

    add_models_lora_flags(m)

    p = sub.add_parser("plugins", help="list installed plugins and what they register", allow_abbrev=False)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--requirements", action="store_true", help="print name==version lines to reinstall plugins")
    p.add_argument("--check", action="store_true",
                   help="also import every registered implementation (pipelines, platforms, backends, preset "
                        "builders) in a child process, with torch; a plugin whose code cannot import is reported "
                        "as FAILED and the exit status is 1 (default: off, nothing heavy is imported)")

    g = sub.add_parser("generate", help="generate an image or a video from a prompt", allow_abbrev=False,
                       description="Generate one image or video. Unset sampling flags take the model's defaults "
                                   "(a tiny preset's own, see `omnicore models`); what can be checked without the "
                                   "model (sizes, files, roles, required fields) is checked before it loads.")
    g.add_argument("model", help=MODEL_HELP)
    g.add_argument("prompt", help="the text prompt")
    g.add_argument("-o", "--output", required=True, help="output file: .png/.webp for images, .mp4 for video "
                                                         "(required; the suffix picks the output kind)")
    g.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="input image in the model's default image role (repeatable; default: none)")
    g.add_argument("--first-frame", metavar="PATH", help="image conditioning the first frame (default: none)")
    g.add_argument("--last-frame", metavar="PATH", help="image conditioning the last frame (default: none)")
    g.add_argument("--reference", action="append", default=[], metavar="PATH",
                   help="reference image, video or audio (kind read from the file's content; repeatable; "
                        "default: none)")
    g.add_argument("--duration", type=float, metavar="SECONDS",
                   help="video length in seconds (default: the model's frame count)")
    g.add_argument("--quality", choices=("draft", "standard", "high"), default="standard",
                   help="quality tier the model may trade speed for (default: standard)")
    g.add_argument("--negative-prompt", metavar="TEXT", help="what to steer away from (default: the model's)")
    g.add_argument("--height", type=int, metavar="PX", help="output height in pixels (default: the model's)")
    g.add_argument("--width", type=int, metavar="PX", help="output width in pixels (default: the model's)")
    g.add_argument("--num-frames", type=int, metavar="N", help="video frames; 1 = an image (default: the model's)")
    g.add_argument("--fps", type=float, help="video frame rate (default: the model's)")
    g.add_argument("--steps", type=int, dest="num_inference_steps", metavar="N",
                   help="denoise steps (default: the model's; a real checkpoint wants ~30-50, tiny presets 2-4)")
    g.add_argument("--guidance", type=float, dest="guidance_scale", metavar="SCALE",
                   help="classifier-free guidance scale (default: the model's)")
    g.add_argument("--flow-shift", type=float, metavar="SHIFT",
                   help="flow-matching schedule shift (default: the model's)")
    g.add_argument("--seed", type=int, metavar="N",
                   help="random seed, 0..2**63-1 (default: the model's declared seed, else a random one; the seed "
                        "used is printed)")
    g.add_argument("--extra", action="append", default=[], metavar="KEY=JSON",
                   help="model-specific field (repeatable), e.g. --extra aspect_ratio=16:9; `omnicore models` "
                        "lists each model's fields and which are required (default: none)")
    from .lora_args import add_lora_flag

    add_lora_flag(g)
    g.add_argument("--no-progress", action="store_true", help="do not draw the progress bar (default: drawn)")
    g.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="show third-party progress bars and warnings (default: hidden)")
    _add_engine_flags(g)

    s = sub.add_parser("serve", help="run the OpenAI-style HTTP server", allow_abbrev=False,
                       description="Serve one model over HTTP (OpenAI-style images and video jobs). A model that "
                                   "cannot be found or loaded, a busy port or missing server packages end it with "
                                   "exit code 2 and one line; SIGINT/SIGTERM drain running work and exit 0.")
    s.add_argument("model", nargs="*", help=MODEL_HELP + "; `auto`: tiny:lingbot when installed, else the first "
                                                         "registered tiny preset; several models (or --models "
                                                         "models.toml) are served by one process under "
                                                         "--memory-budget, the request's `model` choosing one")
    s.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="show third-party progress bars and warnings, and tracebacks of load failures "
                        "(default: hidden)")
    add_flags(s, "server", title="server (flag > OMNICORE_* env > default)")
    _add_engine_flags(s)
    from .plan_cmd import add_parser as add_plan_parser  # torch-free; the plan itself imports torch lazily

    pl = add_plan_parser(sub)
    parser.set_defaults(_subparsers={"models": m, "plugins": p, "generate": g, "serve": s, "plan": pl})
    return parser


def _version_text() -> str:
    from ..plugin_host import LOADED, default_host

    lines = [f"omnicore {__version__} (plugin API {PLUGIN_API_VERSION})"]
    for rec in default_host().records.values():
        if rec.name != "omnicore":
            status = "" if rec.status == LOADED else f" [{rec.status}]"
            lines.append(f"  {rec.name}: {rec.dist} {rec.version}{status}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top-level one, for a flag it does not know
        sub = args._subparsers.get(args.command) if args.command else None
        (sub or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
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
