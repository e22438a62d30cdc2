"""Loading the MiniMax-H3 DiT from either checkpoint layout, strictly.

Two layouts of a transformer folder (``config.json`` + safetensors, single file or sharded with an index):

- **diffusers** (what ``MiniMaxH3Transformer3DModel.save_pretrained`` writes; the repository's ``transformer/``
  = FL2VA and ``transformer_ref/`` = Ref2VA): ``transformer_blocks.N.attn.to_q/to_k/to_v`` (separate),
  ``norm_q/norm_k``, ``to_out.0``, ``ff.net.0.proj`` rows ``[up | gate]``, ``ff.net.2``, ``proj_in``, ...
- **official** (the partition layout: ``FL2VA/transformer/``, ``Ref2VA/transformer/``): our own names —
  ``blocks.N.attn.qkv_proj`` fused and **head-grouped** (``[heads × (q, k, v), H]``; ``qkv_layout="qkv"`` for a
  checkpoint already ``[Q; K; V]``), ``mlp.fc1`` rows ``[gate | up]``, optional ``rope.inv_freq``.

Our DiT keeps the official names with ``qkv_proj`` as ``[Q; K; V]`` and ``fc1`` as ``[gate | up]``. The model is
built on the meta device from ``config.json`` and the converted tensors are assigned (no second copy of the
weights); every missing, unexpected or mis-shaped key is named in :class:`WeightMismatch`. diffusers'
``from_pretrained`` is never used (it would need ``accelerate``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omnicore.plugin import (
    CheckpointError,
    WeightMismatch,
    load_strict,
    read_json,
    read_state_dict,
    refuse_library_quantized,
    weight_files,
)

from .transformer.config import NATIVE_ALIASES, MiniMaxH3TransformerConfig

PLUGIN = "minimax_h3"
DIFFUSERS_CLASS = "MiniMaxH3Transformer3DModel"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX_NAME = "diffusion_pytorch_model.safetensors.index.json"
FORMATS = ("diffusers", "official")
__all__ = ["PLUGIN", "CheckpointError", "WeightMismatch", "detect_transformer_format", "diffusers_to_ours",
           "load_transformer", "official_to_ours", "ours_to_diffusers", "ours_to_official", "read_transformer_config",
           "save_transformer", "transformer_dirs"]


# ---------------------------------------------------------------------------------------------- files
def read_transformer_config(model_dir: Path) -> MiniMaxH3TransformerConfig:
    model_dir = Path(model_dir)
    refuse_library_quantized(model_dir, plugin=PLUGIN, component=model_dir.name)  # before the strict parse
    raw = read_json(model_dir / "config.json", plugin=PLUGIN, component=model_dir.name)
    return MiniMaxH3TransformerConfig.from_dict(raw)


def detect_transformer_format(model_dir: Path) -> str:
    """``"diffusers"`` or ``"official"`` from the config class name, else from the weight names."""
    model_dir = Path(model_dir)
    raw = read_json(model_dir / "config.json", plugin=PLUGIN, component=model_dir.name)
    if raw.get("_class_name") == DIFFUSERS_CLASS:
        return "diffusers"
    from safetensors import safe_open

    with safe_open(str(weight_files(model_dir, plugin=PLUGIN, component=model_dir.name)[0]), framework="pt") as f:
        names = list(f.keys())
    if any(n.startswith(("transformer_blocks.", "proj_in.")) for n in names):
        return "diffusers"
    if any(n.startswith(("blocks.", "video_patch_proj.")) for n in names):
        return "official"
    raise CheckpointError(PLUGIN, model_dir, "cannot tell the checkpoint layout (neither diffusers nor official "
                                             "names)", component=model_dir.name)


def transformer_dirs(root: Path) -> dict[str, Path]:
    """The transformer folders of a repository by partition (``"fl2va"``, ``"ref2va"``), for every layout
    (:func:`omni_minimax_h3.repository.transformer_folders`): official ``FL2VA/transformer/`` +
    ``Ref2VA/transformer/``; diffusers ``transformer/`` (FL2VA, or the partition its index names under
    ``_minimax_h3.partition``) + ``transformer_ref/`` (Ref2VA)."""
    from .repository import transformer_folders

    return transformer_folders(root)


# ---------------------------------------------------------------------------------------------- transforms
_TOP_RENAMES = (  # diffusers prefix -> ours
    ("proj_in.", "video_patch_proj."),
    ("audio_proj_in.", "audio_patch_proj."),
    ("context_embedder.", "condition_proj."),
    ("time_embedder.linear_1.", "time_embedder.proj_in."),
    ("time_embedder.linear_2.", "time_embedder.proj_out."),
    ("norm_out.linear.", "final_layer.adaln_proj.linear."),
    ("norm_out.norm.", "final_layer.norm."),
    ("proj_out.", "final_layer.video_out."),
    ("audio_proj_out.", "final_layer.audio_out."),
    ("token_refiner.final_norm.", "token_refiner.final_norm."),
)
_BLOCK_RENAMES = (  # inside a block, diffusers -> ours (q/k/v and ff.net.0 handled separately)
    ("attn.norm_q.", "attn.q_norm."),
    ("attn.norm_k.", "attn.k_norm."),
    ("attn.to_out.0.", "attn.out_proj."),
    ("ff.net.2.", "mlp.fc2."),
    ("norm1.", "norm1."),
    ("norm2.", "norm2."),
    ("adaln_proj.linear.", "adaln_proj.linear."),
)
_DIFF_BLOCK = re.compile(r"^(transformer_blocks|token_refiner\.refiner_blocks)\.(\d+)\.(.*)$")
_OUR_BLOCK = re.compile(r"^(blocks|token_refiner\.blocks)\.(\d+)\.(.*)$")


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    a, b = w.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def diffusers_to_ours(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a diffusers state dict to ours: fuse q/k/v as ``[Q; K; V]``, ``[up | gate]`` -> ``[gate | up]``.

    Unknown names pass through unchanged (strict loading then reports them as unexpected); a block with only
    some of ``to_q/to_k/to_v`` keeps them under their own names so the gap is reported too.
    """
    src = dict(state)
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name in list(src):
        tensor = src.pop(name)
        m = _DIFF_BLOCK.match(name)
        if m is None:
            for old, new in _TOP_RENAMES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            out[name] = tensor
            continue
        group, idx, rest = m.groups()
        prefix = f"{'blocks' if group == 'transformer_blocks' else 'token_refiner.blocks'}.{idx}."
        if rest in ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight"):
            qkv.setdefault(prefix, {})[rest[5:9]] = tensor
            continue
        if rest == "ff.net.0.proj.weight":
            out[prefix + "mlp.fc1.weight"] = _swap_halves(tensor)
            continue
        for old, new in _BLOCK_RENAMES:
            if rest.startswith(old):
                rest = new + rest[len(old):]
                break
        out[prefix + rest] = tensor
    for prefix, parts in qkv.items():
        if set(parts) == {"to_q", "to_k", "to_v"}:
            out[prefix + "attn.qkv_proj.weight"] = torch.cat([parts["to_q"], parts["to_k"], parts["to_v"]], dim=0)
        else:
            for key, tensor in parts.items():
                out[f"{prefix}attn.{key}.weight"] = tensor
    return out


