"""``omnicore serve MODEL|auto``: the OpenAI-style HTTP server under uvicorn.

Before anything binds, the model argument is resolved (an unknown one ends ``serve`` with one line and exit 2),
the server packages are imported and the port is tried. The listener then binds and the model loads in the
background (``/health`` says ``loading`` until it is ready); once ready a curl example that works for that
model is printed. A model that fails to load ends the server (exit 2, one line), and SIGINT/SIGTERM drain
and exit 0. The default state directory is per model (``<cache>/state/<model>``). ``auto`` picks
``tiny:lingbot`` when installed, else the first registered tiny preset. Its flags are derived from
``config.OPTIONS`` (scope ``server``) by ``cli.main``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import logging
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, OmnicoreError

if TYPE_CHECKING:
    import uvicorn

    from ..config import Settings
    from ..engine.api import Engine
    from ..plugin_host.host import PluginHost
    from ..pool.pool import ModelPool
    from ..server.app import ServerContext
    from ..server.lifecycle import DrainingServer
    from ..specs import ModelSpec, PresetSpec

PREFERRED_AUTO = "tiny:lingbot"
NO_MODEL_MESSAGE = ("no model plugin is installed; install one, e.g. pip install -e plugins/lingbot "
                    "(`omnicore plugins` lists what is installed)")


class NoModelPlugin(OmnicoreError):
    """``serve auto`` found no registered model with a tiny preset."""


class ServeUnavailable(OmnicoreError):
    """``serve`` cannot start: its packages are missing or the address cannot be bound."""


#: import name -> distribution of the ``serve`` extra (``pip install 'omnicore[serve]'``)
SERVE_MODULES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client",
                 "python_multipart|multipart": "python-multipart"}


def check_server_dependencies() -> None:
    """Import what the server needs; a missing one is one line saying what to install (exit 2), not a
    ``ModuleNotFoundError`` traceback from deep inside the app."""
    missing = []
    for names, dist in SERVE_MODULES.items():
        for name in names.split("|"):
            try:
                importlib.import_module(name)
                break
            except ImportError:
                continue
        else:
            missing.append(dist)
    if missing:
        raise ServeUnavailable(f"omnicore serve needs the server packages ({', '.join(missing)} not importable); "
                               "install them with: pip install 'omnicore[serve]'")


def check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` once (as uvicorn will, with ``SO_REUSEADDR``) and let go, so a busy port is one line and
    exit 2 before anything loads; port 0 (the OS picks) always binds."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ServeUnavailable(f"--host {host}: cannot resolve it ({exc})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(addr)
        except OSError as exc:
            import errno

            if exc.errno == errno.EADDRINUSE:
                raise ServeUnavailable(f"--port {port}: {host}:{port} is already in use (another server?); pick "
                                       "another port with --port") from None
            raise ServeUnavailable(f"--host {host} --port {port}: cannot bind ({exc.strerror or exc})") from None


def check_step_checkpoints(settings: Settings, spec: ModelSpec | None, *, several: bool, parallel: object) -> None:
    """``--checkpoint-every K`` where it cannot take effect is refused before listening, naming the flag: step
    checkpoints are written and resumed by replicas claiming jobs from a shared store, one model per server, on one
    process, for models that declare checkpointable step state."""
    if not getattr(settings, "checkpoint_every", 0):
        return
    reason = None
    if not str(getattr(settings, "store", None) or "").startswith(("postgresql://", "postgres://")):
        reason = ("needs a shared job store (--store postgresql://...): the replica that re-claims an interrupted "
                  "job resumes it; one server's SQLite store re-runs such a job from step 0")
    elif several:
        reason = "is not supported with several models in one server yet"
    elif parallel is not None and getattr(parallel, "world_size", 1) > 1:
        reason = "is not supported with --parallel yet"
    elif spec is not None and not spec.capabilities.checkpointable:
        reason = f"model {spec.name} does not declare checkpointable step state (omnicore models lists those that do)"
    if reason is not None:
        raise ConfigError("--checkpoint-every", reason)


def default_state_dir(cache: Path, model: str) -> Path:
    """``<cache>/state/<model>``: the default state directory of a server of ``model`` (``tiny-lingbot``; a local
    checkpoint directory by its name plus a hash of its absolute path, so two checkouts never share one)."""
    text = str(model)
    path = Path(text).expanduser()
    if path.exists():
        resolved = str(path.resolve())
        text = f"{path.resolve().name}-{hashlib.sha256(resolved.encode()).hexdigest()[:8]}"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", text.replace("/", "--")).strip("-.") or "model"
    return cache / "state" / slug


def resolve_auto(host: PluginHost) -> str:
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


def run(args: argparse.Namespace) -> int:
    from ..config import flags_from_args, resolve_settings
    from .generate_cmd import make_host

    check_server_dependencies()  # a plain `pip install omnicore` lacks them: one line saying what to install
    settings = resolve_settings(flags_from_args(args, "global", "engine", "server"))
    host = make_host(settings)
    host.select_platform()  # an unknown or unavailable --platform fails here: one line, nothing loaded, nothing bound
    models = list(args.model) if isinstance(args.model, (list, tuple)) else [args.model]
    if len(models) > 1 or settings.models_file:  # several models in one server: cli/serve_pool.py
        from .serve_pool import prepare_pool

        names, make_pool = prepare_pool(args, models, host, settings)
        if not settings.state_dir:  # one default directory per set of models
            settings = settings.evolve(state_dir=str(default_state_dir(settings.cache_path, "+".join(names))))
        return serve(args, model=", ".join(names), host=host, settings=settings,
                     make_engine=lambda: make_pool(settings))
    if not models:
        print("error: serve needs a model (or several, or --models models.toml); `omnicore models` lists them",
              file=sys.stderr)
        return 2
    model = models[0]
    if model == "auto":
        try:
            model = resolve_auto(host)
        except NoModelPlugin as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"serve auto: using {model}", file=sys.stderr)
    if not settings.state_dir:  # one default directory per model, so one model's server never lists another's jobs
        settings = settings.evolve(state_dir=str(default_state_dir(settings.cache_path, model)))
    return serve(args, model=model, host=host, settings=settings)


def serve(args: argparse.Namespace, *, model: str, host: PluginHost, settings: Settings,
          make_engine: Callable[[], Engine | ModelPool] | None = None) -> int:
    """Serve ``model``; ``make_engine`` (several models: it builds the model pool, which checked its models
    already) replaces the one-model engine and its checks."""
    import logging

    from ..server.app import create_app
    from ..server.http_edge import uvicorn_config
    from ..server.settings import server_settings_from

    ss = server_settings_from(settings)
    log = logging.getLogger("omnicore.server")
    if ss.host not in ("127.0.0.1", "localhost", "::1") and not ss.api_keys:
        log.warning("binding %s without an API key: anyone who can reach this address can use the server", ss.host)

    from ..engine.model_options import resolve_model_options
    from .checks import resolve_before_load
    from .examples import example_commands
    from .generate_cmd import engine_kwargs

    preset: PresetSpec | None = None
    kwargs: dict[str, Any] = {}
    if make_engine is None:
        kwargs = engine_kwargs(args, model=model)  # a malformed --model-option fails before the listener starts
        spec, preset = resolve_before_load(model, host)  # a model that names nothing fails here: one line, exit 2
        if spec is not None:
            resolve_model_options(spec, kwargs["model_options"])  # unknown names / bad values, before listening
        from .lora_args import serve_lora_kwargs

        kwargs.update(serve_lora_kwargs(settings, spec))  # --lora-modules / --lora-dir paths, before listening
    check_step_checkpoints(settings, spec if make_engine is None else None, several=make_engine is not None,
                           parallel=kwargs.get("parallel"))
    check_port_free(ss.host, ss.port)  # a busy port: one line, exit 2, before anything is printed or loaded
    failures: list[BaseException] = []

    def loader() -> Engine | ModelPool:
        try:
            if make_engine is not None:
                return make_engine()
            from ..engine.api import Engine  # torch: imported in the load thread, after every cheap check

            return Engine(model, host=host, settings=settings, **kwargs)
        except BaseException as exc:
            failures.append(exc)
            raise

    app = create_app(settings=ss, loader=loader, model_arg=model)
    ctx = app.state.ctx
    if not getattr(args, "verbose", False):  # the reason is printed below in one line; -v keeps the traceback
        logging.getLogger("omnicore.server").addFilter(_QuietLoadFailure())
    config = uvicorn_config(app, host=ss.host, port=ss.port, read_timeout_s=ss.read_timeout_s,
                            shutdown_grace_s=ss.shutdown_grace_s)  # header timeout, quiet /health polls
    server: Any = None
    lock = threading.Lock()
    shown: dict[str, Any] = {"bound": "", "ready": False, "failed": False}

    def say_ready() -> None:  # under lock, once both the socket is bound and the model is loaded
        if shown["bound"] and ctx.readiness.state == "ok" and not shown["ready"]:
            shown["ready"] = True
            base = shown["bound"]
            examples = example_commands(base, bool(ss.api_keys), ctx.served, ss.state_dir,
                                        modes=getattr(preset, "modes", None))
            print(f"omnicore: serving {ctx.served.id} ({model}) at {base}; state in {ss.state_dir}\n"
                  f"try:\n  {examples}", file=sys.stderr, flush=True)

    def on_bound(port: int) -> None:
        with lock:
            shown["bound"] = f"http://{ss.host if ':' not in ss.host else f'[{ss.host}]'}:{port}"
            print(f"omnicore: listening on {shown['bound']}; loading {model} (GET {shown['bound']}/health says "
                  "when it is ready)", file=sys.stderr, flush=True)
            say_ready()

    def announce(state: str) -> None:
        """Printed from the readiness change itself, so a shutdown right after readiness cannot swallow it."""
        with lock:
            if state == "ok":
                say_ready()
            elif state == "unhealthy" and not shown["ready"] and not shown["failed"]:
                shown["failed"] = True  # the model could not load: nothing to serve, so the server ends (exit 2)
                exc = failures[0] if failures else None
                if exc is None:
                    reason = str(ctx.readiness.error)
                elif isinstance(exc, OmnicoreError):
                    reason = str(exc)
                else:  # not one of ours: a plugin or library bug is likelier, so say where the traceback is
                    hint = "" if getattr(args, "verbose", False) else " (-v shows the traceback)"
                    reason = f"{type(exc).__name__}: {exc}{hint}"
                print(f"error: cannot load {model}: {reason}", file=sys.stderr, flush=True)
                server.should_exit = True
            elif state == "unhealthy":
                print(f"omnicore: {model} is unhealthy: {ctx.readiness.error}", file=sys.stderr, flush=True)

    ctx.readiness.on_change(announce)
    server = _announcing_server(config, ctx, on_bound)
    signals: list[int] = []
    with _signals_end_cleanly(signals):  # uvicorn re-raises the signal it drained on: it lands here, exit 0
        try:
            server.run()
        except SystemExit as exc:  # uvicorn's own exit, e.g. the port was taken between our check and its bind
            if not shown["failed"]:
                print(f"error: the server could not start on {ss.host}:{ss.port} (uvicorn exit {exc.code})",
                      file=sys.stderr, flush=True)
            return 2
    if shown["failed"]:
        return 2
    return 0 if signals or ctx.readiness.state != "unhealthy" else 1


def _announcing_server(config: uvicorn.Config, ctx: ServerContext, on_bound: Callable[[int], None]) -> DrainingServer:
    """The server's ``DrainingServer`` that says "listening" only once its socket is bound (a busy port must not
    print it first), with the port the OS gave (``--port 0``). Built here: uvicorn is imported only by ``serve``."""
    from ..server.lifecycle import DrainingServer

    class AnnouncingServer(DrainingServer):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started and not self.should_exit:
                socks = self.servers[0].sockets if self.servers else ()
                on_bound(socks[0].getsockname()[1] if socks else 0)

    return AnnouncingServer(config, ctx)


class _QuietLoadFailure(logging.Filter):
    """Drop the server's traceback of a model that failed to load: ``serve`` prints the reason in one line and
    exits (``-v`` keeps the traceback, which that line points to when the error was not omnicore's own)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "loading the model failed"


@contextlib.contextmanager
def _signals_end_cleanly(received: list[int]) -> Iterator[None]:
    """SIGINT/SIGTERM handlers that only record: uvicorn installs its own while it runs (drain, then stop) and
    re-raises the signal afterwards, which must then end ``serve`` with exit 0, not ``Terminated``/130."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda s, _f: received.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
