"""Device memory for the model pool: budgets as text, resident bytes measured from a pipeline's own tensors,
and moving a pipeline's weights to host memory and back (the pool's ``offloaded`` state).

Resident bytes are counted from the parameters and buffers of the ``nn.Module``s a pipeline holds (its attributes,
and modules inside dicts, lists and tuples there), each storage once, on the pool's device. Tensors outside modules
(small tables) are not counted. A parameter that an engine-level offload (``offload="model"``/``"layerwise"``)
already keeps on the host has no device storage between forwards, so it counts 0 and is left alone by the swap.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..platforms.base import Platform

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")




def device_capacity(platform: Platform) -> int:
    """The memory of the platform's device: the accelerator's total memory, or the host's physical memory on the
    CPU platform (where "device" and "host" are the same memory)."""
    import torch

    device = platform.device()
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and module is not None and hasattr(module, "mem_get_info"):
        try:
            return int(module.mem_get_info(device)[1])
        except Exception:  # a platform without the query: fall through to the host's memory
            pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 40


def checkpoint_bytes(path: str | os.PathLike[str]) -> int:
    """Sum of the weight files under a checkpoint directory: the pool's estimate of a model's resident size
    before it was ever loaded (replaced by the measured size after the first load)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            if name.endswith(WEIGHT_SUFFIXES):
                try:
                    total += (Path(root) / name).stat().st_size
                except OSError:
                    continue
    return total


def pipeline_modules(pipeline: object, max_depth: int = 3) -> list[nn.Module]:
    """The ``nn.Module``s a pipeline holds, each once: its attributes, modules in dicts, lists and tuples there, and
    modules inside the plain objects it keeps (a text encoder wrapper holding ``.model``), up to ``max_depth``
    levels. omnicore's own records (the plugin host, the spec, the load options, the platform) are not entered."""
    from torch import nn

    found: dict[int, nn.Module] = {}
    seen: set[int] = set()

    def visit(value: object, depth: int) -> None:
        if id(value) in seen or value is None or isinstance(value, (str, bytes, int, float, bool)):
            return
        seen.add(id(value))
        if isinstance(value, nn.Module):
            found.setdefault(id(value), value)
            return
        if depth >= max_depth:
            return
        if isinstance(value, dict):
            children: Iterable[object] = value.values()
        elif isinstance(value, (list, tuple)):
            children = value
        elif type(value).__module__.startswith("omnicore") and depth > 0:
            return  # (records of the core: host, spec, options, platform)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            children = list(vars(value).values())
        else:
            return
        for child in list(children):
            visit(child, depth + 1)

    visit(pipeline, 0)
    return list(found.values())


def _tensors(pipeline: object) -> Iterator[torch.Tensor]:
    """Every parameter and buffer of the pipeline's modules, each tensor object once."""
    seen: set[int] = set()
    for module in pipeline_modules(pipeline):
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield tensor


def _distributed(t: torch.Tensor) -> bool:
    from ..offload._swap import is_distributed

    return is_distributed(t)


def resident_bytes(pipeline: object, device: torch.device | str) -> int:
    """Bytes of the pipeline's parameters and buffers stored on ``device`` (each storage counted once)."""
    import torch

    device = torch.device(device)
    storages: dict[tuple[int, int], int] = {}
    for t in _tensors(pipeline):
        if t.device.type != device.type or (device.index is not None and t.device.index not in (None, device.index)):
            continue
        if _distributed(t) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        storages[(storage.data_ptr(), t.device.index or 0)] = storage.nbytes()
    return sum(storages.values())


class HostSwap:
    """A pipeline's device-resident parameters and buffers moved to host memory (and back on :meth:`restore`).

    Parameter objects stay the same (hooks, caches and optimizers that hold them keep working); only their
    ``.data`` changes: host copies (pinned on CUDA, so the copy back is fast) while offloaded, device tensors
    again after :meth:`restore`. On the CPU platform the device *is* the host: the tensors themselves are kept
    aside (no copy) and the modules hold empty tensors, so the swap is cheap and the model counts 0 resident.
    """

    def __init__(self, pipeline: object, device: torch.device | str) -> None:
        import torch

        self.device = torch.device(device)
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor in the module, host tensor with its values)
        pin = self.device.type == "cuda"
        same = self.device.type == "cpu"
        with torch.no_grad():
            for t in _tensors(pipeline):
                if t.device.type != self.device.type or t.numel() == 0 or _distributed(t):
                    continue
                if same:
                    host = t.data
                else:
                    host = t.detach().to("cpu", copy=True)
                    if pin:
                        host = host.pin_memory()
                self._held.append((t, host))
                t.data = torch.empty(0, dtype=t.dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        """Host bytes the swapped-out tensors occupy."""
        return sum(h.numel() * h.element_size() for _, h in self._held)

    def restore(self) -> None:
        """Put every swapped tensor back on the device with its values (idempotent)."""
        import torch

        same = self.device.type == "cpu"
        with torch.no_grad():
            for t, host in self._held:
                t.data = host if same else host.to(self.device, non_blocking=True)
        if not same and self._held:
            module = getattr(torch, self.device.type, None)
            if module is not None and hasattr(module, "synchronize"):
                module.synchronize()
        self._held = []
