"""Where adapters come from and where they live: :class:`AdapterRegistry`.

A request names an adapter by a name the operator preloaded (``modules``, ``--lora-modules name=path``) or by a path
that must lie under one of ``lora_dirs`` once symlinks are resolved — nothing else is ever opened. Converted
adapters stay in host memory (pinned when they go to a CUDA device) in an LRU cache bounded by ``max_host_bytes``
(past it the least recently used is dropped and read from its file again when asked for); their device copies form
an LRU cache bounded by ``max_device_bytes``, which also counts the running batch's stacked slots
(:meth:`AdapterRegistry.reserve_batch`): the least recently used copy that the running batch does not need is
dropped first, and a later request copies it back from host memory without touching the file again.

Rank 0 of a worker group names each adapter of a batch by an :class:`AdapterRef` (the resolved path and the file
version it read), so every rank uploads exactly that version (:meth:`AdapterRegistry.device_adapter`).
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
from .formats import AdapterWeights, convert, read_adapter
from .records import LoRA
from .targets import TargetMap

#: host budget when none is given: converted adapters kept in RAM past it are dropped least recently used first
DEFAULT_MAX_HOST_BYTES = 8 * 1024**3


@attrs.frozen
class AdapterRef:
    """One adapter of a batch as rank 0 resolved it (picklable: announced to the worker ranks): ``label`` is what
    the request named, ``path`` the resolved file or directory, ``ident`` its version (``(mtime_ns, size)``)."""

    label: str
    path: str
    ident: tuple[int, int]
    scale: float


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
    :param max_device_bytes: budget of the device LRU cache and the running batch's stacked slots (``None``:
        unbounded). One adapter larger than the budget is refused; a batch needing more than the budget keeps its
        adapters and evicts the others.
    :param max_host_bytes: budget of the converted host copies (``None``: :data:`DEFAULT_MAX_HOST_BYTES`), so
        distinct files named under ``lora_dirs`` cannot grow host memory without bound. One adapter larger than it
        is refused.
    """

    def __init__(self, modules: Mapping[str, str] | None = None, lora_dirs: Sequence[str | os.PathLike[str]] = (),
                 max_device_bytes: int | None = None, max_host_bytes: int | None = None) -> None:
        modules = dict(modules or {})
        for name, path in modules.items():
            if not isinstance(name, str) or not name or "=" in name or name != name.strip():
                raise ConfigError("lora_modules", f"adapter names must be non-empty strings without '=', got {name!r}")
            if not Path(path).exists():
                raise ConfigError("lora_modules", f"adapter {name!r}: {path} does not exist")
        for field, value in (("max_lora_bytes", max_device_bytes), ("max_lora_host_bytes", max_host_bytes)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(field, f"must be a positive integer (bytes), got {value!r}")
        dirs = []
        for d in lora_dirs:
            resolved = Path(d).expanduser().resolve()
            if not resolved.is_dir():
                raise ConfigError("lora_dir", f"{d} is not a directory")
            dirs.append(resolved)
        self.modules: dict[str, Path] = {k: Path(v).expanduser().resolve() for k, v in modules.items()}
        self.lora_dirs: tuple[Path, ...] = tuple(dirs)
        self.max_device_bytes = max_device_bytes
        self.max_host_bytes = max_host_bytes if max_host_bytes is not None else DEFAULT_MAX_HOST_BYTES
        self._lock = threading.RLock()
        # path -> (file identity, generation); the generation keys the converted/device copies. The file's tensors
        # are not kept once converted (a conversion for another model reads the file again).
        self._versions: dict[Path, tuple[tuple[int, int], int]] = {}
        self._generation = 0
        # (path, generation, target map) -> converted, LRU oldest first
        self._host: OrderedDict[tuple[Any, ...], AdapterWeights] = OrderedDict()
        self._device: OrderedDict[tuple[Any, ...], DeviceAdapter] = OrderedDict()  # LRU, oldest first
        self._batch_bytes = 0  # the running batch's stacked slots (reserve_batch)
        self._counts = {"loads": 0, "hits": 0, "evictions": 0, "uploads": 0, "host_evictions": 0}

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
    def _version(self, label: str, path: Path) -> tuple[tuple[int, int], int]:
        """``(file identity, generation)`` of ``path`` now; a changed file gets a new generation and what came
        from its old version is dropped."""
        try:  # a directory's identity is its files' (rewriting adapter_model.safetensors is a new version)
            stats = [p.stat() for p in sorted(path.iterdir()) if p.is_file()] if path.is_dir() else [path.stat()]
            ident = (max((st.st_mtime_ns for st in stats), default=0), sum(st.st_size for st in stats))
        except OSError as exc:
            raise LoRAError(label, None, f"cannot be read: {exc}") from exc
        known = self._versions.get(path)
        if known is not None and known[0] == ident:
            return known
        self._generation += 1
        self._versions[path] = (ident, self._generation)
        if known is not None:  # the file changed: drop what came from its old version
            for key in [k for k in self._host if k[0] == path]:
                del self._host[key]
            for key in [k for k in self._device if k[0] == path]:
                del self._device[key]
        return self._versions[path]

    def host_adapter(self, lora: LoRA, target_map: TargetMap) -> AdapterWeights:
        """``lora`` read and converted for ``target_map`` (cached, counted as a hit; a changed file is read
        again and counted as a load)."""
        path = self.resolve(lora)
        with self._lock:
            _, generation = self._version(lora.name_or_path, path)
            return self._host_adapter(lora.name_or_path, path, generation, target_map, count=True)

    def ref(self, lora: LoRA, target_map: TargetMap) -> AdapterRef:
        """``lora`` resolved, read and checked now: the version every rank of a batch uploads."""
        path = self.resolve(lora)
        with self._lock:
            ident, generation = self._version(lora.name_or_path, path)
            self._host_adapter(lora.name_or_path, path, generation, target_map, count=False)
            return AdapterRef(lora.name_or_path, str(path), ident, lora.scale)

    def _host_adapter(self, label: str, path: Path, generation: int, target_map: TargetMap, *,
                      count: bool) -> AdapterWeights:
        key = (path, generation, target_map.key)
        weights = self._host.get(key)
        if weights is not None:
            self._host.move_to_end(key)
            self._counts["hits"] += int(count)
            return weights
        weights = convert(read_adapter(path, label), target_map)
        device_bytes = weights.numel * target_map.itemsize
        if self.max_device_bytes is not None and device_bytes > self.max_device_bytes:
            raise LoRAError(label, None, f"needs {device_bytes} bytes on the device, more than the "
                                         f"LoRA cache budget ({self.max_device_bytes} bytes)")
        if weights.nbytes > self.max_host_bytes:
            raise LoRAError(label, None, f"needs {weights.nbytes} bytes of host memory, more than the LoRA host "
                                         f"cache budget ({self.max_host_bytes} bytes)")
        self._host[key] = weights
        self._counts["loads"] += 1
        self._evict_host(key)
        return weights

    def _evict_host(self, keep: tuple[Any, ...]) -> None:
        total = sum(w.nbytes for w in self._host.values())
        for key in list(self._host):
            if total <= self.max_host_bytes:
                return
            if key != keep:
                total -= self._host.pop(key).nbytes
                self._counts["host_evictions"] += 1
                path = key[0]
                if not any(k[0] == path for k in (*self._host, *self._device)):
                    self._versions.pop(path, None)  # nothing of it is kept: forget its version too

    def check(self, lora: LoRA, target_map: TargetMap) -> None:
        """Refuse ``lora`` for this model with a :class:`LoRAError` naming the adapter and the key, or cache it."""
        self.host_adapter(lora, target_map)

    def preload(self, target_map: TargetMap) -> None:
        """Read and check every preloaded adapter now (a bad one fails at start-up, naming it)."""
        for name in self.list_modules():
            self.check(LoRA(name), target_map)

    # ------------------------------------------------------------------ device side
    def device_adapter(self, lora: LoRA | AdapterRef, target_map: TargetMap, device: Any, dtype: Any,
                       keep: Iterable[tuple[Any, ...]] = ()) -> DeviceAdapter:
        """The device copy of ``lora`` (LRU: a hit moves it to the back; a miss copies it from host memory and
        evicts the oldest copies not in ``keep`` until the budget holds). An :class:`AdapterRef` names the file
        and version rank 0 resolved (not resolved again; another version on disk is a :class:`LoRAError`).
        Under tensor parallelism (``target_map.shards``) the copy holds this rank's share: a column-parallel
        linear's ``B`` rows, a row-parallel linear's ``A`` columns."""
        if isinstance(lora, AdapterRef):
            label, path = lora.label, Path(lora.path)
        else:
            label, path = lora.name_or_path, self.resolve(lora)
        with self._lock:
            ident, generation = self._version(label, path)
            if isinstance(lora, AdapterRef) and ident != lora.ident:
                raise LoRAError(label, None, "changed on disk while the batch started (rank 0 read another "
                                             "version of it); the batch is not run with mixed versions")
            weights = self._host_adapter(label, path, generation, target_map, count=False)
            key = (path, generation, target_map.key, str(device), str(dtype))
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
                a, b = _local_share(a, b, target_map.shards.get(name))
                modules[name] = (a.to(device=device, dtype=dtype, non_blocking=pin),
                                 b.to(device=device, dtype=dtype, non_blocking=pin))
            nbytes = sum(x.numel() * x.element_size() for pair in modules.values() for x in pair)
            adapter = DeviceAdapter(key, label, modules, nbytes)
            self._device[key] = adapter
            self._counts["uploads"] += 1
            self._evict(set(keep) | {key})
            return adapter

    def reserve_batch(self, nbytes: int, keep: Iterable[tuple[Any, ...]]) -> None:
        """The running batch holds ``nbytes`` of stacked slots on the device (0: none): counted in the budget, so
        device copies the batch does not use (``keep``) are evicted until copies + slots fit."""
        with self._lock:
            self._batch_bytes = nbytes
            self._evict(set(keep))

    def _evict(self, keep: set[tuple[Any, ...]]) -> None:
        if self.max_device_bytes is None:
            return
        for key in list(self._device):
            if self._device_bytes() + self._batch_bytes <= self.max_device_bytes:
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
        ``uploads`` (host -> device copies), ``evictions`` (device copies dropped), ``host_evictions`` (host copies
        dropped), ``device_bytes`` (device copies), ``batch_bytes`` (the running batch's stacked slots, also on the
        device), ``host_bytes``, ``device_adapters``, ``host_adapters``."""
        with self._lock:
            return {**self._counts, "device_bytes": self._device_bytes(), "batch_bytes": self._batch_bytes,
                    "host_bytes": sum(w.nbytes for w in self._host.values()),
                    "device_adapters": len(self._device), "host_adapters": len(self._host)}


def _local_share(a: Any, b: Any, shard: tuple[str, tuple[tuple[int, int], ...]] | None) -> tuple[Any, Any]:
    """This tensor-parallel rank's share of ``(A [r, in], B [out, r])`` (the whole pair without a shard)."""
    if shard is None:
        return a, b
    from ..parallel.tensor_parallel import take_shard

    style, ranges = shard
    if style == "column":  # the linear holds these output rows: so does B
        return a, take_shard(b, 0, ranges).contiguous()
    return take_shard(a, 1, ranges).contiguous(), b  # row: these input columns, of A


__all__ = ["DEFAULT_MAX_HOST_BYTES", "AdapterRef", "AdapterRegistry", "DeviceAdapter"]
