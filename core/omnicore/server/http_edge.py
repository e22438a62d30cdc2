"""What the server needs from the HTTP layer below FastAPI: read timeouts, lenient ``Range``, quiet health logs.

- :class:`TimedH11Protocol` closes a connection whose request headers do not arrive within ``read_timeout_s``
  (uvicorn has no header timeout of its own; a client that opens a connection and sends half a request
  would hold it forever). Body pauses are limited in the ASGI edge (``app.EdgeMiddleware``), which can
  still answer 408.
- :class:`RangeFileResponse` serves the whole file (200) for a ``Range`` header it cannot parse, as
  RFC 9110 §14.2 says a server should, instead of Starlette's 400.
- :class:`HealthLogFilter` drops uvicorn's access-log lines for ``/health`` polls (orchestrators poll it
  every few seconds); every other request is still logged.
- :func:`uvicorn_config` builds the one ``uvicorn.Config`` used by ``omnicore serve`` and the tests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from urllib.parse import unquote_plus

import h11
import uvicorn
from fastapi.responses import FileResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

_RANGE_SPEC = re.compile(r"^\s*(\d+-\d*|-\d+)\s*$")
QUIET_PATHS = ("/health", "/health/live")


def valid_range(value: str) -> bool:
    """Whether ``value`` is a syntactically valid ``bytes=`` range set (each ``a-b`` with ``a <= b``)."""
    unit, sep, specs = value.partition("=")
    if unit.strip().lower() != "bytes" or not sep or not specs.strip():
        return False
    for spec in specs.split(","):
        if not _RANGE_SPEC.match(spec):
            return False
        first, _, last = spec.strip().partition("-")
        if first and last and int(first) > int(last):
            return False
    return True


class RangeFileResponse(FileResponse):
    """``FileResponse`` that ignores an invalid ``Range`` header (full 200) instead of answering 400."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(k, v) for k, v in scope.get("headers", ())
                   if k.lower() != b"range" or valid_range(v.decode("latin-1"))]
        await super().__call__({**scope, "headers": headers}, receive, send)


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for request headers (``header_timeout_s``, class attribute)."""

    header_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # as uvicorn's
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self.header_timeout_s > 0:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        in_request = self.cycle is not None and not self.cycle.response_complete
        if not in_request and not self.transport.is_closing():  # headers never completed (or an idle socket)
            self.logger.info("closing a connection that sent no complete request headers in %.0f s",
                             self.header_timeout_s)
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._header_timer is not None:
            self._header_timer.cancel()
        if not self.transport.is_closing():
            self._arm_header_timer()  # the next request on this keep-alive connection gets the same deadline

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a bad ``Content-Length``, a malformed header line) gets the API's JSON
        error shape instead of uvicorn's plain-text "Invalid HTTP request received." (then the connection closes,
        as uvicorn does: the stream cannot be trusted past the bad request)."""
        body = json.dumps({"error": {
            "message": "malformed HTTP request (for example an invalid Content-Length or header line); "
                       "the connection is closed", "type": "invalid_request_error", "param": None,
            "code": "malformed_request"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # a response had already begun on this connection: just close it
            pass
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


#: Query parameter names whose values are credentials (matched as substrings, case-insensitively).
_SECRET_PARAM = re.compile(r"key|token|secret|passw|auth|sig|credential|session", re.IGNORECASE)


def redact_query(target: str) -> str:
    """``target`` (path and query) with the values of credential-like parameters (``api_key``, ``token``,
    ``authorization``, ...) replaced by ``REDACTED``: a key sent in the URL must never reach a log."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    parts = []
    for item in query.split("&"):
        name, eq, _ = item.partition("=")
        parts.append(f"{name}=REDACTED" if eq and _SECRET_PARAM.search(unquote_plus(name)) else item)
    return f"{path}?{'&'.join(parts)}"


class HealthLogFilter(logging.Filter):
    """Drop uvicorn access-log records of ``/health`` polls, and redact credentials in the logged query string."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3:
            path = str(args[2]).split("?", 1)[0]
            if path in QUIET_PATHS:
                return False
            redacted = redact_query(str(args[2]))
            if redacted != args[2]:
                record.args = (*args[:2], redacted, *args[3:])
        return True


def uvicorn_config(app: ASGIApp, *, host: str, port: int, read_timeout_s: float, log_level: str = "info",
                   shutdown_grace_s: float = 60.0) -> uvicorn.Config:
    """The server's uvicorn configuration: header read timeout, quiet health polls, graceful shutdown."""
    protocol = type("OmnicoreH11Protocol", (TimedH11Protocol,), {"header_timeout_s": float(read_timeout_s)})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on", http=protocol,
                            timeout_graceful_shutdown=int(shutdown_grace_s) + 5)  # (configures logging)
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, HealthLogFilter) for f in access.filters):
        access.addFilter(HealthLogFilter())
    return config
