"""``create_app``: the FastAPI application around one engine.

The app is a thin edge: routes validate DTOs, translate them to ``GenerationRequest`` and hand them to the
:class:`~.jobs.JobManager`; no model logic lives here and no GPU work runs on the event loop. Tests inject
any engine (``create_app(engine, settings)``); ``omnicore serve`` passes a ``loader`` instead, so the
listener is up (``/health`` = ``loading``) while the model loads.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio
import attrs
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..ids import new_id
from .auth import BearerAuth
from .errors import ApiError, install_handlers
from .jobs import JobManager, LiveJob
from .lifecycle import Readiness
from .metrics import Metrics
from .settings import ServerSettings
from .sse import EventHub
from .store import JobStore
from .translate import ServedModel

if TYPE_CHECKING:
    from ..engine.api import Engine
    from ..pool.pool import ModelPool
    from .replica import Claimer

logger = logging.getLogger("omnicore.server")


@attrs.define(eq=False)
class ServerContext:
    """Everything routes need, hung on ``app.state.ctx``."""

    settings: ServerSettings
    store: JobStore
    metrics: Metrics
    hub: EventHub
    readiness: Readiness
    auth: BearerAuth
    engine: Engine | ModelPool | None = None
    jobs: JobManager | None = None
    served: ServedModel | None = None
    model_arg: str | None = None
    started_at: float = attrs.Factory(time.time)
    claimer: Claimer | None = None  # with a shared store: this replica's Claimer (server/replica.py)
    pool: ModelPool | None = None  # the ModelPool when the server serves several models (server/models.py)
    models: dict[str, ServedModel] = attrs.Factory(dict)  # with a pool: name -> served model

    def require(self) -> tuple[JobManager, ServedModel]:
        """The job manager and model, or 503 while the server is not ready."""
        self.readiness.require_ready()
        assert self.jobs is not None and self.served is not None
        return self.jobs, self.served

    def served_for(self, model: str | None) -> ServedModel:
        """The served model a request's ``model`` routes to (one-model server: its model, checked later)."""
        if self.pool is None:
            assert self.served is not None
            return self.served
        from .models import route

        return route(self.models, model)

    def model_key(self, served: ServedModel) -> str | None:
        """What the job manager passes the engine as ``model=`` (``None`` for a one-model server)."""
        return served.id if self.pool is not None else None

    def attach(self, engine: Engine | ModelPool) -> None:
        """Adopt a loaded engine (or model pool): recover the store (restart table), re-enqueue queued jobs,
        become ready."""
        self.engine = engine
        from ..pool.pool import ModelPool

        if isinstance(engine, ModelPool):
            from .models import install_metrics, served_models

            self.pool = engine
            self.models = served_models(engine, int(time.time()))
            self.served = next(iter(self.models.values()))
            install_metrics(self.metrics, engine)
        else:
            self.served = ServedModel.from_spec(engine.spec, self.model_arg, created=int(time.time()),
                                                model_options=getattr(engine, "model_options", None))
        self.jobs = JobManager(engine, self.store, self.settings, self.metrics, self.hub,
                               on_worker_died=self._worker_died)
        names = tuple(n for m in self.models.values() for n in m.names) if self.pool is not None else self.served.names
        requeue = self.store.recover(names)
        self.store.expire(self.settings.job_ttl_s)
        self.metrics.on_scrape(self._refresh_gauges)
        for record in getattr(getattr(engine, "host", None), "records", {}).values():
            self.metrics.plugins.labels(plugin=record.name, status=str(record.status)).set(1)
        self.readiness.set("ok")
        self.metrics.ready.set(1)
        for job_id in requeue:
            self._requeue(job_id)
        if getattr(self.store, "shared", False):  # replicas sharing one store pull their work (server/replica.py)
            from .replica import Claimer
            from .routes_videos import rebuild_request

            self.claimer = Claimer(self, tuple(requeue_names(self)), rebuild_request)
            self.jobs.on_released = self.claimer.released
            self.claimer.start()

    def begin_drain(self) -> None:
        """Shutdown step one (SIGTERM): ``/health`` says ``draining``, new work gets 503, queued jobs are held."""
        self.readiness.set("draining")
        self.metrics.ready.set(0)
        if self.jobs is not None:
            self.jobs.begin_drain()

    def _worker_died(self, reason: str) -> None:
        self.readiness.set("unhealthy", error=reason)
        self.metrics.ready.set(0)

    def _requeue(self, job_id: str) -> None:
        from .routes_videos import rebuild_request

        assert self.jobs is not None
        record = self.store.get(job_id) or {}
        try:
            served = self.served_for(record.get("model")) if self.pool is not None else None
            request = rebuild_request(self, job_id, served)
            live = LiveJob(id=job_id, kind="video", task="video.generate", persisted=True,
                           deadline_s=(self.store.get_request(job_id) or {}).get("body", {}).get("timeout_s"),
                           owner=self.store.get_owner(job_id)[1],
                           model=self.model_key(served) if served is not None else None)
            live.created = float(record.get("created_at") or time.time())
            self.jobs.submit(live, request)
        except Exception as exc:
            err = exc if isinstance(exc, ApiError) else None
            self.store.update(job_id, status="failed", updated_at=int(time.time()), queue_position=None,
                              error={"code": "requeue_failed",
                                     "message": f"could not re-enqueue after restart: "
                                                f"{err.message if err else f'{type(exc).__name__}: {exc}'}"})

    def _refresh_gauges(self) -> None:
        if self.engine is None:
            return
        stats = self.engine.stats()
        self.metrics.queue_depth.set(stats.get("queued", 0))
        self.metrics.running.set(stats.get("running", 0))
        for rank, memory in enumerate(getattr(self.engine, "load_memory", None) or ()):
            if memory is not None and memory.peak_rss_bytes is not None:
                self.metrics.load_peak_rss.labels(rank=str(rank)).set(memory.peak_rss_bytes)


