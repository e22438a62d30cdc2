"""The one LoRA error: :class:`LoRAError`, a request error (HTTP 400) naming the adapter, the key and the rule."""

from __future__ import annotations

from ..errors import InvalidRequest


class LoRAError(InvalidRequest):
    """An adapter was refused. ``adapter`` is what the request named (name or path), ``key`` the tensor key or
    config field at fault (``None`` when the adapter as a whole is refused), ``reason`` the rule it broke.

    A subclass of :class:`~omnicore.errors.InvalidRequest` (field ``loras``, code ``invalid_lora``), so every
    surface reports it as a client error before the request is queued."""

    def __init__(self, adapter: str, key: str | None, reason: str) -> None:
        self.adapter = adapter
        self.key = key
        self.reason = reason
        where = f"adapter {adapter!r}" + (f", key {key!r}" if key else "")
        super().__init__("loras", f"{where}: {reason}", code="invalid_lora")

    def __reduce__(self) -> tuple[type, tuple[str, str | None, str]]:  # picklable (worker processes, job store)
        return (type(self), (self.adapter, self.key, self.reason))


__all__ = ["LoRAError"]
