"""Open, string-keyed registries of spec records (no enums, no isinstance ladders)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

import attrs

from .errors import DuplicateRegistration, UnknownName


class SpecRecord(Protocol):
    """What a registry holds: an attrs spec record with a name and the plugin that provided it."""

    @property
    def name(self) -> str: ...

    @property
    def provider(self) -> str: ...


T = TypeVar("T", bound=SpecRecord)


def key_of(record: SpecRecord) -> str:
    """The registry key of a record: its ``registry_key`` when it has one (platform ops are keyed by op,
    platform and provider), else its ``name``; lower-case."""
    key = getattr(record, "registry_key", None) or record.name
    return str(key).lower()


def with_provider(record: T, provider: str) -> T:
    """A copy of the (attrs, frozen) ``record`` stamped with its provider."""
    if not attrs.has(type(record)):
        raise TypeError(f"registries hold attrs spec records, got {type(record).__name__}")
    # attrs' mypy plugin cannot see through a protocol-bound TypeVar; attrs.has() above is the runtime check
    evolve: Any = attrs.evolve
    stamped: T = evolve(record, provider=provider)
    return stamped


class Registry(Generic[T]):
    """Records of one kind keyed by lower-case name; aliases resolve to the same record.

    Registering a taken name (or alias) raises :class:`DuplicateRegistration` naming both providers unless
    ``replace=True``; replacements are remembered in :attr:`overrides` so ``omnicore plugins`` can show them.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._records: dict[str, T] = {}
        self._aliases: dict[str, str] = {}
        self.overrides: list[tuple[str, str, str]] = []  # (name, old provider, new provider)
        self._replaced: dict[str, list[T]] = {}  # name -> records shadowed by replace=True, oldest first

    def register(self, record: T, provider: str, *, replace: bool = False) -> T:
        record = with_provider(record, provider)
        name = key_of(record)
        aliases = [a.lower() for a in getattr(record, "aliases", ())]
        for key in (name, *aliases):
            owner = self._owner(key)
            if owner is not None and not (replace and key == name):
                raise DuplicateRegistration(self.kind, key, owner, provider)
        if name in self._records:
            self.overrides.append((name, self._records[name].provider, provider))
            self._replaced.setdefault(name, []).append(self._records[name])
        self._records[name] = record
        for alias in aliases:
            self._aliases[alias] = name
        return record

    def _owner(self, key: str) -> str | None:
        target = self._aliases.get(key, key)
        rec = self._records.get(target)
        return rec.provider if rec is not None else None

    def unregister_provider(self, provider: str) -> None:
        """Drop every record (and alias) a provider registered: used when its registration fails midway.

        A record it had replaced (``replace=True``) comes back, so a failing plugin leaves no trace.
        """
        for stack in self._replaced.values():
            stack[:] = [r for r in stack if r.provider != provider]
        gone = {n for n, r in self._records.items() if r.provider == provider}
        self._aliases = {a: n for a, n in self._aliases.items() if n not in gone}
        for n in gone:
            del self._records[n]
            previous = self._replaced.get(n)
            if previous:
                restored = self._records[n] = previous.pop()
                for alias in getattr(restored, "aliases", ()):
                    self._aliases[alias.lower()] = n
        self.overrides = [o for o in self.overrides if o[2] != provider]

    def get(self, name: str) -> T:
        key = name.lower()
        key = self._aliases.get(key, key)
        try:
            return self._records[key]
        except KeyError:
            raise UnknownName(self.kind, name, self.providers()) from None

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        key = name.lower()
        return self._aliases.get(key, key) in self._records

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._records.values()))

    def __len__(self) -> int:
        return len(self._records)

    def names(self) -> list[str]:
        return sorted(self._records)

    def providers(self) -> dict[str, str]:
        return {n: r.provider for n, r in self._records.items()}
