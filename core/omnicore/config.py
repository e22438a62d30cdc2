"""Settings resolution: CLI flag > ``OMNICORE_*`` environment variable > default.

Every setting is declared once, in :data:`OPTIONS` (like datasette's ``SETTINGS``): its name, environment
variable, default, parser, help, CLI flag and the subcommands that take the flag. Everything else is derived
from that table — the :class:`Settings` record's attributes and defaults, every CLI flag (:func:`add_flags`),
the server's settings (``omnicore.server.settings``) and the error messages, which name the flag or variable
the value came from. The README's configuration table is checked against it by a test, so there are no hidden
switches. Library code never reads the environment: it receives a :class:`Settings` object built here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from .errors import ConfigError
from .sizes import parse_bytes


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


def _non_negative_int(name: str, raw: Any) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(name, f"must be a non-negative integer, got {raw!r}") from None
    if value < 0:
        raise ConfigError(name, f"must be a non-negative integer, got {raw!r}")
    return value


def _port(name: str, raw: Any) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(name, f"must be a port number 0-65535, got {raw!r}") from None
    if not 0 <= value <= 65535:
        raise ConfigError(name, f"must be a port number 0-65535, got {raw!r}")
    return value


def _items(raw: Any) -> list[Any]:
    """A repeated flag gives a list; the environment one comma-separated string."""
    if raw is None:
        return []
    if isinstance(raw, (list, tuple)):
        return list(raw)
    return [part for part in str(raw).split(",") if part.strip()]


def _lora_modules(name: str, raw: Any) -> tuple[tuple[str, str], ...]:
    """``NAME=PATH`` items (pairs pass through) -> ``((name, path), ...)``; a name given twice is an error."""
    pairs: list[tuple[str, str]] = []
    for item in _items(raw):
        if isinstance(item, (list, tuple)) and len(item) == 2:
            key, path = str(item[0]), str(item[1])
        else:
            key, sep, path = str(item).partition("=")
            key, path = key.strip(), path.strip()
            if not sep or not key or not path:
                raise ConfigError(name, f"expected NAME=PATH, got {item!r}")
        if key in dict(pairs):
            raise ConfigError(name, f"adapter name {key!r} is given twice")
        pairs.append((key, path))
    return tuple(pairs)


def _paths(name: str, raw: Any) -> tuple[str, ...]:
    return tuple(str(p).strip() for p in _items(raw) if str(p).strip())


_BYTE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
               "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def _bytes_or_none(name: str, raw: Any) -> int | None:
    """A positive byte count, ``123``, ``512MiB`` or ``2GB``; ``None``/empty: no limit."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    else:
        text = str(raw).strip().lower().replace(" ", "")
        number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(number):]
        try:
            value = int(float(number) * _BYTE_UNITS[unit])
        except (KeyError, ValueError):
            raise ConfigError(name, f"must be a positive number of bytes (e.g. 536870912 or 512MiB), got {raw!r}") \
                from None
    if value < 1:
        raise ConfigError(name, f"must be a positive number of bytes, got {raw!r}")
    return value


#: Which parsers get an option's flag: ``global`` the top-level ``omnicore`` parser, ``engine`` every command that
#: runs a model (``generate`` and ``serve``), ``server`` only ``serve``.
SCOPES = ("global", "engine", "server")


