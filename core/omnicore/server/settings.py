"""Server limits and switches, resolved once into one frozen record.

Library code never reads the environment: the CLI (``omnicore serve``) builds this from flags and
``OMNICORE_*`` variables via :func:`server_settings_from`, tests construct it directly.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from ..config import Settings, options_in
from ..errors import ConfigError

#: Options the server reads (scope ``server`` in ``config.OPTIONS``); ``api_key``/``api_key_file`` become
#: :attr:`ServerSettings.api_keys`, ``admin_api_key`` :attr:`ServerSettings.admin_api_keys` (kept out of the
#: repr like the other keys), and ``state_dir`` becomes a resolved path.
_MERGED = ("api_key", "api_key_file", "admin_api_key", "state_dir")
SERVER_OPTIONS: tuple[str, ...] = tuple(opt.name for opt in options_in("server") if opt.name not in _MERGED)


class ServerSettings:
    """Everything the HTTP layer needs to know: every server option of ``config.OPTIONS`` under its own name and
    default (derived, never redeclared), plus ``state_dir`` (a path) and ``api_keys`` (flag keys and key-file
    keys merged). Read-only; construct with keyword arguments, e.g. ``ServerSettings(state_dir=p, max_work=0)``.
    """

    __slots__ = ("_values", "admin_api_keys", "api_keys", "state_dir")
    state_dir: Path
    api_keys: tuple[str, ...]
    admin_api_keys: tuple[str, ...]
    _values: dict[str, Any]

    def __init__(self, state_dir: str | Path, api_keys: Iterable[str] = (), admin_api_keys: Iterable[str] = (),
                 **values: Any) -> None:
        unknown = sorted(set(values) - set(SERVER_OPTIONS))
        if unknown:
            raise TypeError(f"ServerSettings() got an unknown setting {unknown[0]!r}; "
                            f"known: {', '.join(SERVER_OPTIONS)}")
        merged = Settings(**values).as_dict()
        if values.get("cors_origins") is not None:
            merged["cors_origins"] = tuple(values["cors_origins"])
        if not merged["heartbeat_interval_s"] > 0:
            raise ConfigError("heartbeat_interval_s", f"must be > 0 (it paces heartbeats, liveness checks and "
                                                      f"expiry), got {merged['heartbeat_interval_s']!r}")
        object.__setattr__(self, "state_dir", Path(state_dir))
        admin = tuple(dict.fromkeys(k for k in admin_api_keys if k))
        # api_keys: every key the server accepts (admin keys too, so "auth is on" is one test); admin_api_keys:
        # the subset that sees every key's jobs
        object.__setattr__(self, "api_keys", tuple(dict.fromkeys((*api_keys, *admin))))
        object.__setattr__(self, "admin_api_keys", admin)
        object.__setattr__(self, "_values", {name: merged[name] for name in SERVER_OPTIONS})

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"'ServerSettings' has no setting {name!r}") from None

    def __setattr__(self, name: str, value: object) -> None:
        raise attrs.exceptions.FrozenInstanceError()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ServerSettings) and (
            self.state_dir, self.api_keys, self.admin_api_keys, self._values) == (
            other.state_dir, other.api_keys, other.admin_api_keys, other._values)

    def __hash__(self) -> int:
        return hash((self.state_dir, self.api_keys, self.admin_api_keys, tuple(self._values.items())))

    def __repr__(self) -> str:
        return (f"ServerSettings(state_dir={str(self.state_dir)!r}, api_keys=<{len(self.api_keys)}>, "
                f"admin_api_keys=<{len(self.admin_api_keys)}>, {self._values!r})")


def server_settings_from(core: Settings) -> ServerSettings:
    """The server's view of the resolved core settings (flags and ``OMNICORE_*`` were resolved by ``config``)."""
    keys: list[str] = list(core.api_key or ())
    if core.api_key_file:
        keys.extend(line.strip() for line in Path(core.api_key_file).read_text().splitlines() if line.strip())
    return ServerSettings(state_dir=core.state_path, api_keys=tuple(dict.fromkeys(keys)),
                          admin_api_keys=tuple(dict.fromkeys(core.admin_api_key or ())),
                          **{name: getattr(core, name) for name in SERVER_OPTIONS})