def ours_to_diffusers(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`diffusers_to_ours`."""
    inv_top = [(new, old) for old, new in _TOP_RENAMES]
    inv_block = [(new, old) for old, new in _BLOCK_RENAMES]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        m = _OUR_BLOCK.match(name)
        if m is None:
            for new, old in inv_top:
                if name.startswith(new):
                    name = old + name[len(new):]
                    break
            out[name] = tensor
            continue
        group, idx, rest = m.groups()
        prefix = f"{'transformer_blocks' if group == 'blocks' else 'token_refiner.refiner_blocks'}.{idx}."
        if rest == "attn.qkv_proj.weight":
            q, k, v = tensor.chunk(3, dim=0)
            out.update({prefix + "attn.to_q.weight": q.contiguous(), prefix + "attn.to_k.weight": k.contiguous(),
                        prefix + "attn.to_v.weight": v.contiguous()})
            continue
        if rest == "mlp.fc1.weight":
            out[prefix + "ff.net.0.proj.weight"] = _swap_halves(tensor)
            continue
        for new, old in inv_block:
            if rest.startswith(new):
                rest = old + rest[len(new):]
                break
        out[prefix + rest] = tensor
    return out


def _regroup(w: torch.Tensor, heads: int, head_dim: int, *, to_grouped: bool) -> torch.Tensor:
    hidden = w.shape[-1]
    if w.shape[0] != 3 * heads * head_dim:
        return w  # leave it: strict loading names the mis-shaped tensor
    if to_grouped:  # [3, heads, D, H] -> [heads, 3, D, H]
        return w.view(3, heads, head_dim, hidden).transpose(0, 1).reshape(-1, hidden).contiguous()
    return w.view(heads, 3, head_dim, hidden).transpose(0, 1).reshape(-1, hidden).contiguous()


def official_to_ours(state: Mapping[str, torch.Tensor], config: MiniMaxH3TransformerConfig, *,
                     qkv_layout: str = "head_grouped", heads: int | None = None) -> dict[str, torch.Tensor]:
    """Official names are ours; reorder the head-grouped fused qkv to ``[Q; K; V]`` and drop ``rope.inv_freq``
    (checked against the config's frequencies). ``qkv_layout``: ``"head_grouped"`` (the release) or ``"qkv"``.
    ``heads``: the heads the tensors hold (a tensor-parallel rank's share; default all of them)."""
    if qkv_layout not in ("head_grouped", "qkv"):
        raise ValueError(f"qkv_layout must be 'head_grouped' or 'qkv', got {qkv_layout!r}")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "rope.inv_freq":
            from .transformer.rope import inverse_frequencies

            want = inverse_frequencies(config.rope_freq_dim, config.rope_theta)
            if tensor.shape != want.shape or not torch.allclose(tensor.float(), want, rtol=1e-6, atol=0):
                raise CheckpointError(PLUGIN, "rope.inv_freq", "checkpoint frequencies differ from rope_freq_dim="
                                      f"{config.rope_freq_dim}, rope_theta={config.rope_theta}")
            continue
        if name.endswith("attn.qkv_proj.weight") and qkv_layout == "head_grouped":
            tensor = _regroup(tensor, heads or config.num_attention_heads, config.attention_head_dim,
                              to_grouped=False)
        out[name] = tensor
    return out


def ours_to_official(state: Mapping[str, torch.Tensor], config: MiniMaxH3TransformerConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`official_to_ours` (head-grouped qkv)."""
    return {n: (_regroup(t, config.num_attention_heads, config.attention_head_dim, to_grouped=True)
                if n.endswith("attn.qkv_proj.weight") else t) for n, t in state.items()}


# ---------------------------------------------------------------------------------------------- load / save
def load_transformer(model_dir: Path | str, *, device: Any = "cpu", dtype: torch.dtype = torch.float32,
                     attention: Any = None, ops: Any = None, format: str | None = None,
                     qkv_layout: str = "head_grouped", tp: tuple[int, int] | None = None) -> Any:
    """Our DiT from a transformer folder of either layout (``format`` detected when None), strictly.

    ``tp = (rank, degree)``: only that tensor-parallel rank's shard is read (safetensors slices; the other rows
    never leave the file) into a DiT whose sharded linears have their local shapes
    (:mod:`.transformer.tensor_parallel`); ``model.tp_bytes_read`` records the bytes read. The model's
    :meth:`~.transformer.model.MiniMaxH3DiT.enable_tensor_parallel` then joins the shards up."""
    from .transformer.model import MiniMaxH3DiT

    model_dir = Path(model_dir)
    part = model_dir.name  # "transformer" or "transformer_ref": named in every error
    try:
        config = read_transformer_config(model_dir)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(PLUGIN, model_dir, f"bad transformer config: {exc}", component=part) from None
    fmt = format or detect_transformer_format(model_dir)
    if fmt not in FORMATS:
        raise CheckpointError(PLUGIN, model_dir, f"format must be one of {FORMATS}, got {fmt!r}", component=part)
    heads = None
    if tp is None:
        state = read_state_dict(model_dir, plugin=PLUGIN, component=part)
    else:
        from omnicore.plugin import read_sharded_state_dict

        from .transformer.tensor_parallel import checkpoint_plan

        rank, degree = tp
        state, read = read_sharded_state_dict(model_dir, checkpoint_plan(config, fmt, qkv_layout), rank=rank,
                                              degree=degree, plugin=PLUGIN, component=part)
        heads = config.num_attention_heads // degree
    state = diffusers_to_ours(state) if fmt == "diffusers" else official_to_ours(state, config, qkv_layout=qkv_layout,
                                                                                 heads=heads)
    with torch.device("meta"):
        model = MiniMaxH3DiT(config, attention=attention, ops=ops)
    if tp is not None:
        from omnicore.plugin import shard_module

        from .transformer.tensor_parallel import module_plan

        shard_module(model, module_plan(config), rank=tp[0], degree=tp[1])
        object.__setattr__(model, "tp_bytes_read", read)  # bytes this rank read from the files
    load_strict(model, state, plugin=PLUGIN, path=model_dir, component=part, assign=True)  # no second copy
    del state
    model.rope.reset_parameters()
    if dtype == torch.float32:
        model.float()
    else:
        model.cast(dtype)
    return model.to(device).eval().requires_grad_(False)


def save_transformer(model: Any, model_dir: Path | str, *, format: str = "diffusers") -> Path:
    """Write ``config.json`` + ``diffusion_pytorch_model.safetensors`` in the diffusers or the official layout."""
    from safetensors.torch import save_file

    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    config: MiniMaxH3TransformerConfig = model.config
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if format == "diffusers":
        state = ours_to_diffusers(state)
        raw = {"_class_name": DIFFUSERS_CLASS, **config.to_dict()}
    else:
        state = ours_to_official(state, config)
        native = {v: k for k, v in NATIVE_ALIASES.items()}
        raw = {native.get(k, k): v for k, v in config.to_dict().items()}
        h = config.hidden_size
        raw.update(adaln_out_features=18 * h, final_adaln_out_features=2 * h)
    (model_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in state.items()}, str(model_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    return model_dir
