"""The op table of one platform: ``platform.ops.<name>(...)`` dispatches to the registered fast kernels.

For each op, the implementations registered for the platform are tried highest ``priority`` first: the first whose
``applies(*args, **kwargs)`` is true (or that declares no ``applies``) runs; when none applies the eager reference
runs. An op nobody registered *is* the eager reference (no dispatch overhead). Implementations are imported on the
first use of their op, so building a table imports nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import PluginError
from .names import OP_NAMES

if TYPE_CHECKING:
    from ..specs import OpSpec


class PlatformOps:
    """Named ops of platform ``platform`` (see :mod:`omnicore.ops`). Attribute access returns a callable."""

    def __init__(self, platform: str, specs: Iterable[OpSpec] = ()) -> None:
        self.platform = platform
        chosen: dict[str, list[OpSpec]] = {}
        for spec in specs:
            if spec.platform == platform:
                chosen.setdefault(spec.name, []).append(spec)
        self._specs: dict[str, tuple[OpSpec, ...]] = {
            name: tuple(sorted(found, key=lambda s: (-s.priority, s.provider))) for name, found in chosen.items()}
        self._built: dict[str, Callable[..., object]] = {}  # a racing first use builds the same callable twice

    def __repr__(self) -> str:
        return f"PlatformOps({self.platform!r}, fast={sorted(self._specs)})"

    def __getattr__(self, name: str) -> Callable[..., Any]:  # an op's result: a tensor or a tuple of them
        if name.startswith("_") or name not in OP_NAMES:
            raise AttributeError(f"platform op {name!r} does not exist; ops: {', '.join(OP_NAMES)}")
        fn = self._built.get(name)
        if fn is None:
            fn = self._built.setdefault(name, self._build(name))
            self.__dict__[name] = fn  # later lookups are plain attribute reads (no __getattr__ call)
        return fn

    def prepare(self) -> PlatformOps:
        """Import every registered fast implementation now (a broken one raises :class:`PluginError` naming its
        plugin here, at start-up, instead of inside a model's forward); returns ``self``."""
        for name in self._specs:
            getattr(self, name)
        return self

    def implementations(self, name: str) -> tuple[OpSpec, ...]:
        """The registered fast implementations of op ``name`` on this platform, in the order they are tried."""
        if name not in OP_NAMES:
            raise KeyError(name)
        return self._specs.get(name, ())

    def provided(self) -> dict[str, list[str]]:
        """``{op: [provider, ...]}`` for every op with at least one fast implementation here."""
        return {name: [s.provider for s in specs] for name, specs in sorted(self._specs.items())}

    @staticmethod
    def eager(name: str) -> Callable[..., object]:
        """The eager reference of op ``name``."""
        from . import reference

        if name not in OP_NAMES:
            raise AttributeError(f"platform op {name!r} does not exist; ops: {', '.join(OP_NAMES)}")
        return getattr(reference, name)

    def _build(self, name: str) -> Callable[..., object]:
        eager = self.eager(name)
        specs = self._specs.get(name, ())
        if not specs:
            return eager
        from ..specs import resolve

        candidates: list[tuple[Callable[..., object], Callable[..., object] | None]] = []
        for spec in specs:
            try:
                impl = resolve(spec.impl)
                applies = resolve(spec.applies) if spec.applies else None
            except Exception as exc:
                raise PluginError(spec.provider or "?", f"op {name!r} for platform {self.platform!r}: cannot "
                                  f"import {spec.impl!r} / {spec.applies!r}: {type(exc).__name__}: {exc}") from exc
            candidates.append((impl, applies))

        if len(candidates) == 1 and candidates[0][1] is None:
            return candidates[0][0]

        def dispatch(*args: object, **kwargs: object) -> object:
            for impl, applies in candidates:
                if applies is None or applies(*args, **kwargs):
                    return impl(*args, **kwargs)
            return eager(*args, **kwargs)

        dispatch.__name__ = name
        dispatch.__qualname__ = f"PlatformOps[{self.platform}].{name}"
        dispatch.__doc__ = eager.__doc__
        return dispatch


__all__ = ["PlatformOps"]
