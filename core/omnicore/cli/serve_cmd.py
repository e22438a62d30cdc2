"""``omnicore serve MODEL|auto``: the OpenAI-style HTTP server under uvicorn (serving-api.md, DESIGN §9).

The listener binds first and the model loads in the background (``/health`` says ``loading`` until it is
ready), then a curl example is printed. ``auto`` picks ``tiny:lingbot`` when installed, else the first
registered tiny preset. This module imports nothing heavy at import time: the parser uses
:func:`add_arguments` while building ``omnicore --help``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import OmnicoreError

PREFERRED_AUTO = "tiny:lingbot"
NO_MODEL_MESSAGE = ("no model plugin is installed; install one, e.g. pip install -e plugins/lingbot "
                    "(`omnicore plugins` lists what is installed)")

# flag -> (type, help); each also reads OMNICORE_<NAME> (see omnicore.server.settings)
_SERVER_FLAGS: dict[str, tuple[Any, str]] = {
    "max_queued_jobs": (int, "queued plus running jobs before 429 (default 64)"),
    "max_image_pixels": (int, "output pixels per image (default 4096*4096)"),
    "max_input_image_pixels": (int, "decode cap for uploaded images (default 50,000,000)"),
    "max_upload_bytes": (int, "per-file upload cap, 413 above it (default 50 MiB)"),
    "max_request_bytes": (int, "whole-body cap, 413 above it (default 200 MiB)"),
    "max_prompt_chars": (int, "prompt length cap (default 32768)"),
    "heartbeat_interval_s": (float, "job heartbeat period in seconds (default 5)"),
    "cancel_wait_s": (float, "how long cancel/DELETE wait for the worker before answering 202 (default 30)"),
    "shutdown_grace_s": (float, "on SIGTERM, how long running work may finish (default 60)"),
    "max_job_seconds": (float, "operator deadline per job; 0 = none (default)"),
    "job_ttl_s": (float, "seconds a finished job is kept; 0 = forever (default 7 days)"),
}


class NoModelPlugin(OmnicoreError):
    """``serve auto`` found no registered model with a tiny preset."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Serve-only flags (the parser in ``cli.main`` already has model, host, port, api key and state dir)."""
    g = p.add_argument_group("server limits (flag > OMNICORE_* env > default)")
    g.add_argument("--api-key-file", help="file with one API key per line (env OMNICORE_API_KEY_FILE)")
    g.add_argument("--cors-origin", action="append", default=None, help="allow this CORS origin (repeatable)")
    for name, (kind, text) in _SERVER_FLAGS.items():
        flag = "--" + (name[:-2] if name.endswith("_s") else name).replace("_", "-")
        g.add_argument(flag, dest=name, type=kind, help=text)


def resolve_auto(host: Any) -> str:
    """The model ``auto`` means: ``tiny:lingbot`` when present, else the first registered tiny preset."""
    from ..engine.loading import known_models

    presets = [name for name in known_models(host) if name.startswith("tiny:")]
    if not presets:
        failed = [f"{r.name} ({r.error})" for r in host.records.values() if r.status != "loaded"]
        extra = f"; plugins that failed to load: {', '.join(failed)}" if failed else ""
        raise NoModelPlugin(NO_MODEL_MESSAGE + extra)
    if PREFERRED_AUTO in presets:
        return PREFERRED_AUTO
    order = [p for spec in host.models for p in presets if p in {f"tiny:{x.name}" for x in spec.presets}]
    return (order or sorted(presets))[0]


def curl_example(base: str, api_key: bool, tasks: tuple[str, ...] = ("image.generate",)) -> str:
    auth = ' -H "Authorization: Bearer $OMNICORE_API_KEY"' if api_key else ""
    lines = []
    if "image.generate" in tasks:
        lines.append(f"curl -s {base}/v1/images/generations{auth} -H 'Content-Type: application/json' "
                     "-d '{\"prompt\": \"a red fox in the snow\", \"num_inference_steps\": 4}'")
    if "video.generate" in tasks:
        lines.append(f"curl -s {base}/v1/videos{auth} -F prompt='a red fox running' -F num_inference_steps=4")
    return "\n  ".join(lines)


def run(args: argparse.Namespace) -> int:
    from ..config import resolve_settings
    from .generate_cmd import _SETTING_FLAGS, make_host

    names = (*_SETTING_FLAGS, *_SERVER_FLAGS, "host", "port", "api_key", "api_key_file", "state_dir")
    flags = {name: getattr(args, name, None) for name in names}
    flags["cors_origins"] = getattr(args, "cors_origin", None)
    settings = resolve_settings(flags)
    host = make_host(settings)
    model = args.model
    if model == "auto":
        try:
            model = resolve_auto(host)
        except NoModelPlugin as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"serve auto: using {model}", file=sys.stderr)
    return serve(args, model=model, host=host, settings=settings)


def serve(args: argparse.Namespace, *, model: str, host: Any, settings: Any) -> int:
    import logging

    from ..engine.api import Engine
    from ..server.app import create_app
    from ..server.http_edge import uvicorn_config
    from ..server.lifecycle import DrainingServer
    from ..server.settings import server_settings_from

    ss = server_settings_from(settings)
    log = logging.getLogger("omnicore.server")
    if ss.host not in ("127.0.0.1", "localhost", "::1") and not ss.api_keys:
        log.warning("binding %s without an API key: anyone who can reach this address can use the server", ss.host)

    def loader() -> Any:
        return Engine(model, host=host, settings=settings, cache_methods=tuple(getattr(args, "cache", ()) or ()),
                      offload=getattr(args, "offload", "none") or "none")

    app = create_app(settings=ss, loader=loader, model_arg=model)
    config = uvicorn_config(app, host=ss.host, port=ss.port, read_timeout_s=getattr(ss, "read_timeout_s", 30.0),
                            shutdown_grace_s=ss.shutdown_grace_s)  # header timeout, quiet /health polls
    server = DrainingServer(config, app.state.ctx)
    base = f"http://{ss.host if ':' not in ss.host else f'[{ss.host}]'}:{ss.port}"

    def announce(state: str) -> None:
        """Printed from the readiness change itself, so a shutdown right after readiness cannot swallow it."""
        ctx = app.state.ctx
        if state == "ok":
            print(f"omnicore: serving {ctx.served.id} ({model}) at {base}; state in {ss.state_dir}\n"
                  f"try:\n  {curl_example(base, bool(ss.api_keys), ctx.served.tasks)}", file=sys.stderr, flush=True)
        elif state == "unhealthy":
            print(f"omnicore: {model} is unhealthy: {ctx.readiness.error}", file=sys.stderr, flush=True)

    app.state.ctx.readiness.on_change(announce)
    print(f"omnicore: listening on {base}; loading {model} (GET {base}/health says when it is ready)",
          file=sys.stderr, flush=True)
    server.run()
    return 0 if app.state.ctx.readiness.state != "unhealthy" else 1
