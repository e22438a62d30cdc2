"""The one place that maps failures to HTTP: :class:`ApiError` and the exception handlers.

Every error leaves the server in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``,
including framework failures: unknown routes, wrong methods and pydantic validation errors (reported as 400, never
422). ``omnicore.errors`` classes raised by the engine are translated here and nowhere else.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import errors as core_errors

if TYPE_CHECKING:
    from pydantic import ValidationError

logger = logging.getLogger("omnicore.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    504: "server_error",
    503: "service_unavailable_error",
    507: "server_error",
}

# Engine field names (``params.height``) -> the HTTP field a client actually sent.
_FIELD_TO_PARAM = {
    "params.height": "size",
    "params.width": "size",
    "params.num_outputs": "n",
    "params.num_inference_steps": "num_inference_steps",
    "params.guidance_scale": "guidance_scale",
    "params.flow_shift": "flow_shift",
    "params.seed": "seed",
    "params.num_frames": "num_frames",
    "params.fps": "fps",
    "params.duration": "seconds",
    "images": "image",
    "negative_prompt": "negative_prompt",
    "prompt": "prompt",
    "loras": "lora",
}


class ApiError(StarletteHTTPException):
    """An HTTP error in the contract's shape.

    It subclasses Starlette's ``HTTPException`` so that it also passes unchanged through FastAPI's body
    reading (which turns any other exception raised while streaming the body into a generic 400).
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(status_code=status, detail=message, headers=dict(headers or {}))
        self.code = code
        self.message = message
        self.param = param

    @property
    def type(self) -> str:
        return _TYPES.get(self.status_code, "invalid_request_error" if self.status_code < 500 else "server_error")

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def http_param(field: str, aliases: Mapping[str, str] | None = None) -> str:
    """The HTTP name of an engine field (``extra.x`` becomes ``model_params.x``)."""
    if aliases and field in aliases:
        return aliases[field]
    if field in _FIELD_TO_PARAM:
        return _FIELD_TO_PARAM[field]
    if field.startswith("extra."):
        return "model_params." + field[len("extra."):]
    if field == "extra":
        return "model_params"
    if field.startswith("params."):
        return field[len("params."):]
    return field


def from_core(exc: BaseException, *, retry_after_s: float = 1.0,
              aliases: Mapping[str, str] | None = None) -> ApiError:
    """Translate an ``omnicore.errors`` exception (or anything else) into an :class:`ApiError`."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, core_errors.InvalidRequest):
        param = None if exc.field == "params" else http_param(exc.field, aliases)  # "params": the whole job
        return ApiError(400, getattr(exc, "code", None) or "invalid_value",
                        f"{param}: {exc.rule}" if param else exc.rule, param=param)
    if isinstance(exc, core_errors.QueueFull):
        return ApiError(429, "queue_full", str(exc), headers={"Retry-After": str(max(1, round(retry_after_s)))})
    if isinstance(exc, core_errors.EngineClosed):
        return ApiError(503, "draining", f"the server is shutting down: {exc}", headers={"Retry-After": "5"})
    if isinstance(exc, core_errors.UnsupportedFeature):
        return ApiError(400, "unsupported_for_model", str(exc), param=getattr(exc, "feature", None))
    if isinstance(exc, core_errors.UnknownName):
        return ApiError(404, "model_not_found", str(exc), param="model")
    if isinstance(exc, core_errors.Cancelled):
        return ApiError(409, "job_cancelled", str(exc))
    if isinstance(exc, core_errors.ModelUnavailable):  # one model of several failed to load or cannot fit
        return ApiError(503, "model_unavailable", str(exc), param="model", headers={"Retry-After": "30"})
    # a plugin's failure (in preprocess, say): its text is what a client can report; the handler adds the
    # request id and logs the traceback (the ApiError is raised from the exception)
    return ApiError(500, "internal_error", f"internal error ({type(exc).__name__}: {exc})")


def is_storage_full(exc: BaseException | None) -> bool:
    """A write that failed because the state directory's disk (or quota) is full: ``OSError`` ENOSPC/EDQUOT, or
    SQLite's ``database or disk is full`` (SQLITE_FULL), also when either is the cause of another error."""
    import errno
    import sqlite3

    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(exc, sqlite3.Error) and ("disk is full" in str(exc).lower()
                                               or getattr(exc, "sqlite_errorcode", None) == 13):  # SQLITE_FULL
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def storage_full_error(exc: BaseException) -> ApiError:
    """507 ``storage_full``: the job was not accepted because the server could not store it."""
    return ApiError(507, "storage_full", f"the server's storage is full; the job was not stored or started "
                                         f"({type(exc).__name__}: {exc}); retry later",
                    headers={"Retry-After": "30"})


