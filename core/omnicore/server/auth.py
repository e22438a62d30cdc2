"""Optional bearer-token authentication: constant-time comparison, keys never logged.

With keys set, each request is made by a :class:`Principal`: the *key id* of the key it sent (a keyed hash
prefix, so the store, the metrics and the logs never hold the key itself) and whether it is an admin key
(``--admin-api-key``). Video jobs belong to the key id that created them; another key gets 404 for them, an
admin key sees all (``routes_videos``). Without keys there is no isolation: every caller sees every job.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

import attrs

from .errors import ApiError

#: The only routes open without a key when keys are set; everything else, including ``/docs``,
#: ``/openapi.json`` and any route added later, requires one. ``/metrics`` joins them unless ``metrics_auth``.
OPEN_PATHS = ("/health", "/health/live")


@attrs.frozen
class Principal:
    """Who made a request: ``key_id`` (never the key) and whether the key is an admin key."""

    key_id: str
    admin: bool = False

    def may_see(self, owner: str | None) -> bool:
        """Whether a job owned by ``owner`` is visible: its own jobs; every job (ownerless ones too) for admins."""
        return self.admin or (owner is not None and hmac.compare_digest(owner, self.key_id))


def key_id(secret: bytes, key: str) -> str:
    """The stable, non-reversible id of ``key``: HMAC-SHA256 under the state directory's secret, 16 hex digits.

    Keyed (not a plain hash) so that a leaked job database or metrics scrape cannot be used to test guesses of a
    key without the secret, which stays in the state directory."""
    return hmac.new(secret, key.encode(), hashlib.sha256).hexdigest()[:16]


class BearerAuth:
    def __init__(self, keys: Sequence[str], *, admin_keys: Sequence[str] = (), metrics_auth: bool = False,
                 secret: bytes = b"") -> None:
        admin = tuple(dict.fromkeys(k for k in admin_keys if k))
        user = tuple(k for k in dict.fromkeys(k for k in keys if k) if k not in admin)
        # (key bytes, principal): ids computed once; the keys themselves stay only in this list
        self._keys = tuple((k.encode(), Principal(key_id(secret, k), admin=False)) for k in user) + tuple(
            (k.encode(), Principal(key_id(secret, k), admin=True)) for k in admin)
        self.open_paths = OPEN_PATHS if metrics_auth else (*OPEN_PATHS, "/metrics")

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def protects(self, path: str) -> bool:
        """Deny by default: with keys set, every path but the explicit allow-list needs a key."""
        return self.enabled and path.rstrip("/") not in self.open_paths

    def identify(self, authorization: str | None) -> Principal | None:
        """The principal of a valid ``Bearer <key>`` header, else ``None`` (constant time over all keys)."""
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        found: Principal | None = None
        for key, principal in self._keys:  # compare against every key so timing does not reveal which one matched
            if hmac.compare_digest(given, key) and found is None:
                found = principal
        return found if scheme.lower() == "bearer" else None

    def check(self, authorization: str | None) -> Principal:
        """The caller's principal; 401 ``invalid_api_key`` unless ``authorization`` is ``Bearer <one of the keys>``."""
        principal = self.identify(authorization)
        if principal is None:
            raise ApiError(401, "invalid_api_key", "missing or invalid API key; send 'Authorization: Bearer <key>'",
                           headers={"WWW-Authenticate": "Bearer"})
        return principal
