"""Optional bearer-token authentication (serving-api.md §3): constant-time comparison, keys never logged."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from .errors import ApiError

#: The only routes open without a key when keys are set (§3); everything else, including ``/docs``,
#: ``/openapi.json`` and any route added later, requires one. ``/metrics`` joins them unless ``metrics_auth``.
OPEN_PATHS = ("/health", "/health/live")


class BearerAuth:
    def __init__(self, keys: Sequence[str], *, metrics_auth: bool = False) -> None:
        self._keys = tuple(k.encode() for k in keys if k)
        self.open_paths = OPEN_PATHS if metrics_auth else (*OPEN_PATHS, "/metrics")

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def protects(self, path: str) -> bool:
        """Deny by default: with keys set, every path but the explicit allow-list needs a key."""
        return self.enabled and path.rstrip("/") not in self.open_paths

    def check(self, authorization: str | None) -> None:
        """Raise 401 ``invalid_api_key`` unless ``authorization`` is ``Bearer <one of the keys>``."""
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        ok = False
        for key in self._keys:  # compare against every key so timing does not reveal which one matched
            ok |= hmac.compare_digest(given, key)
        if scheme.lower() != "bearer" or not ok:
            raise ApiError(401, "invalid_api_key", "missing or invalid API key; send 'Authorization: Bearer <key>'",
                           headers={"WWW-Authenticate": "Bearer"})
