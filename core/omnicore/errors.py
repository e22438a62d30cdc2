"""Typed errors. Each carries the field or plugin it concerns so callers (CLI, server) can say *what* is wrong.

The HTTP server maps these classes to status codes in exactly one place (``omnicore.server.errors``).
"""

from __future__ import annotations


class OmnicoreError(Exception):
    """Base class of every error raised on purpose by omnicore."""


class InvalidRequest(OmnicoreError, ValueError):
    """A request field broke a rule. ``field`` is the dotted name of the field, ``rule`` says what is required.

    ``code`` (optional) is the stable machine-readable reason the HTTP layer reports, e.g.
    ``unsupported_for_model`` or ``too_many_input_images``; ``None`` means ``invalid_value``.
    """

    def __init__(self, field: str, rule: str, code: str | None = None) -> None:
        self.field = field
        self.rule = rule
        self.code = code
        super().__init__(f"{field}: {rule}")


class ConfigError(OmnicoreError, ValueError):
    """A setting (CLI flag, ``OMNICORE_*`` variable or option) is invalid. ``name`` is the setting's name."""

    def __init__(self, name: str, rule: str) -> None:
        self.name = name
        self.rule = rule
        super().__init__(f"{name}: {rule}")


class PluginError(OmnicoreError):
    """A plugin failed to load, register or run. ``plugin`` names it; ``cause`` is the underlying problem."""

    def __init__(self, plugin: str, cause: str | BaseException) -> None:
        self.plugin = plugin
        self.cause = cause
        super().__init__(f"plugin {plugin!r}: {cause}")


class DuplicateRegistration(PluginError):
    """Two providers registered the same name in one registry."""

    def __init__(self, kind: str, name: str, existing: str, new: str) -> None:
        self.kind = kind
        self.name = name
        self.existing = existing
        super().__init__(new, f"{kind} {name!r} is already registered by plugin {existing!r}")


class UnknownName(OmnicoreError, LookupError):
    """A registry lookup failed. The message lists what is known and who provides it."""

    def __init__(self, kind: str, name: str, known: dict[str, str], hint: str = "") -> None:
        self.kind = kind
        self.name = name
        self.known = dict(known)
        listing = ", ".join(f"{k} (from {v})" for k, v in sorted(known.items())) or "none registered"
        super().__init__(f"unknown {kind} {name!r}; known: {listing}" + (f"; {hint}" if hint else ""))

    def __str__(self) -> str:  # LookupError would otherwise repr() the message
        return self.args[0]


class UnsupportedFeature(OmnicoreError):
    """A feature was requested that the chosen model, platform or backend does not support."""

    def __init__(self, feature: str, reason: str) -> None:
        self.feature = feature
        self.reason = reason
        super().__init__(f"{feature}: {reason}")


class PlatformUnavailable(UnsupportedFeature):
    """The selected platform cannot run here (missing hardware or driver library)."""

    def __init__(self, platform: str, reason: str) -> None:
        self.platform = platform
        super().__init__(f"platform {platform!r}", f"unavailable: {reason}")


class QueueFull(OmnicoreError):
    """The engine's bounded queue is at its limit; the request was not admitted (nothing was dropped)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"queue is full ({limit} requests waiting); retry later")


class Cancelled(OmnicoreError):
    """A job was cancelled between denoise steps."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        super().__init__(f"job {job_id} was cancelled")


class EngineClosed(OmnicoreError, RuntimeError):
    """The engine no longer admits work (shut down or shutting down)."""


class ModelUnavailable(OmnicoreError):
    """One model of a :class:`~omnicore.pool.ModelPool` cannot serve: its load failed, or it cannot fit the memory
    budget. Only that model's requests fail; the pool's other models keep serving."""

    def __init__(self, model: str, reason: str) -> None:
        self.model = model
        self.reason = reason
        super().__init__(f"model {model!r} is unavailable: {reason}")