_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate")


def is_out_of_memory(exc: BaseException | None) -> bool:
    """A device or host allocation failure: ``torch.OutOfMemoryError``, ``MemoryError``, or the CPU allocator's
    ``RuntimeError: ... DefaultCPUAllocator: can't allocate memory``."""
    if exc is None:
        return False
    if isinstance(exc, MemoryError) or "outofmemory" in type(exc).__name__.lower():
        return True
    text = str(exc).lower()
    return any(t in text for t in _OOM_TEXT)


def job_error_code(exc: BaseException | None) -> str:
    """The ``error.code`` recorded on a job that failed after it was accepted."""
    if exc is None:
        return "internal_error"
    if isinstance(exc, core_errors.Cancelled):
        return "cancelled"
    if isinstance(exc, core_errors.ModelUnavailable):
        return "model_unavailable"
    if is_out_of_memory(exc):
        return "out_of_memory"
    if isinstance(exc, core_errors.InvalidRequest):
        return "invalid_value"
    return "internal_error"


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or "-"


def _validation_to_api(exc: RequestValidationError) -> ApiError:
    errs = exc.errors()
    if not errs:
        return ApiError(400, "invalid_value", "invalid request")
    first = errs[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header", "form")]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "missing":
        return ApiError(400, "missing_required_parameter", f"missing required parameter: {param}", param=param)
    if kind == "extra_forbidden":
        return ApiError(400, "unknown_parameter", f"unknown parameter: {param}", param=param)
    if kind == "json_invalid":
        return ApiError(400, "invalid_value", "the body is not valid JSON", param=None)
    msg = first.get("msg", "invalid value")
    return ApiError(400, "invalid_value", f"{param or 'body'}: {msg}", param=param)


def pydantic_to_api(exc: ValidationError) -> ApiError:
    """A ``pydantic.ValidationError`` raised by our own parsing (multipart bodies) as a 400."""
    return _validation_to_api(RequestValidationError(exc.errors(include_url=False)))


def _allowed_methods(request: Request) -> list[str]:
    """The methods of every route whose path matches (routers included without a prefix are walked)."""
    methods: set[str] = set()
    pending = list(request.app.routes)
    while pending:
        route = pending.pop()
        inner = getattr(route, "original_router", None)
        if inner is not None:
            pending.extend(inner.routes)
            continue
        regex, route_methods = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if regex is not None and route_methods and regex.match(request.url.path):
            methods |= set(route_methods)
    return sorted(methods)


def install_handlers(app: FastAPI) -> None:
    """Register handlers so no error escapes in another shape."""

    def respond(request: Request, err: ApiError) -> JSONResponse:
        headers = dict(err.headers or {})
        if err.status_code == 401:
            headers.setdefault("WWW-Authenticate", "Bearer")
        return JSONResponse(err.body(), status_code=err.status_code, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, ApiError):
            if exc.code == "internal_error" and "request id" not in exc.message:
                rid = _request_id(request)
                logger.error("request %s failed: %s", rid, exc.message, exc_info=exc.__cause__ or exc)
                exc = ApiError(exc.status_code, exc.code, f"{exc.message}; request id {rid}", param=exc.param,
                               headers=exc.headers)
            return respond(request, exc)
        if exc.status_code == 404:
            err = ApiError(404, "route_not_found", f"no route {request.method} {request.url.path}")
        elif exc.status_code == 405:
            allowed = _allowed_methods(request)  # every route on this path, not only the first one matched
            err = ApiError(405, "method_not_allowed", f"{request.method} is not allowed on {request.url.path}"
                           + (f"; allowed: {', '.join(allowed)}" if allowed else ""),
                           headers={"Allow": ", ".join(allowed)} if allowed else exc.headers)
        elif exc.status_code == 400:
            err = ApiError(400, "invalid_value", str(exc.detail))
        else:
            err = ApiError(exc.status_code, "http_error", str(exc.detail), headers=exc.headers)
        return respond(request, err)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, _validation_to_api(exc))

    @app.exception_handler(core_errors.OmnicoreError)
    async def _core(request: Request, exc: core_errors.OmnicoreError) -> JSONResponse:
        err = from_core(exc)
        if err.status_code >= 500:
            logger.exception("request %s failed", _request_id(request), exc_info=exc)
            err = ApiError(500, "internal_error", f"internal error; request id {_request_id(request)}")
        return respond(request, err)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("request %s failed with a bug", _request_id(request), exc_info=exc)
        err = ApiError(500, "internal_error", f"internal error; request id {_request_id(request)}")
        resp = respond(request, err)
        resp.headers["X-Request-Id"] = _request_id(request)
        return resp
