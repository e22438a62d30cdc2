"""LoRA for the generic adapter through diffusers' own ``load_lora_weights`` / ``set_adapters``.

The dedicated plugins add each row's adapter delta unmerged, so one batch may mix adapters. A stock diffusers
pipeline applies adapters to its modules (PEFT layers), one active set per call, so here a batch shares one adapter
set: the adapter set is part of the batch key, and before each call the set is activated (``set_adapters`` with the
request's scales) or LoRA is disabled for a batch without adapters (the base weights are never fused).

:meth:`DiffusersAdapters.check` runs in the submitting thread while another batch may be running: it only reads
(the file, diffusers' conversion of its keys, the module tree) and refuses a bad adapter with a ``LoRAError``
naming the adapter and the key before the request is queued. Loading into the pipeline happens in
:meth:`activate`, on the engine's worker between batches. The module tables ``check`` reads are taken once per
component under the same lock the worker holds while PEFT injects or deletes layers, so a check never walks a tree
that is being rewritten. At most :data:`MAX_LOADED` adapters stay loaded (least recently used ones are deleted from
the pipeline; they are read again when asked for); a loaded adapter is keyed by its file's path, modification time
and size, so a file rewritten in place is read again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omnicore.plugin import GenerationRequest, LoRA, LoRAError

#: adapters kept loaded in the pipeline at once
MAX_LOADED = 8
#: the file diffusers' ``save_lora_weights`` writes
DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def weights_file(label: str, path: Path) -> Path:
    """The safetensors file of an adapter given as a file or a directory (diffusers' own file name, or the only
    ``.safetensors`` file in it)."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise LoRAError(label, None, f"{path.name} is not a .safetensors file (only safetensors are read)")
        return path
    own = path / DEFAULT_WEIGHT_NAME
    if own.is_file():
        return own
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found[0]
    raise LoRAError(label, None, f"{path} holds {len(found)} .safetensors files; the adapter needs exactly one "
                                 f"(or {DEFAULT_WEIGHT_NAME})")


class DiffusersAdapters:
    """The adapters of one diffusers pipeline: checked at submit, loaded and activated per batch."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self._files: dict[str, Path] = {}  # request label -> its checked weights file
        # (weights file, mtime_ns, size) -> adapter name in the pipeline (LRU)
        self._loaded: OrderedDict[tuple[Path, int, int], str] = OrderedDict()
        self._counter = 0
        self._lock = threading.Lock()
        self._tree = threading.Lock()  # the module trees: PEFT rewrites them in _load while check reads them
        self._tables: dict[str, dict[str, Any]] = {}
        self.loads = 0

    @property
    def supported(self) -> bool:
        return callable(getattr(self.pipe, "load_lora_weights", None))

    # ------------------------------------------------------------------ submit side (read only)
    def check(self, loras: Sequence[LoRA], registry: Any) -> None:
        for lora in loras:
            label = lora.name_or_path
            if not self.supported:
                raise LoRAError(label, None, f"{type(self.pipe).__name__} has no LoRA loader (load_lora_weights)")
            file = weights_file(label, registry.resolve(lora))
            try:
                state = self.pipe.lora_state_dict(str(file.parent), weight_name=file.name)
            except Exception as exc:  # diffusers' conversion names what it could not map
                raise LoRAError(label, None, f"diffusers cannot read it as a LoRA of {type(self.pipe).__name__}: "
                                             f"{exc}") from exc
            if isinstance(state, tuple):
                state = state[0]
            self._check_keys(label, state)
            with self._lock:
                self._files[label] = file

    def _check_keys(self, label: str, state: dict[str, Any]) -> None:
        """Every ``<component>.<module>.lora_A/B`` key names a linear the pipeline has, with matching shapes."""
        modules: dict[str, dict[str, Any]] = {}
        for key, tensor in state.items():
            component, _, rest = key.partition(".")
            owner = getattr(self.pipe, component, None)
            if owner is None or not hasattr(owner, "named_modules"):
                raise LoRAError(label, key, f"names component {component!r}, which "
                                            f"{type(self.pipe).__name__} does not have")
            for marker, side in ((".lora_A.", "A"), (".lora_B.", "B")):
                if marker in f".{rest}":
                    name = f".{rest}".split(marker)[0].lstrip(".")
                    table = modules.setdefault(component, self._table(component, owner))
                    module = table.get(name)
                    if module is None:
                        raise LoRAError(label, key, f"targets {component}.{name}, which the model does not have")
                    shape = tuple(getattr(tensor, "shape", ()))
                    fan_in, fan_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
                    if side == "A" and fan_in is not None and len(shape) == 2 and shape[1] != fan_in:
                        raise LoRAError(label, key, f"has shape {shape}; {component}.{name} takes {fan_in} inputs")
                    if side == "B" and fan_out is not None and len(shape) == 2 and shape[0] != fan_out:
                        raise LoRAError(label, key, f"has shape {shape}; {component}.{name} has {fan_out} outputs")

    def _table(self, component: str, owner: Any) -> dict[str, Any]:
        """``owner.named_modules()`` as first seen (taken while no adapter is being injected). Injected PEFT layers
        wrap the original linears, which keep their names' fan-in and fan-out, so the first table stays valid."""
        with self._tree:
            if component not in self._tables:
                self._tables[component] = dict(owner.named_modules())
            return self._tables[component]

    # ------------------------------------------------------------------ worker side (between batches)
    def activate(self, requests: Sequence[GenerationRequest]) -> None:
        """Make the batch's adapter set (equal for every request: it is in the batch key) the active one."""
        loras = requests[0].loras if requests else ()
        if not loras:
            if self._loaded:
                self.pipe.disable_lora()
            return
        names = [self._load(self._file(lora)) for lora in loras]
        self.pipe.enable_lora()
        self.pipe.set_adapters(names, adapter_weights=[lora.scale for lora in loras])

    def _file(self, lora: LoRA) -> Path:
        with self._lock:
            file = self._files.get(lora.name_or_path)
        if file is None:  # check() runs at submit; a pipeline driven directly must call it first
            raise LoRAError(lora.name_or_path, None, "was not checked before the batch (call check_loras first)")
        return file

    def _load(self, file: Path) -> str:
        stat = file.stat()
        version = (file, stat.st_mtime_ns, stat.st_size)
        name = self._loaded.get(version)
        if name is not None:
            self._loaded.move_to_end(version)
            return name
        with self._tree:
            for stale in [v for v in self._loaded if v[0] == file]:  # the file was rewritten: drop what it held
                self.pipe.delete_adapters(self._loaded.pop(stale))
            while len(self._loaded) >= MAX_LOADED:
                _, old = self._loaded.popitem(last=False)
                self.pipe.delete_adapters(old)
            name = f"omnicore_{self._counter}"
            self._counter += 1
            self.pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=name)
        self._loaded[version] = name
        self.loads += 1
        return name

    def key(self, request: GenerationRequest) -> tuple[tuple[str, float], ...]:
        """The request's adapter set as it enters the batch key."""
        return tuple((lora.name_or_path, lora.scale) for lora in request.loras)