@attrs.frozen
class Option:
    """One documented setting (the only place its name, default, flag and help are written)."""

    name: str
    env: str
    default: Any
    parse: Callable[[str, Any], Any]
    help: str
    flag: str | None = None  # the CLI flag when it is not --<name with dashes>; "" = environment only
    scope: str = "server"  # see SCOPES
    aliases: tuple[str, ...] = ()  # more flags for the same setting (e.g. --storage-dir)
    repeatable: bool = False  # the flag may be given several times (a list reaches the parser)
    metavar: str | None = None

    @property
    def cli_flag(self) -> str:
        """The flag (``""`` for environment-only settings)."""
        return self.flag if self.flag is not None else "--" + self.name.replace("_", "-")

    @property
    def is_switch(self) -> bool:
        """A boolean setting: its flag takes no value."""
        return isinstance(self.default, bool)


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
           "Platform to run on (`cpu`, `cuda`, `npu`, ...); default: the available one with the highest priority.",
           scope="engine"),
    Option("attention_backend", "OMNICORE_ATTENTION_BACKEND", None,
           lambda n, v: (str(v).strip() or None) if v is not None else None,
           "Force an attention backend by name; default: chosen per requirement by the attention hook.",
           scope="engine"),
    Option("cache_dir", "OMNICORE_CACHE", None, lambda n, v: str(v) if v else None,
           "Where tiny presets and downloads are written (default `~/.cache/omnicore`).", flag=""),
    Option("state_dir", "OMNICORE_STATE_DIR", None, lambda n, v: str(v) if v else None,
           "Where the server keeps its job database, inputs and results (default `<cache_dir>/state/<model>`, "
           "e.g. `~/.cache/omnicore/state/tiny-lingbot`: one per model); one server per directory.",
           flag="--storage-dir", aliases=("--state-dir",)),
    Option("max_num_seqs", "OMNICORE_MAX_NUM_SEQS", 4, _positive_int,
           "Largest batch the scheduler forms (requests with equal batch keys).", scope="engine"),
    Option("max_queue", "OMNICORE_MAX_QUEUE", 256, _positive_int,
           "Bounded queue length; a request beyond it gets QueueFull (HTTP 429).", scope="engine"),
    Option("request_batch_max_wait_ms", "OMNICORE_REQUEST_BATCH_MAX_WAIT_MS", 0.0, finite_non_negative,
           "Admission wait before a batch starts (ms, finite, >= 0); 0 disables waiting.", scope="engine"),
    Option("log_level", "OMNICORE_LOG_LEVEL", "WARNING", lambda n, v: str(v).upper(),
           "Python logging level for omnicore's loggers.", scope="global"),
    Option("host", "OMNICORE_HOST", "127.0.0.1", lambda n, v: str(v), "Address `omnicore serve` binds."),
    Option("port", "OMNICORE_PORT", 8000, _port, "Port `omnicore serve` binds (0 = any free port)."),
    Option("api_key", "OMNICORE_API_KEY", None, lambda n, v: _parse_keys(v),
           "When set, the server requires `Authorization: Bearer <key>` (the flag is repeatable for several keys).",
           repeatable=True, metavar="KEY"),
    Option("api_key_file", "OMNICORE_API_KEY_FILE", None, lambda n, v: str(v) if v else None,
           "File with one accepted server API key per line (added to `OMNICORE_API_KEY`)."),
    Option("admin_api_key", "OMNICORE_ADMIN_API_KEY", None, lambda n, v: _parse_keys(v),
           "Server: an API key that sees and manages every key's jobs (repeatable); other keys see only the jobs "
           "they created.", repeatable=True, metavar="KEY"),
    Option("max_queued_jobs", "OMNICORE_MAX_QUEUED_JOBS", 64, _positive_int,
           "Server: queued plus running jobs before new ones get HTTP 429."),
    Option("max_image_pixels", "OMNICORE_MAX_IMAGE_PIXELS", 4096 * 4096, _positive_int,
           "Server: largest generated image (width x height); above it HTTP 400 before dispatch."),
    Option("max_input_image_pixels", "OMNICORE_MAX_INPUT_IMAGE_PIXELS", 50_000_000, _positive_int,
           "Server: decode cap for uploaded reference images."),
    Option("max_decode_bytes", "OMNICORE_MAX_DECODE_BYTES", 4 * 1024**3, _non_negative_int,
           "Server: bytes of decoded conditioning media (pixels, frames, samples) that all requests and queued jobs "
           "may hold at once, estimated from each upload's header before decoding; beyond it HTTP 429 (400 when "
           "one request alone exceeds it); 0 = no budget."),
    Option("max_upload_bytes", "OMNICORE_MAX_UPLOAD_BYTES", 50 * 1024 * 1024, _positive_int,
           "Server: per-file upload cap; above it HTTP 413."),
    Option("max_request_bytes", "OMNICORE_MAX_REQUEST_BYTES", 200 * 1024 * 1024, _positive_int,
           "Server: whole request body cap; above it HTTP 413."),
    Option("max_prompt_chars", "OMNICORE_MAX_PROMPT_CHARS", 32_768, _positive_int,
           "Server: longest accepted prompt."),
    Option("max_work", "OMNICORE_MAX_WORK", 50_000_000_000, _non_negative_int,
           "Server: work budget per job, width x height x frames x steps x outputs of the resolved request; "
           "above it HTTP 400 naming the limit; 0 = no budget."),
    Option("read_timeout_s", "OMNICORE_READ_TIMEOUT_S", 30.0, finite_non_negative,
           "Server: seconds a client may take to send its request headers, or pause while sending the body "
           "(then 408); 0 = no limit.", flag="--read-timeout"),
    Option("metrics_auth", "OMNICORE_METRICS_AUTH", False, lambda n, v: _parse_bool(n, str(v)),
           "Server: with API keys set, `/metrics` requires the key too (`/health` never does)."),
    Option("heartbeat_interval_s", "OMNICORE_HEARTBEAT_INTERVAL_S", 5.0, finite_non_negative,
           "Server: seconds between job heartbeats on progress streams.", flag="--heartbeat-interval"),
    Option("body_timeout_s", "OMNICORE_BODY_TIMEOUT_S", 300.0, finite_non_negative,
           "Server: seconds the whole request body may take to arrive, however steadily it trickles (then 408); "
           "0 = no limit.", flag="--body-timeout"),
    Option("cancel_wait_s", "OMNICORE_CANCEL_WAIT_S", 30.0, finite_non_negative,
           "Server: how long cancel/DELETE wait for the worker to stop before answering 202.", flag="--cancel-wait"),
    Option("shutdown_grace_s", "OMNICORE_SHUTDOWN_GRACE_S", 60.0, finite_non_negative,
           "Server: on shutdown, how long running work may finish before it is cancelled.", flag="--shutdown-grace"),
    Option("max_job_seconds", "OMNICORE_MAX_JOB_SECONDS", 0.0, finite_non_negative,
           "Server: operator deadline per job, in seconds of running time (from when the worker starts the job; "
           "time spent queued does not count; a client's own `timeout_s` counts from submission); "
           "0 = none (there is no default job timeout)."),
    Option("job_ttl_s", "OMNICORE_JOB_TTL_S", 7 * 24 * 3600.0, finite_non_negative,
           "Server: seconds a finished job and its files are kept; 0 = forever.", flag="--job-ttl"),
    Option("cors_origins", "OMNICORE_CORS_ORIGINS", (), lambda n, v: tuple(v) if isinstance(v, (list, tuple))
           else (_parse_names(n, v) or ()), "Server: allowed CORS origins (comma-separated); none by default.",
           flag="--cors-origin", repeatable=True, metavar="ORIGIN"),
    Option("no_ui", "OMNICORE_NO_UI", False, lambda n, v: _parse_bool(n, str(v)),
           "Server: do not serve the browser playground at `/` (the API is unchanged)."),
    Option("models_file", "OMNICORE_MODELS_FILE", None, lambda n, v: str(v) if v else None,
           "Server: a models.toml of several models to serve in one process (name, checkpoint, options, caches, "
           "offload, priority, pinned ...); requests choose one with `model`.", flag="--models", metavar="PATH"),
    Option("memory_budget", "OMNICORE_MEMORY_BUDGET", None, lambda n, v: _pool_bytes(n, v),
           "Server with several models: device memory the loaded ones may hold (24GiB, 800MB or bytes); idle "
           "models beyond it are offloaded to host memory; none = the device's memory.", metavar="SIZE"),
    Option("host_memory_budget", "OMNICORE_HOST_MEMORY_BUDGET", None, lambda n, v: _pool_bytes(n, v),
           "Server with several models: host memory offloaded models may hold; beyond it the least recently "
           "used one is unloaded; none = no limit.", metavar="SIZE"),
    Option("lora_modules", "OMNICORE_LORA_MODULES", (), _lora_modules,
           "Server: LoRA adapters read and checked at start-up, NAME=PATH (repeatable; comma-separated in the "
           "environment); requests name them in `lora`, `/v1/models` and `omnicore models` list them.",
           repeatable=True, metavar="NAME=PATH"),
    Option("lora_dirs", "OMNICORE_LORA_DIRS", (), _paths,
           "Server: the only directories a request's `lora` may name a path in (repeatable; comma-separated in "
           "the environment); no other path is ever opened. None: requests name only --lora-modules adapters.",
           flag="--lora-dir", repeatable=True, metavar="DIR"),
    Option("max_lora_bytes", "OMNICORE_MAX_LORA_BYTES", None, _bytes_or_none,
           "Server: device budget of the LoRA cache: adapter copies plus the running batch's stacked slots (bytes, "
           "or 512MiB / 2GB); the least recently used adapters past it leave the device and stay in host memory "
           "(pinned on CUDA); none = no limit.",
           metavar="BYTES"),
    Option("max_lora_host_bytes", "OMNICORE_MAX_LORA_HOST_BYTES", None, _bytes_or_none,
           "Server: host-memory budget of the converted LoRA adapters (bytes, or 8GiB); past it the least recently "
           "used are dropped and read from their files again when a request names them; none = 8GiB.",
           metavar="BYTES"),
    Option("store", "OMNICORE_STORE", None, lambda n, v: (str(v).strip() or None) if v else None,
           "Server: where job records live: `sqlite` (default: one server, in the state directory) or "
           "`postgresql://user@host/db`, a database several replicas share (they claim queued jobs with leases).",
           metavar="URL"),
    Option("storage_url", "OMNICORE_STORAGE_URL", None, lambda n, v: (str(v).strip() or None) if v else None,
           "Server: fsspec URL of the directory for job inputs and results (`file:///shared/dir`, mounted at the "
           "same path on every replica); default: the state directory.", metavar="URL"),
    Option("lease_s", "OMNICORE_LEASE_S", 30.0, finite_non_negative,
           "Server with a shared store: seconds a replica's claim on a job lasts without renewal (renewed every "
           "third of it); a replica that dies or hangs longer gives its jobs back to the queue.", flag="--lease"),
    Option("claim_slots", "OMNICORE_CLAIM_SLOTS", 2, _positive_int,
           "Server with a shared store: jobs one replica holds at once (running plus waiting in its engine)."),
    Option("checkpoint_every", "OMNICORE_CHECKPOINT_EVERY", 0, _non_negative_int,
           "Server with a shared store: every K completed denoise steps, write the job's step state (safetensors + "
           "JSON under the storage URL, fenced by the lease) so a replica that re-claims the job resumes there; 0 = "
           "off. Only models that declare checkpointable state (`omnicore models`); step caches restart cold.",
           metavar="K"),
)


