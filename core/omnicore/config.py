"""Settings resolution: CLI flag > ``OMNICORE_*`` environment variable > default.

Every setting is declared once in :data:`OPTIONS`; the README's configuration table is checked against it
by a test, so there are no hidden switches. Library code never reads the environment: it receives a
:class:`Settings` object built here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from .errors import ConfigError


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(name, f"expected a boolean (1/0, true/false, yes/no, on/off), got {raw!r}")


def _parse_names(name: str, raw: str | None) -> tuple[str, ...] | None:
    """``None`` means "not set"; an empty string means "an empty list"."""
    if raw is None:
        return None
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def _parse_keys(raw: Any) -> tuple[str, ...] | None:
    """API keys: a repeated flag gives a list, the environment one key; empty means none."""
    keys = tuple(str(k) for k in (raw if isinstance(raw, (list, tuple)) else [raw]) if k)
    return keys or None


def finite_non_negative(name: str, raw: Any) -> float:
    """Coerce to float; NaN, infinities and negatives are rejected (ints are normalised to floats)."""
    try:
        value = float(raw or 0.0)
    except (TypeError, ValueError):
        raise ConfigError(name, f"must be a finite non-negative number, got {raw!r}") from None
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ConfigError(name, f"must be a finite non-negative number, got {raw!r}")
    return value


def _positive_int(name: str, raw: Any) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(name, f"must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ConfigError(name, f"must be a positive integer, got {raw!r}")
    return value


@attrs.frozen
class Option:
    """One documented setting."""

    name: str
    env: str
    default: Any
    parse: Callable[[str, Any], Any]
    help: str
    flag: str | None = None  # the CLI flag when it is not --<name with dashes>; "" = environment only

    @property
    def cli_flag(self) -> str:
        return self.flag if self.flag is not None else "--" + self.name.replace("_", "-")


def _default_cache() -> str:
    return str(Path.home() / ".cache" / "omnicore")


OPTIONS: tuple[Option, ...] = (
    Option("plugins", "OMNICORE_PLUGINS", None, lambda n, v: _parse_names(n, v),
           "Allow-list of plugins to load, by entry-point or distribution name (comma-separated); "
           "empty loads none.", flag=""),
    Option("disable_plugins", "OMNICORE_DISABLE_PLUGINS", (), lambda n, v: _parse_names(n, v) or (),
           "Deny-list of plugins never imported (entry-point or distribution names); "
           "`*` disables every third-party plugin.", flag=""),
    Option("trace_plugins", "OMNICORE_TRACE_PLUGINS", False, lambda n, v: _parse_bool(n, str(v)),
           "Log every hook call with the plugins it ran and its duration.", flag=""),
    Option("platform", "OMNICORE_PLATFORM", None, lambda n, v: (str(v).strip() or None) if v is not None else None,
           "Platform to run on (`cpu`, `cuda`, `npu`, ...); default: the available one with the highest priority."),
    Option("attention_backend", "OMNICORE_ATTENTION_BACKEND", None,
           lambda n, v: (str(v).strip() or None) if v is not None else None,
           "Force an attention backend by name; default: chosen per requirement by the attention hook."),
    Option("cache_dir", "OMNICORE_CACHE", None, lambda n, v: str(v) if v else None,
           "Where tiny presets and downloads are written (default `~/.cache/omnicore`).", flag=""),
    Option("state_dir", "OMNICORE_STATE_DIR", None, lambda n, v: str(v) if v else None,
           "Where the server keeps its job database and results (default `<cache_dir>/state`)."),
    Option("max_num_seqs", "OMNICORE_MAX_NUM_SEQS", 4, _positive_int,
           "Largest batch the scheduler forms (requests with equal batch keys)."),
    Option("max_queue", "OMNICORE_MAX_QUEUE", 256, _positive_int,
           "Bounded queue length; a request beyond it gets QueueFull (HTTP 429)."),
    Option("request_batch_max_wait_ms", "OMNICORE_REQUEST_BATCH_MAX_WAIT_MS", 0.0, finite_non_negative,
           "Admission wait before a batch starts (ms, finite, >= 0); 0 disables waiting."),
    Option("log_level", "OMNICORE_LOG_LEVEL", "WARNING", lambda n, v: str(v).upper(),
           "Python logging level for omnicore's loggers."),
    Option("host", "OMNICORE_HOST", "127.0.0.1", lambda n, v: str(v), "Address `omnicore serve` binds."),
    Option("port", "OMNICORE_PORT", 8000, _positive_int, "Port `omnicore serve` binds."),
    Option("api_key", "OMNICORE_API_KEY", None, lambda n, v: _parse_keys(v),
           "When set, the server requires `Authorization: Bearer <key>` (the flag is repeatable for several keys)."),
    Option("api_key_file", "OMNICORE_API_KEY_FILE", None, lambda n, v: str(v) if v else None,
           "File with one accepted server API key per line (added to `OMNICORE_API_KEY`)."),
    Option("max_queued_jobs", "OMNICORE_MAX_QUEUED_JOBS", 64, _positive_int,
           "Server: queued plus running jobs before new ones get HTTP 429."),
    Option("max_image_pixels", "OMNICORE_MAX_IMAGE_PIXELS", 4096 * 4096, _positive_int,
           "Server: largest generated image (width x height); above it HTTP 400 before dispatch."),
    Option("max_input_image_pixels", "OMNICORE_MAX_INPUT_IMAGE_PIXELS", 50_000_000, _positive_int,
           "Server: decode cap for uploaded reference images."),
    Option("max_upload_bytes", "OMNICORE_MAX_UPLOAD_BYTES", 50 * 1024 * 1024, _positive_int,
           "Server: per-file upload cap; above it HTTP 413."),
    Option("max_request_bytes", "OMNICORE_MAX_REQUEST_BYTES", 200 * 1024 * 1024, _positive_int,
           "Server: whole request body cap; above it HTTP 413."),
    Option("max_prompt_chars", "OMNICORE_MAX_PROMPT_CHARS", 32_768, _positive_int,
           "Server: longest accepted prompt."),
    Option("heartbeat_interval_s", "OMNICORE_HEARTBEAT_INTERVAL_S", 5.0, finite_non_negative,
           "Server: seconds between job heartbeats on progress streams.", flag="--heartbeat-interval"),
    Option("cancel_wait_s", "OMNICORE_CANCEL_WAIT_S", 30.0, finite_non_negative,
           "Server: how long cancel/DELETE wait for the worker to stop before answering 202.", flag="--cancel-wait"),
    Option("shutdown_grace_s", "OMNICORE_SHUTDOWN_GRACE_S", 60.0, finite_non_negative,
           "Server: on shutdown, how long running work may finish before it is cancelled.", flag="--shutdown-grace"),
    Option("max_job_seconds", "OMNICORE_MAX_JOB_SECONDS", 0.0, finite_non_negative,
           "Server: operator deadline per job; 0 = none (there is no default job timeout)."),
    Option("job_ttl_s", "OMNICORE_JOB_TTL_S", 7 * 24 * 3600.0, finite_non_negative,
           "Server: seconds a finished job and its files are kept; 0 = forever.", flag="--job-ttl"),
    Option("cors_origins", "OMNICORE_CORS_ORIGINS", (), lambda n, v: tuple(v) if isinstance(v, (list, tuple))
           else (_parse_names(n, v) or ()), "Server: allowed CORS origins (comma-separated); none by default.", flag="--cors-origin"),
)

_BY_NAME = {opt.name: opt for opt in OPTIONS}


@attrs.frozen
class Settings:
    """Resolved settings. Build with :func:`resolve_settings`; fields mirror :data:`OPTIONS`."""

    plugins: tuple[str, ...] | None = None
    disable_plugins: tuple[str, ...] = ()
    trace_plugins: bool = False
    platform: str | None = None
    attention_backend: str | None = None
    cache_dir: str | None = None
    state_dir: str | None = None
    max_num_seqs: int = 4
    max_queue: int = 256
    request_batch_max_wait_ms: float = 0.0
    log_level: str = "WARNING"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: tuple[str, ...] | None = None
    api_key_file: str | None = None
    max_queued_jobs: int = 64
    max_image_pixels: int = 4096 * 4096
    max_input_image_pixels: int = 50_000_000
    max_upload_bytes: int = 50 * 1024 * 1024
    max_request_bytes: int = 200 * 1024 * 1024
    max_prompt_chars: int = 32_768
    heartbeat_interval_s: float = 5.0
    cancel_wait_s: float = 30.0
    shutdown_grace_s: float = 60.0
    max_job_seconds: float = 0.0
    job_ttl_s: float = 7 * 24 * 3600.0
    cors_origins: tuple[str, ...] = ()

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir or _default_cache()).expanduser()

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir).expanduser() if self.state_dir else self.cache_path / "state"


def resolve_settings(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Resolve every option: a flag that is not ``None`` wins, then the env var, then the default."""
    flags = flags or {}
    env = os.environ if env is None else env
    unknown = set(flags) - set(_BY_NAME)
    if unknown:
        raise ConfigError(sorted(unknown)[0], "is not a known setting")
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        if flags.get(opt.name) is not None:
            raw, source = flags[opt.name], f"--{opt.name.replace('_', '-')}"
        elif opt.env in env:
            raw, source = env[opt.env], opt.env
        else:
            values[opt.name] = opt.default
            continue
        values[opt.name] = opt.parse(source, raw)
    return Settings(**values)