def requeue_names(ctx: ServerContext) -> tuple[str, ...]:
    """Every name the models this server serves answer to (the ``model`` of the jobs it may run)."""
    models = getattr(ctx, "models", None) or {}
    if getattr(ctx, "pool", None) is not None and models:
        return tuple(n for m in models.values() for n in m.names)
    assert ctx.served is not None
    return tuple(ctx.served.names)


class EdgeMiddleware:
    """Pure ASGI (cheap, streaming-safe): request ids, body-size limits, authentication, HTTP metrics."""

    def __init__(self, app: ASGIApp, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        request_id = headers.get("x-request-id") or new_id("req")
        scope.setdefault("state", {})["request_id"] = request_id
        status_holder = [500]
        rid = request_id.encode("latin-1", "replace")

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_holder[0] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid)]
            await send(message)

        try:
            err = self._precheck(scope, headers)
            if err is not None:
                await self._send_error(err, scope, receive, send_wrapper)
                return
            limit = self.ctx.settings.max_request_bytes
            read_timeout = float(getattr(self.ctx.settings, "read_timeout_s", 0.0) or 0.0)
            body_timeout = float(getattr(self.ctx.settings, "body_timeout_s", 0.0) or 0.0)
            body_end = time.monotonic() + body_timeout  # the whole body, counted from the request's start
            seen = [0]
            body_done = [False]

            async def limited_receive() -> Message:
                wait = read_timeout if read_timeout > 0 else math.inf
                whole = body_end - time.monotonic() if body_timeout > 0 else math.inf
                if body_done[0] or math.isinf(min(wait, whole)):
                    message = await receive()
                else:  # a client that stops sending its body, or trickles it byte by byte, must not hold us
                    with anyio.move_on_after(max(0.0, min(wait, whole))) as scope_:
                        message = await receive()
                    if scope_.cancelled_caught:
                        if whole <= wait:
                            raise ApiError(408, "request_timeout", f"the request body did not arrive within "
                                                                   f"{body_timeout:g} s (--body-timeout)")
                        raise ApiError(408, "request_timeout", f"the client sent no body data for {read_timeout:g} s "
                                                               "(the body is shorter than its Content-Length?)")
                if message["type"] == "http.request":
                    seen[0] += len(message.get("body", b""))
                    if not message.get("more_body", False):
                        body_done[0] = True
                    if seen[0] > limit:
                        raise ApiError(413, "request_too_large",
                                       f"the request body is larger than the limit of {limit} bytes")
                else:
                    body_done[0] = True
                return message

            await self.app(scope, limited_receive, send_wrapper)
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            self.ctx.metrics.http_requests.labels(route=label, status=str(status_holder[0])).inc()
            self.ctx.metrics.http_duration.labels(route=label).observe(time.perf_counter() - t0)

    def _precheck(self, scope: Scope, headers: dict[str, str]) -> ApiError | None:
        length = headers.get("content-length")
        if length is not None:
            try:
                if int(length) > self.ctx.settings.max_request_bytes:
                    return ApiError(413, "request_too_large", f"the request body ({length} bytes) is larger than "
                                                              f"the limit of {self.ctx.settings.max_request_bytes}")
            except ValueError:
                return ApiError(400, "invalid_value", "invalid Content-Length header")
        if self.ctx.auth.protects(scope["path"]):
            try:
                scope["state"]["principal"] = self.ctx.auth.check(headers.get("authorization"))
            except ApiError as exc:
                return exc
        return None

    @staticmethod
    async def _send_error(err: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
        from fastapi.responses import JSONResponse

        headers = dict(err.headers or {})
        if err.status_code == 401:
            headers.setdefault("WWW-Authenticate", "Bearer")
        await JSONResponse(err.body(), status_code=err.status_code, headers=headers)(scope, receive, send)


def create_app(engine: Engine | ModelPool | None = None, settings: ServerSettings | None = None,
               store: JobStore | None = None, *,
               loader: Callable[[], Engine | ModelPool] | None = None, owns_engine: bool = True,
               model_arg: str | None = None) -> FastAPI:
    """Build the app around ``engine`` (already loaded) or ``loader`` (called in a thread at startup).

    On shutdown the app drains: it stops admitting, lets running work finish within ``shutdown_grace_s``
    (then stops it), closes the engine when ``owns_engine``, and flushes the store.
    """
    if (engine is None) == (loader is None):
        raise ValueError("create_app needs exactly one of engine= or loader=")
    if settings is None:
        raise ValueError("create_app needs settings= (a ServerSettings)")
    if store is None:
        from ..jobstore import open_store

        store = open_store(settings.store, settings.state_dir, settings.storage_url)
    auth = BearerAuth(settings.api_keys, admin_keys=settings.admin_api_keys,
                      metrics_auth=getattr(settings, "metrics_auth", False), secret=store.secret)
    ctx = ServerContext(settings=settings, store=store, metrics=Metrics(), hub=EventHub(),
                        readiness=Readiness("loading"), auth=auth, model_arg=model_arg)

    def load() -> None:
        try:
            assert loader is not None  # create_app checked: exactly one of engine= / loader=
            ctx.attach(loader())
        except BaseException as exc:  # startup failure is reported on /health, not by crashing the listener
            logger.exception("loading the model failed")
            ctx.readiness.set("unhealthy", error=f"{type(exc).__name__}: {exc}")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if engine is not None:
            ctx.attach(engine)
        else:
            threading.Thread(target=load, name="omnicore-load", daemon=True).start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(_shutdown, ctx, owns_engine)

    app = FastAPI(title="omnicore", version="1", lifespan=lifespan,
                  description="OpenAI-style image and video generation.")
    app.state.ctx = ctx
    install_handlers(app)
    from . import routes_images, routes_system, routes_videos

    app.include_router(routes_system.router)
    app.include_router(routes_images.router)
    app.include_router(routes_videos.router)
    from . import routes_ui

    routes_ui.install(app, ctx)  # the browser playground at / (unless --no-ui)
    from . import lora_http

    lora_http.install(ctx)  # adapters in /v1/models, the adapter registry's stats in /metrics
    if settings.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(EdgeMiddleware, ctx=ctx)
    return app


def _shutdown(ctx: ServerContext, owns_engine: bool) -> None:
    """Graceful shutdown: drain, let running work finish within the grace, stop the rest, flush the store."""
    ctx.begin_drain()
    try:
        if ctx.jobs is not None:
            ctx.jobs.shutdown(ctx.settings.shutdown_grace_s)
        if owns_engine and ctx.engine is not None:
            ctx.engine.close(cancel_running=True, timeout=max(1.0, ctx.settings.cancel_wait_s))
        if ctx.jobs is not None:
            ctx.jobs.stop()
    finally:
        if ctx.claimer is not None:
            ctx.claimer.stop()
        ctx.store.close()
