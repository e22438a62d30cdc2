"""Server limits and switches (serving-api.md §12), resolved once into one frozen record.

Library code never reads the environment: the CLI (``omnicore serve``) builds this from flags and
``OMNICORE_*`` variables via :func:`server_settings_from`, tests construct it directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from ..config import Settings
from ..errors import ConfigError

_CORE = Settings()


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ConfigError(attribute.name, f"must be > 0 (it paces heartbeats, liveness checks and expiry), "
                                          f"got {value!r}")


@attrs.frozen
class ServerSettings:
    """Everything the HTTP layer needs to know. Defaults are the core settings' (config.OPTIONS, serving-api.md §12)."""

    state_dir: Path = attrs.field(converter=Path)
    host: str = _CORE.host
    port: int = _CORE.port
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    max_queued_jobs: int = _CORE.max_queued_jobs
    max_image_pixels: int = _CORE.max_image_pixels
    max_input_image_pixels: int = _CORE.max_input_image_pixels
    max_upload_bytes: int = _CORE.max_upload_bytes
    max_request_bytes: int = _CORE.max_request_bytes
    max_prompt_chars: int = _CORE.max_prompt_chars
    heartbeat_interval_s: float = attrs.field(default=_CORE.heartbeat_interval_s, validator=_positive)
    cancel_wait_s: float = _CORE.cancel_wait_s
    shutdown_grace_s: float = _CORE.shutdown_grace_s
    max_job_seconds: float = _CORE.max_job_seconds  # 0 = no operator deadline (there is never a default one)
    job_ttl_s: float = _CORE.job_ttl_s  # 0 = keep forever
    cors_origins: tuple[str, ...] = attrs.field(default=(), converter=tuple)


def server_settings_from(core: Settings) -> ServerSettings:
    """The server's view of the resolved core settings (flags and ``OMNICORE_*`` were resolved by ``config``)."""
    keys: list[str] = list(core.api_key or ())
    if core.api_key_file:
        keys.extend(line.strip() for line in Path(core.api_key_file).read_text().splitlines() if line.strip())
    values: dict[str, Any] = {"state_dir": core.state_path, "api_keys": tuple(dict.fromkeys(keys))}
    for field in attrs.fields(ServerSettings):
        if field.name not in values:
            values[field.name] = getattr(core, field.name)
    return ServerSettings(**values)
