"""Where adapters come from and where they live: :class:`AdapterRegistry`.

A request names an adapter by a name the operator preloaded (``modules``, ``--lora-modules name=path``) or by a path
that must lie under one of ``lora_dirs`` once symlinks are resolved — nothing else is ever opened. Read adapters
stay in host memory (pinned when they go to a CUDA device); their device copies form an LRU cache bounded by
``max_device_bytes``: the least recently used copy that the running batch does not need is dropped first, and a
later request copies it back from host memory without touching the file again.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ..errors import ConfigError
from .errors import LoRAError
from .formats import AdapterWeights, RawAdapter, convert, read_adapter
from .records import LoRA
from .targets import TargetMap


@attrs.frozen(eq=False)
class DeviceAdapter:
    """An adapter's device copy for one model: module -> ``(A [r, in], B [out, r])`` (B carries ``alpha/r``)."""

    key: tuple[Any, ...]
    label: str
    modules: dict[str, tuple[Any, Any]]
    nbytes: int


class AdapterRegistry:
    """Resolves, reads, checks and caches LoRA adapters (thread-safe: admission runs in callers' threads).

    :param modules: ``{name: path}`` adapters the operator named (trusted paths; requests use the name).
    :param lora_dirs: the only directories a request may name a path in (after resolving symlinks).
    :param max_device_bytes: budget of the device LRU cache (``None``: unbounded). One adapter larger than the
        budget is refused; a batch needing more than the budget keeps its adapters and evicts the others.
    """

    def __init__(self, modules: Mapping[str, str] | None = None, lora_dirs: Sequence[str | os.PathLike[str]] = (),
                 max_device_bytes: int | None = None) -> None:
        modules = dict(modules or {})
        for name, path in modules.items():
            if not isinstance(name, str) or not name or "=" in name or name != name.strip():
                raise ConfigError("lora_modules", f"adapter names must be non-empty strings without '=', got {name!r}")
            if not Path(path).exists():
                raise ConfigError("lora_modules", f"adapter {name!r}: {path} does not exist")
        if max_device_bytes is not None and (isinstance(max_device_bytes, bool) or not isinstance(max_device_bytes, int)
                                             or max_device_bytes <= 0):
            raise ConfigError("max_lora_bytes", f"must be a positive integer (bytes), got {max_device_bytes!r}")
        dirs = []
        for d in lora_dirs:
            resolved = Path(d).expanduser().resolve()
            if not resolved.is_dir():
                raise ConfigError("lora_dir", f"{d} is not a directory")
            dirs.append(resolved)
        self.modules: dict[str, Path] = {k: Path(v).expanduser().resolve() for k, v in modules.items()}
        self.lora_dirs: tuple[Path, ...] = tuple(dirs)
        self.max_device_bytes = max_device_bytes
        self._lock = threading.RLock()
        # path -> (file identity, generation, what was read); the generation keys the converted/device copies
        self._raw: dict[Path, tuple[tuple[int, int], int, RawAdapter]] = {}
        self._generation = 0
        self._host: dict[tuple[Any, ...], AdapterWeights] = {}  # (path, target map) -> converted
        self._device: OrderedDict[tuple[Any, ...], DeviceAdapter] = OrderedDict()  # LRU, oldest first
        self._counts = {"loads": 0, "hits": 0, "evictions": 0, "uploads": 0}

    # ------------------------------------------------------------------ resolution
    def list_modules(self) -> list[str]:
        """The preloaded adapters' names (``/v1/models``, ``omnicore models``)."""
        return sorted(self.modules)

    def resolve(self, lora: LoRA) -> Path:
        """The file or directory ``lora`` names: a preloaded name, else a path inside one of ``lora_dirs``."""
        label = lora.name_or_path
        if label in self.modules:
            return self.modules[label]
        if not self.lora_dirs:
            known = ", ".join(self.list_modules()) or "none"
            raise LoRAError(label, None, f"is not a preloaded adapter (known: {known}) and no LoRA directory allows "
                                         "paths (--lora-dir)")
        path = Path(label).expanduser()
        candidates = [path] if path.is_absolute() else [d / path for d in self.lora_dirs]
        for candidate in candidates:
            try:
                resolved = candidate.resolve(strict=True)
            except (OSError, RuntimeError):
                continue
            if any(resolved.is_relative_to(d) for d in self.lora_dirs):
                return resolved
            raise LoRAError(label, None, "resolves outside the allowed LoRA directories; it is not opened")
        raise LoRAError(label, None, "no such adapter in the allowed LoRA directories "
                                     f"({', '.join(map(str, self.lora_dirs))})")

    # ------------------------------------------------------------------ host side
    def _read(self, lora: LoRA, path: Path) -> tuple[int, RawAdapter]:
        try:  # a directory's identity is its files' (rewriting adapter_model.safetensors is a new version)
            stats = [p.stat() for p in sorted(path.iterdir()) if p.is_file()] if path.is_dir() else [path.stat()]
            ident = (max((st.st_mtime_ns for st in stats), default=0), sum(st.st_size for st in stats))
        except OSError as exc:
            raise LoRAError(lora.name_or_path, None, f"cannot be read: {exc}") from exc
        cached = self._raw.get(path)
        if cached is not None and cached[0] == ident:
            return cached[1], cached[2]
        raw = read_adapter(path, lora.name_or_path)
        self._generation += 1
        self._raw[path] = (ident, self._generation, raw)
        for key in [k for k in self._host if k[0] == path]:  # the file changed: drop what came from it
            del self._host[key]
        for key in [k for k in self._device if k[0] == path]:
            del self._device[key]
        return self._generation, raw

    def host_adapter(self, lora: LoRA, target_map: TargetMap) -> AdapterWeights:
        """``lora`` read and converted for ``target_map`` (cached, counted as a hit; a changed file is read
        again and counted as a load)."""
        return self._host_adapter(lora, self.resolve(lora), target_map, count=True)

    def _host_adapter(self, lora: LoRA, path: Path, target_map: TargetMap, *, count: bool) -> AdapterWeights:
        with self._lock:
            generation, raw = self._read(lora, path)
            key = (path, generation, target_map.key)
            weights = self._host.get(key)
            if weights is not None:
                self._counts["hits"] += int(count)
                return weights
            weights = convert(raw, target_map)
            device_bytes = weights.numel * target_map.itemsize
            if self.max_device_bytes is not None and device_bytes > self.max_device_bytes:
                raise LoRAError(lora.name_or_path, None, f"needs {device_bytes} bytes on the device, more than the "
                                                         f"LoRA cache budget ({self.max_device_bytes} bytes)")
            self._host[key] = weights
            self._counts["loads"] += 1
            return weights

    def check(self, lora: LoRA, target_map: TargetMap) -> None:
        """Refuse ``lora`` for this model with a :class:`LoRAError` naming the adapter and the key, or cache it."""
        self.host_adapter(lora, target_map)

    def preload(self, target_map: TargetMap) -> None:
        """Read and check every preloaded adapter now (a bad one fails at start-up, naming it)."""
        for name in self.list_modules():
            self.check(LoRA(name), target_map)

    # ------------------------------------------------------------------ device side
    def device_adapter(self, lora: LoRA, target_map: TargetMap, device: Any, dtype: Any,
                       keep: Iterable[tuple[Any, ...]] = ()) -> DeviceAdapter:
        """The device copy of ``lora`` (LRU: a hit moves it to the back; a miss copies it from host memory and
        evicts the oldest copies not in ``keep`` until the budget holds)."""
        path = self.resolve(lora)
        weights = self._host_adapter(lora, path, target_map, count=False)
        with self._lock:
            key = (path, self._raw[path][1], target_map.key, str(device), str(dtype))
            found = self._device.get(key)
            if found is not None:
                self._device.move_to_end(key)
                return found
            pin = getattr(device, "type", str(device).split(":")[0]) == "cuda"
            modules = {}
            for name, (a, b) in weights.modules.items():
                if pin and not a.is_pinned():
                    a, b = a.pin_memory(), b.pin_memory()
                    weights.modules[name] = (a, b)
                modules[name] = (a.to(device=device, dtype=dtype, non_blocking=pin),
                                 b.to(device=device, dtype=dtype, non_blocking=pin))
            nbytes = sum(x.numel() * x.element_size() for pair in modules.values() for x in pair)
            adapter = DeviceAdapter(key, lora.name_or_path, modules, nbytes)
            self._device[key] = adapter
            self._counts["uploads"] += 1
            self._evict(set(keep) | {key})
            return adapter

    def _evict(self, keep: set[tuple[Any, ...]]) -> None:
        if self.max_device_bytes is None:
            return
        for key in list(self._device):
            if self._device_bytes() <= self.max_device_bytes:
                return
            if key not in keep:
                del self._device[key]
                self._counts["evictions"] += 1

    def _device_bytes(self) -> int:
        return sum(a.nbytes for a in self._device.values())

    def on_device(self) -> list[str]:
        """Labels of the adapters with a device copy, least recently used first."""
        with self._lock:
            return [a.label for a in self._device.values()]

    def stats(self) -> dict[str, int]:
        """Counters for ``/metrics``: ``loads`` (files read and converted), ``hits`` (served from host memory),
        ``uploads`` (host -> device copies), ``evictions`` (device copies dropped), ``device_bytes``,
        ``host_bytes``, ``device_adapters``, ``host_adapters``."""
        with self._lock:
            return {**self._counts, "device_bytes": self._device_bytes(),
                    "host_bytes": sum(w.nbytes for w in self._host.values()),
                    "device_adapters": len(self._device), "host_adapters": len(self._host)}


__all__ = ["AdapterRegistry", "DeviceAdapter"]
