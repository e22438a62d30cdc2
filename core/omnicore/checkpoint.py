"""Reading safetensors checkpoints and loading them strictly (shared by the model plugins).

A component folder (a diffusers ``transformer/``, ``vae/`` ...) holds a ``config.json`` and its weights as one
safetensors file or as shards named by a ``*.safetensors.index.json``. The functions here read those, and
:func:`load_strict` copies (or, with ``assign=True``, assigns into a meta-device model) a state dict where every
expected tensor must be present with its exact shape and nothing else may be. Every failure is a
:class:`CheckpointError` (a :class:`~omnicore.errors.PluginError`, so the engine and server report it as one)
naming the plugin, the component and the folder; :class:`WeightMismatch` lists the missing, unexpected and
mis-shaped tensors together.

torch and safetensors are imported only when weights are read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import PluginError

if TYPE_CHECKING:
    import torch

__all__ = ["CheckpointError", "WeightMismatch", "library_quantization", "load_strict", "read_json", "read_state_dict",
           "refuse_library_quantized", "weight_files"]

#: How many names of each kind a :class:`WeightMismatch` message shows (the attributes keep them all).
SHOWN_NAMES = 20


class CheckpointError(PluginError):
    """A checkpoint folder of ``plugin`` is unusable (missing file, bad JSON, missing shard ...).

    ``path`` is the file or folder concerned, ``component`` (optional) the part of the model it belongs to
    (``"transformer"``, ``"vae"`` ...), ``problem`` what is wrong.
    """

    def __init__(self, plugin: str, path: Path | str, problem: str, *, component: str | None = None) -> None:
        self.path = Path(path)
        self.component = component
        self.problem = problem
        where = f"{component} ({path})" if component else f"{path}"
        super().__init__(plugin, f"{where}: {problem}")


class WeightMismatch(CheckpointError):
    """Strict loading failed. ``missing`` (expected, not in the checkpoint), ``unexpected`` (in the checkpoint, not
    expected) and ``mismatched`` (``"name (checkpoint (..), model (..))"``) are sorted lists of every name."""

    def __init__(self, plugin: str, path: Path | str, missing: Iterable[str] = (), unexpected: Iterable[str] = (),
                 mismatched: Iterable[str] = (), *, component: str | None = None) -> None:
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = sorted(mismatched)
        parts = []
        for label, names in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("shape mismatch", self.mismatched)):
            if names:
                shown = ", ".join(names[:SHOWN_NAMES])
                if len(names) > SHOWN_NAMES:
                    shown += f" (+{len(names) - SHOWN_NAMES} more)"
                parts.append(f"{label} weights: {shown}")
        super().__init__(plugin, path, "; ".join(parts) or "weights differ", component=component)


def read_json(path: Path | str, *, plugin: str, component: str | None = None) -> dict[str, Any]:
    """The JSON object in ``path``; a missing file, invalid JSON or a non-object is a :class:`CheckpointError`
    on the file's folder."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(plugin, path.parent, f"missing {path.name}", component=component) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(plugin, path.parent, f"{path.name} is not valid JSON: {exc}",
                              component=component) from None
    if not isinstance(data, dict):
        raise CheckpointError(plugin, path.parent, f"{path.name} holds a {type(data).__name__}, not an object",
                              component=component)
    return data


