"""Readiness, liveness, Prometheus metrics and the model list."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from .errors import ApiError
from .schemas import ErrorResponse, ModelCard, ModelList

router = APIRouter()
_ERRORS: dict[int | str, dict[str, object]] = {404: {"model": ErrorResponse}}


@router.get("/health/live", tags=["system"])
async def live() -> dict[str, str]:
    return {"status": "live"}


@router.get("/health", tags=["system"])
async def health(request: Request) -> JSONResponse:
    ctx = request.app.state.ctx
    state = ctx.readiness.state
    body: dict = {"status": state}
    if state == "ok":
        stats = ctx.engine.stats()
        body.update(model=ctx.served.id, backend=getattr(ctx.engine.platform, "name", None),
                    queue_depth=stats.get("queued", 0), running=stats.get("running", 0))
        if ctx.pool is not None:  # several models: each one's state
            body["models"] = {name: status.state for name, status in ctx.pool.status().items()}
        return JSONResponse(body)
    if ctx.readiness.error:
        body["error"] = ctx.readiness.error
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


@router.get("/metrics", tags=["system"], response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text exposition format",
                             "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def metrics(request: Request) -> Response:
    data = request.app.state.ctx.metrics.render()
    return Response(data, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/usage", tags=["system"])
async def usage(request: Request) -> dict:
    """What the calling API key used since this server process started: jobs by terminal status, denoise steps
    computed, and compute seconds (running wall time on the worker). Without auth: the usage of all calls."""
    ctx = request.app.state.ctx
    ctx.readiness.require_ready()
    principal = request.scope.get("state", {}).get("principal")
    key = principal.key_id if principal is not None else None
    return {"object": "usage", "key_id": key, "since": int(ctx.started_at), **ctx.jobs.usage(key)}


@router.get("/v1/models", response_model=ModelList, tags=["models"])
async def list_models(request: Request) -> dict:
    ctx = request.app.state.ctx
    ctx.readiness.require_ready()
    if ctx.pool is not None:
        from .models import model_card

        return {"object": "list", "data": [model_card(ctx, served) for served in ctx.models.values()]}
    return {"object": "list", "data": [ctx.served.card(getattr(ctx.engine.platform, "name", None))]}


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS, tags=["models"])
async def get_model(model_id: str, request: Request) -> dict:
    ctx = request.app.state.ctx
    ctx.readiness.require_ready()
    if ctx.pool is not None:
        from .models import model_card

        return model_card(ctx, ctx.served_for(model_id))
    if model_id not in ctx.served.names:
        raise ApiError(404, "model_not_found", f"model {model_id!r} is not served here; this server serves "
                                               f"{ctx.served.id!r}", param="model")
    return ctx.served.card(getattr(ctx.engine.platform, "name", None))