def _pool_bytes(name: str, raw: Any) -> int | None:
    return parse_bytes(name, raw)


_BY_NAME = {opt.name: opt for opt in OPTIONS}


class Settings:
    """Resolved settings: one read-only attribute per entry of :data:`OPTIONS`, nothing declared twice.

    ``Settings(**values)`` takes option names (the rest keep their defaults); build it from flags and the
    environment with :func:`resolve_settings`. Equal values make equal (and equally hashed) records.
    """

    __slots__ = ("_values",)
    _values: dict[str, Any]

    def __init__(self, **values: Any) -> None:
        unknown = set(values) - _BY_NAME.keys()
        if unknown:
            raise TypeError(f"Settings() got an unknown setting {min(unknown)!r}; known: {', '.join(_BY_NAME)}")
        merged = {opt.name: opt.default for opt in OPTIONS}
        merged.update(values)
        object.__setattr__(self, "_values", merged)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"'Settings' has no setting {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise attrs.exceptions.FrozenInstanceError()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Settings) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(self._values.items()))

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self._values.items() if v != _BY_NAME[k].default)
        return f"Settings({changed})"

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def evolve(self, **changes: Any) -> Settings:
        """A copy with ``changes`` applied."""
        return Settings(**{**self._values, **changes})

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
            raw, source = flags[opt.name], opt.cli_flag or opt.name  # errors name the real flag
        elif opt.env in env:
            raw, source = env[opt.env], opt.env
        else:
            values[opt.name] = opt.default
            continue
        values[opt.name] = opt.parse(source, raw)
    return Settings(**values)


