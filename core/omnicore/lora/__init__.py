"""Per-request LoRA adapters: mixed adapters in one batch, base weights never modified.

* :class:`LoRA` — one adapter on a request (``GenerationRequest.loras``); :class:`LoRATargets` — what a model
  declares adaptable (``ModelSpec.lora``).
* :class:`AdapterRegistry` — resolves names/paths (only under the allowed directories), reads and checks adapter
  files (:mod:`.formats`: PEFT/diffusers directories and kohya/A1111 single files, safetensors only), caches them
  (device LRU by bytes, host copies kept) and counts loads, hits and evictions.
* :class:`LoRARuntime` — hooks the model's adaptable linears and adds each row's delta through the platform op
  ``lora_segment_delta``; :func:`packed_rows` / :func:`sample_rows` tell it how rows map to samples,
  :func:`base_only` turns it off for a stage.
* :class:`LoRAError` — every refusal (a request error naming the adapter and the key).

Importing this package does not import torch.
"""

from __future__ import annotations

from typing import Any

from .._lazy import lazy_getattr

_LAZY = {
    "LoRA": "omnicore.lora.records:LoRA",
    "LoRATargets": "omnicore.lora.records:LoRATargets",
    "MAX_LORAS_PER_REQUEST": "omnicore.lora.records:MAX_LORAS_PER_REQUEST",
    "LoRAError": "omnicore.lora.errors:LoRAError",
    "AdapterRegistry": "omnicore.lora.registry:AdapterRegistry",
    "TargetMap": "omnicore.lora.targets:TargetMap",
    "LoRARuntime": "omnicore.lora.runtime:LoRARuntime",
    "packed_rows": "omnicore.lora.rows:packed_rows",
    "sample_rows": "omnicore.lora.rows:sample_rows",
    "base_only": "omnicore.lora.rows:base_only",
    "read_adapter": "omnicore.lora.formats:read_adapter",
    "convert": "omnicore.lora.formats:convert",
}

_lazy_attr = lazy_getattr(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    return _lazy_attr(name)


__all__ = sorted(_LAZY)
