"""Loading the diffusers-style LingBot repository (models.md §2.6).

Layout: ``model_index.json``, ``transformer/`` (config.json + ``diffusion_pytorch_model*.safetensors``, single
file or sharded with an index), ``text_encoder/`` (transformers Qwen3-VL), ``processor/`` (tokenizer + image
processor), ``vae/`` (diffusers AutoencoderKLWan), ``scheduler/scheduler_config.json``. Our DiT is loaded
strictly: any missing, unexpected or mis-shaped weight is an error that names it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
from omnicore.errors import PluginError

from .detect import TRANSFORMER_CLASS

PLUGIN = "lingbot"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"

class CheckpointError(PluginError):
    """The checkpoint directory is not a usable LingBot repository (missing file, bad config)."""

    def __init__(self, path: Path | str, problem: str) -> None:
        self.path = Path(path)
        super().__init__(PLUGIN, f"{path}: {problem}")


class WeightMismatch(CheckpointError):
    """Strict loading failed: ``missing``, ``unexpected`` and ``mismatched`` (name: shapes) say what differs."""

    def __init__(self, path: Path | str, missing: Iterable[str], unexpected: Iterable[str],
                 mismatched: Iterable[str] = ()) -> None:
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = sorted(mismatched)
        parts = []
        for label, names in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("shape mismatch", self.mismatched)):
            if names:
                shown = ", ".join(names[:20]) + (f" (+{len(names) - 20} more)" if len(names) > 20 else "")
                parts.append(f"{label} weights: {shown}")
        super().__init__(path, "; ".join(parts))


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(path.parent, f"missing {path.name}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(path.parent, f"{path.name} is not valid JSON: {exc}") from None


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a diffusers component: the index's shards, else the single file."""
    index = model_dir / WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(model_dir, f"{WEIGHTS_INDEX_NAME} has no weight_map")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (model_dir / shard).is_file():
                raise CheckpointError(model_dir, f"shard {shard} named by {WEIGHTS_INDEX_NAME} is missing")
        return [model_dir / s for s in shards]
    single = model_dir / WEIGHTS_NAME
    if single.is_file():
        return [single]
    raise CheckpointError(model_dir, f"no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}")


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in weight_files(model_dir):
        for name, tensor in load_file(str(file)).items():
            if name in state:
                raise CheckpointError(model_dir, f"weight {name} appears in more than one shard")
            state[name] = tensor
    return state


def load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    """Copy ``state`` into ``model``; every expected tensor must be present with its exact shape, nothing more."""
    expected = model.state_dict()
    missing = set(expected) - set(state)
    unexpected = set(state) - set(expected)
    mismatched = [f"{k} (checkpoint {tuple(state[k].shape)}, model {tuple(v.shape)})"
                  for k, v in expected.items() if k in state and tuple(state[k].shape) != tuple(v.shape)]
    if missing or unexpected or mismatched:
        raise WeightMismatch(where, missing, unexpected, mismatched)
    model.load_state_dict(state, strict=True)


def cast_for_inference(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``dtype`` everywhere except the modules the DiT keeps in float32 (its own ``cast`` policy, §2.4)."""
    if dtype == torch.float32:
        return model.float()
    return cast(Any, model).cast(dtype)  # the DiT's own policy (LingBotTransformer.cast)


def load_transformer(model_dir: Path, *, device: torch.device, dtype: torch.dtype, attention: Any = None,
                     ops: Any = None) -> Any:
    """Build our DiT from ``config.json`` and load its safetensors strictly; ``ops`` is the platform's op table."""
    from .transformer.config import LingBotTransformerConfig
    from .transformer.model import LingBotVideoTransformer3DModel

    raw = read_json(model_dir / "config.json")
    try:
        config = LingBotTransformerConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(model_dir, f"bad transformer config: {exc}") from None
    model = LingBotVideoTransformer3DModel(config, attention=attention, ops=ops)
    load_strict(model, read_state_dict(model_dir), model_dir)
    return cast_for_inference(model, dtype).to(device).eval().requires_grad_(False)


def save_transformer(model: Any, model_dir: Path, *, max_shard_bytes: int | None = None) -> None:
    """Write ``config.json`` and the weights (sharded with an index when ``max_shard_bytes`` is given)."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    config = {"_class_name": TRANSFORMER_CLASS, **model.config.to_dict()}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if max_shard_bytes is None:
        save_file(state, str(model_dir / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(model_dir / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (model_dir / WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
