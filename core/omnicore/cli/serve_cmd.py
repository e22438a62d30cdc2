"""``omnicore serve MODEL|auto``: the OpenAI-style HTTP server under uvicorn (serving-api.md, DESIGN §9).

The listener binds first and the model loads in the background (``/health`` says ``loading`` until it is
ready), then a curl example is printed. ``auto`` picks ``tiny:lingbot`` when installed, else the first
registered tiny preset. Its flags are derived from ``config.OPTIONS`` (scope ``server``) by ``cli.main``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import OmnicoreError

PREFERRED_AUTO = "tiny:lingbot"
NO_MODEL_MESSAGE = ("no model plugin is installed; install one, e.g. pip install -e plugins/lingbot "
                    "(`omnicore plugins` lists what is installed)")

class NoModelPlugin(OmnicoreError):
    """``serve auto`` found no registered model with a tiny preset."""


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
    from ..config import flags_from_args, resolve_settings
    from .generate_cmd import make_host

    settings = resolve_settings(flags_from_args(args, "global", "engine", "server"))
    host = make_host(settings)
    host.select_platform()  # an unknown or unavailable --platform fails here: one line, nothing loaded, nothing bound
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

    from .generate_cmd import engine_kwargs

    kwargs = engine_kwargs(args)  # a malformed --model-option fails before the listener starts
    if kwargs["model_options"] and model.lower().startswith("tiny:"):  # unknown names/bad values too, when cheap
        from ..engine.loading import find_preset
        from ..engine.model_options import resolve_model_options

        resolve_model_options(find_preset(host, model)[0], kwargs["model_options"])

    def loader() -> Any:
        return Engine(model, host=host, settings=settings, **kwargs)

    app = create_app(settings=ss, loader=loader, model_arg=model)
    config = uvicorn_config(app, host=ss.host, port=ss.port, read_timeout_s=ss.read_timeout_s,
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