def read_json_or_empty(path: Path | str) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` when the file is missing, unreadable, not JSON or not an object: for
    optional metadata (a layout probe, a provenance note) whose absence is no error."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def library_quantization(folder: Path | str) -> dict[str, Any] | None:
    """The ``quantization_config`` of a component folder's ``config.json``, or ``None``: diffusers and
    transformers write it when a model quantized by their ``from_pretrained(quantization_config=...)`` (torchao's
    ``TorchAoConfig``, bitsandbytes, GGUF ...) is saved, and their own ``from_pretrained`` loads it back quantized."""
    config = read_json_or_empty(Path(folder) / "config.json").get("quantization_config")
    return config if isinstance(config, dict) else None


def _quant_type(config: Mapping[str, Any]) -> str:
    """The quantization's name as the two libraries record it (``quant_type``: a string, a torchao config
    serialised as ``{"_type": ...}``, or transformers' ``{"default": {"_type": ...}}``)."""
    kind = config.get("quant_type")
    if isinstance(kind, Mapping):
        inner = kind.get("default", kind)
        kind = inner.get("_type") if isinstance(inner, Mapping) else None
    return str(kind) if kind else "unknown type"


def refuse_library_quantized(folder: Path | str, *, plugin: str, component: str | None = None) -> None:
    """A :class:`CheckpointError` when the folder holds a library-quantized component (:func:`library_quantization`).

    The plugins' own loaders read plain tensors and convert them (renamed, fused into one projection, regrouped
    by head, split per rank); a quantized weight is stored as its parts (torchao: ``<module>._weight_qdata`` /
    ``_weight_scale`` ..., described in the file's metadata), which those conversions do not take. The error
    names the component, the method and the two ways that work."""
    config = library_quantization(folder)
    if config is None:
        return
    method = config.get("quant_method", "unknown method")
    raise CheckpointError(plugin, folder, f"holds weights pre-quantized by {method} ({_quant_type(config)}; "
                                          "config.json quantization_config), which this loader cannot read: it "
                                          "converts plain tensors. Use the unquantized checkpoint with "
                                          "--quantization int8|fp8 (quantized at load), or omnicore's pre-quantized "
                                          "layout (<checkpoint>/quantized/<mode>/, written by "
                                          "omnicore.quantization.checkpoint.save_quantized)", component=component)


def _shards(index: Path, folder: Path, plugin: str, component: str | None) -> list[Path]:
    weight_map = read_json(index, plugin=plugin, component=component).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(plugin, folder, f"{index.name} has no weight_map", component=component)
    shards = sorted({str(name) for name in weight_map.values()})
    for shard in shards:
        if not (folder / shard).is_file():
            raise CheckpointError(plugin, folder, f"shard {shard} named by {index.name} is missing",
                                  component=component)
    return [folder / shard for shard in shards]


def weight_files(folder: Path | str, *, plugin: str, component: str | None = None,
                 weights_name: str | None = None) -> list[Path]:
    """The safetensors files of a component folder, in a stable order.

    With ``weights_name`` (e.g. ``"diffusion_pytorch_model.safetensors"``): the shards named by
    ``<weights_name>.index.json`` when it exists, else that single file (other files, such as diffusers'
    ``.fp16`` variants, are ignored). Without it: the shards of the folder's only ``*.safetensors.index.json``,
    else every ``*.safetensors`` file. Finding none, several indexes or a missing shard is a
    :class:`CheckpointError`, and so is a library-quantized folder (:func:`refuse_library_quantized`): every
    reader of raw tensors comes through here.
    """
    folder = Path(folder)
    refuse_library_quantized(folder, plugin=plugin, component=component)
    if weights_name is not None:
        index = folder / f"{weights_name}.index.json"
        if index.is_file():
            return _shards(index, folder, plugin, component)
        if (folder / weights_name).is_file():
            return [folder / weights_name]
        raise CheckpointError(plugin, folder, f"no {weights_name} or {index.name}", component=component)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(plugin, folder, f"several safetensors indexes: {[p.name for p in indexes]}",
                              component=component)
    if indexes:
        return _shards(indexes[0], folder, plugin, component)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(plugin, folder, "no safetensors weights (*.safetensors or a "
                                              "*.safetensors.index.json)", component=component)
    return files


def read_state_dict(folder: Path | str, *, plugin: str, component: str | None = None,
                    weights_name: str | None = None, prefix: str | None = None,
                    keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a component folder (files as :func:`weight_files` finds them) on the CPU.

    ``prefix``: only names starting with it, returned with the prefix removed (``"vae."`` of a single-file
    checkpoint). ``keys``: only these names (after the prefix is removed); every one must be present, else a
    :class:`WeightMismatch` lists the absent ones. A name in more than one shard is a :class:`CheckpointError`.
    """
    from safetensors import safe_open

    folder = Path(folder)
    wanted = None if keys is None else set(keys)
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(folder, plugin=plugin, component=component, weights_name=weights_name):
        with safe_open(str(file), framework="pt") as handle:
            for stored in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                if prefix is not None and not stored.startswith(prefix):
                    continue
                name = stored[len(prefix):] if prefix else stored
                if wanted is not None and name not in wanted:
                    continue
                if name in state:
                    raise CheckpointError(plugin, folder, f"weight {stored} appears in more than one shard",
                                          component=component)
                state[name] = aligned(handle.get_tensor(stored))
    if wanted is not None and wanted - set(state):
        raise WeightMismatch(plugin, folder, missing=wanted - set(state), component=component)
    return state


#: The CPU allocator's alignment: SIMD kernels may sum in another order on a tensor that starts elsewhere.
ALIGNMENT = 64


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it in fresh (``ALIGNMENT``-byte aligned) storage when its data does not start on
    such a boundary. safetensors hands out tensors at an offset inside a buffer, so a model that takes them over
    (``load_strict(assign=True)``) would compute with kernels whose results depend on where each weight happens
    to sit in the file; a copy per tensor (freed at once) keeps the numerics those of a model loaded by copy."""
    if tensor.device.type != "cpu" or tensor.data_ptr() % ALIGNMENT == 0:
        return tensor
    import torch

    return torch.empty_like(tensor).copy_(tensor)


def load_strict(module: torch.nn.Module, state: Mapping[str, torch.Tensor], *, plugin: str, path: Path | str,
                component: str | None = None, assign: bool = False) -> None:
    """Load ``state`` into ``module``: every entry of ``module.state_dict()`` must be in ``state`` with its exact
    shape, and nothing else may be; otherwise a :class:`WeightMismatch` (``path``: the folder it came from) names
    them all and ``module`` is left untouched. ``assign=True`` takes the tensors over instead of copying (for a
    module built on the meta device: no second copy of the weights)."""
    expected = module.state_dict()
    missing = set(expected) - set(state)
    unexpected = set(state) - set(expected)
    mismatched = [f"{k} (checkpoint {tuple(state[k].shape)}, model {tuple(v.shape)})"
                  for k, v in expected.items() if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if missing or unexpected or mismatched:
        raise WeightMismatch(plugin, path, missing, unexpected, mismatched, component=component)
    module.load_state_dict(dict(state), strict=True, assign=assign)
