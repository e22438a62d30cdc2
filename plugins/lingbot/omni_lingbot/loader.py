"""Loading the diffusers-style LingBot repository.

Layout: ``model_index.json``, ``transformer/`` (config.json + ``diffusion_pytorch_model*.safetensors``, single
file or sharded with an index), ``text_encoder/`` (transformers Qwen3-VL), ``processor/`` (tokenizer + image
processor), ``vae/`` (diffusers AutoencoderKLWan), ``scheduler/scheduler_config.json``. Our DiT is loaded
strictly (``omnicore.checkpoint``): any missing, unexpected or mis-shaped weight is a ``WeightMismatch`` that names
it, the plugin and the component folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import torch
from omnicore.plugin import (
    CheckpointError,
    WeightMismatch,
    load_strict,
    read_json,
    read_state_dict,
    refuse_library_quantized,
)

from .detect import TRANSFORMER_CLASS

PLUGIN = "lingbot"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
__all__ = ["PLUGIN", "WEIGHTS_INDEX_NAME", "WEIGHTS_NAME", "CheckpointError", "WeightMismatch", "cast_for_inference",
           "expert_read_plan", "load_transformer", "save_transformer"]

def cast_for_inference(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``dtype`` everywhere except the modules the DiT keeps in float32 (its own ``cast`` policy)."""
    if dtype == torch.float32:
        return model.float()
    return cast(Any, model).cast(dtype)  # the DiT's own policy (LingBotTransformer.cast)


def load_transformer(model_dir: Path, *, device: torch.device, dtype: torch.dtype, attention: Any = None,
                     ops: Any = None, ep: tuple[int, int] | None = None) -> Any:
    """Build our DiT from ``config.json`` and load its safetensors strictly; ``ops`` is the platform's op table.

    The DiT is built on the meta device and takes the checkpoint's tensors over (``load_strict(assign=True)``), so
    the weights exist once in host memory, never beside a randomly initialised copy. ``ep = (rank, degree)``
    (expert parallel): every MoE block is narrowed to that rank's contiguous ``1/degree`` of the routed experts
    before loading and only those experts' rows are read from the files (:func:`expert_read_plan`, safetensors
    slices: the other ranks' experts never leave the files); router and shared experts are read whole.
    ``model.tp_bytes_read`` then records the bytes this rank read, as the tensor-parallel loaders do."""
    from .transformer.config import LingBotTransformerConfig
    from .transformer.model import LingBotVideoTransformer3DModel

    part = model_dir.name  # "transformer" or "refiner": named in every error
    refuse_library_quantized(model_dir, plugin=PLUGIN, component=part)  # before the strict config parse
    raw = read_json(model_dir / "config.json", plugin=PLUGIN, component=part)
    try:
        config = LingBotTransformerConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(PLUGIN, model_dir, f"bad transformer config: {exc}", component=part) from None
    with torch.device("meta"):
        model = LingBotVideoTransformer3DModel(config, attention=attention, ops=ops)
    if ep is None:
        state = read_state_dict(model_dir, plugin=PLUGIN, component=part, weights_name=WEIGHTS_NAME)
    else:
        from omnicore.plugin import read_sharded_state_dict

        rank, degree = ep
        model.keep_expert_share(rank, degree)  # a dense DiT or a degree the experts refuse: ConfigError, nothing read
        state, read = read_sharded_state_dict(model_dir, expert_read_plan(), rank=rank, degree=degree,
                                              plugin=PLUGIN, component=part, weights_name=WEIGHTS_NAME)
        object.__setattr__(model, "tp_bytes_read", read)  # this rank's experts and the replicated tensors
    load_strict(model, state, plugin=PLUGIN, path=model_dir, component=part, assign=True)  # no second copy
    del state
    return cast_for_inference(model, dtype).to(device).eval().requires_grad_(False)


def expert_read_plan() -> Any:
    """The checkpoint read of an expert-parallel rank: each MoE block's stacked experts (``w1``, ``w3``, ``w2``:
    ``[E, ...]``) split along the expert dimension, so rank ``r`` of ``P`` reads experts
    ``[r E/P, (r+1) E/P)`` (the contiguous share ``LingBotMoE.keep_expert_share`` keeps); everything else whole."""
    from omnicore.plugin import ShardRule, TensorParallelPlan

    return TensorParallelPlan((ShardRule("blocks.*.ffn.experts", "column",
                                         params=(("w1", 0), ("w3", 0), ("w2", 0))),))


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
