"""Optional bearer-token authentication (serving-api.md §3): constant-time comparison, keys never logged."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from .errors import ApiError

OPEN_PATHS = ("/health", "/health/live", "/metrics")


class BearerAuth:
    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = tuple(k.encode() for k in keys if k)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def protects(self, path: str) -> bool:
        return self.enabled and path not in OPEN_PATHS and (path == "/v1" or path.startswith("/v1/"))

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