def options_in(*scopes: str) -> tuple[Option, ...]:
    """The options whose flag belongs to one of ``scopes`` (environment-only options have no flag)."""
    return tuple(opt for opt in OPTIONS if opt.cli_flag and opt.scope in scopes)


def add_flags(parser: Any, *scopes: str, title: str | None = None) -> None:
    """Add the flags of the options in ``scopes`` to an ``argparse`` parser, all derived from :data:`OPTIONS`.

    A flag's value is parsed by the option's own parser at once (a bad value is a usage error naming the flag);
    ``dest`` is the option name and ``None`` means "not given", so :func:`resolve_settings` falls back to the
    environment and the default. Parsers are idempotent, so resolving the parsed value again is harmless.
    """
    import argparse

    def parser_of(opt: Option) -> Callable[[str], Any]:
        def parse(text: str) -> Any:
            try:
                return opt.parse(opt.cli_flag, text)
            except ConfigError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        return parse

    target = parser.add_argument_group(title) if title else parser
    for opt in options_in(*scopes):
        shown = "none" if opt.default in (None, ()) else repr(opt.default)
        help_text = f"{opt.help} (env {opt.env}; default {shown})".replace("%", "%%")
        names = (opt.cli_flag, *opt.aliases)
        if opt.is_switch:
            target.add_argument(*names, dest=opt.name, action="store_true", default=None, help=help_text)
        else:
            metavar = opt.metavar or opt.cli_flag.lstrip("-").upper().replace("-", "_")
            target.add_argument(*names, dest=opt.name, default=None, help=help_text, metavar=metavar,
                                action="append" if opt.repeatable else "store",
                                type=None if opt.repeatable else parser_of(opt))


def flags_from_args(args: Any, *scopes: str) -> dict[str, Any]:
    """``{option name: raw flag value}`` for the options of ``scopes`` found on a parsed namespace."""
    return {opt.name: getattr(args, opt.name, None) for opt in options_in(*scopes)}
