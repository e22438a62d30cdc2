"""Server limits and switches (serving-api.md §12), resolved once into one frozen record.

Library code never reads the environment: the CLI (``omnicore serve``) builds this from flags and
``OMNICORE_*`` variables via :func:`server_settings_from`, tests construct it directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from ..config import Settings


@attrs.frozen
class ServerSettings:
    """Everything the HTTP layer needs to know; defaults follow serving-api.md §12."""

    state_dir: Path = attrs.field(converter=Path)
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    max_queued_jobs: int = 64
    max_image_pixels: int = 4096 * 4096
    max_input_image_pixels: int = 50_000_000
    max_upload_bytes: int = 50 * 1024 * 1024
    max_request_bytes: int = 200 * 1024 * 1024
    max_prompt_chars: int = 32_768
    heartbeat_interval_s: float = 5.0
    cancel_wait_s: float = 30.0
    shutdown_grace_s: float = 60.0
    max_job_seconds: float = 0.0  # 0 = no operator deadline (there is never a default one)
    job_ttl_s: float = 7 * 24 * 3600.0  # 0 = keep forever
    cors_origins: tuple[str, ...] = attrs.field(default=(), converter=tuple)


def server_settings_from(core: Settings) -> ServerSettings:
    """The server's view of the resolved core settings (flags and ``OMNICORE_*`` were resolved by ``config``)."""
    keys: list[str] = [core.api_key] if core.api_key else []
    if core.api_key_file:
        keys.extend(line.strip() for line in Path(core.api_key_file).read_text().splitlines() if line.strip())
    values: dict[str, Any] = {"state_dir": core.state_path, "api_keys": tuple(dict.fromkeys(keys))}
    for field in attrs.fields(ServerSettings):
        if field.name not in values:
            values[field.name] = getattr(core, field.name)
    return ServerSettings(**values)
