"""Loading and saving the single-repository checkpoint.

Files: ``config.json`` (with nested ``vae``/``vit``/``vit_processor``/``vit_aligner``), ``generation_config.json``,
the tokenizer, and safetensors shards (``model.safetensors.index.json`` + ``model-XXXXX-of-YYYYY.safetensors``,
or one ``model.safetensors``) with the release's names. Transforms on load (and their inverses on save):

- ``self_attn.qkv_proj.weight``: per key/value head ``[q * groups, k, v]`` rows -> ``[Q; K; V]``;
- ``gate_and_up_proj.weight`` (experts, shared and dense MLPs): rows ``[up | gate]`` -> ``up_proj``/``gate_proj``;
  routed experts are stacked into ``experts.w_gate/w_up/w_down [E, ...]``;
- ``mlp.gate.wg.weight`` -> ``mlp.gate.weight``; ``vision_model.head.*`` is dropped (unused).

Every parameter must be covered exactly once; missing and unexpected names are reported by their checkpoint
names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from omnicore.plugin import CheckpointError, weight_files
from torch import nn

PLUGIN = "hunyuan"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_and_up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.*)\.gate_and_up_proj\.weight$")
_QKV = re.compile(r"^model\.layers\.\d+\.self_attn\.qkv_proj\.weight$")
DROPPED_PREFIXES = ("vision_model.head.",)


def ungroup_qkv(weight: torch.Tensor, kv_heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Grouped ``[(kv, groups + 2, d), H]`` rows -> ``[Q; K; V]``."""
    w = weight.reshape(kv_heads, groups + 2, head_dim, -1)
    q = w[:, :groups].reshape(kv_heads * groups * head_dim, -1)
    k = w[:, groups].reshape(kv_heads * head_dim, -1)
    v = w[:, groups + 1].reshape(kv_heads * head_dim, -1)
    return torch.cat([q, k, v])


def group_qkv(weight: torch.Tensor, kv_heads: int, groups: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`ungroup_qkv`."""
    hidden = weight.shape[-1]
    nq = kv_heads * groups * head_dim
    q = weight[:nq].reshape(kv_heads, groups, head_dim, hidden)
    k = weight[nq: nq + kv_heads * head_dim].reshape(kv_heads, 1, head_dim, hidden)
    v = weight[nq + kv_heads * head_dim:].reshape(kv_heads, 1, head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def split_up_gate(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[up | gate]`` rows -> ``(gate, up)``."""
    up, gate = weight.chunk(2, dim=0)
    return gate, up


def shard_files(root: Path) -> list[Path]:
    """The shards named by ``model.safetensors.index.json``, else ``model.safetensors`` (omnicore.checkpoint)."""
    return weight_files(root, plugin=PLUGIN, weights_name=SINGLE)


def iter_checkpoint(root: Path, tp: tuple[int, int] | None = None,
                    experts: tuple[int, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stored tensor; with ``tp = (rank, degree)`` the split ones as that rank's rows only (safetensors
    slices, :func:`.tensor_parallel.checkpoint_plan`); with ``experts = (first, count)`` (expert parallel) the
    routed experts outside ``[first, first + count)`` are not read at all."""
    from safetensors import safe_open

    plan = None
    if tp is not None:
        from omnicore.plugin import local_ranges

        from .transformer.tensor_parallel import checkpoint_plan

        plan = checkpoint_plan()
    for path in shard_files(root):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                m = _EXPERT.match(key) if experts is not None else None
                if m is not None and experts is not None and not 0 <= int(m.group(2)) - experts[0] < experts[1]:
                    continue  # another expert-parallel rank's expert
                module, _, param = key.rpartition(".")
                split = None if plan is None else plan.param_split(module, param)
                if split is None or tp is None:
                    yield key, f.get_tensor(key)
                    continue
                view, (dim, sizes) = f.get_slice(key), split
                shape = view.get_shape()
                parts = [view[tuple(slice(a, b) if d == dim else slice(None) for d in range(len(shape)))]
                         for a, b in local_ranges(shape[dim], sizes, tp[0], tp[1])]
                yield key, parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def load_state(model: nn.Module, root: Path, tp: tuple[int, int] | None = None,
               ep: tuple[int, int] | None = None) -> None:
    """Copy the checkpoint under ``root`` into ``model`` (already built from its config), strictly.

    ``tp = (rank, degree)``: ``model`` holds that tensor-parallel rank's shapes (``shard_module``) and only its rows
    are read (the grouped qkv rows of its key/value heads, each expert's and MLP's rows / columns)."""
    cfg: Any = model.config  # the HunyuanImage3 model's config record
    kv_heads = cfg.num_key_value_heads // (1 if tp is None else tp[1])
    # expert parallel (``ep = (rank, degree)``): ``model`` holds experts [first, first + per) at slots 0..per-1
    per = cfg.num_experts // (1 if ep is None else ep[1])
    first = 0 if ep is None else ep[0] * per
    params = dict(model.named_parameters())
    needed: set[str] = set()
    for name, p in params.items():
        if name.endswith(("experts.w_gate", "experts.w_up", "experts.w_down")):
            needed.update(f"{name}#{e}" for e in range(p.shape[0]))
        else:
            needed.add(name)
    filled: set[str] = set()
    unexpected: list[str] = []
    expected_names: dict[str, str] = {}

    def put(target: str, value: torch.Tensor, source: str, index: int | None = None) -> None:
        key = target if index is None else f"{target}#{index}"
        if key not in needed:
            unexpected.append(source)
            return
        dest = params[target] if index is None else params[target][index]
        if tuple(dest.shape) != tuple(value.shape):
            raise CheckpointError(PLUGIN, root, f"{source} has shape {tuple(value.shape)}, the model expects "
                                                f"{tuple(dest.shape)} for {key}")
        with torch.no_grad():
            dest.copy_(value.to(dest.dtype))
        filled.add(key)
        expected_names[key] = source

    read = 0
    for name, tensor in iter_checkpoint(root, tp, None if ep is None else (first, per)):
        read += tensor.numel() * tensor.element_size()
        if name.startswith(DROPPED_PREFIXES):
            continue
        if _QKV.match(name):
            put(name, ungroup_qkv(tensor, kv_heads, cfg.groups, cfg.attention_head_dim), name)
            continue
        m = _EXPERT.match(name)
        if m:
            prefix, e, kind = m.group(1), int(m.group(2)) - first, m.group(3)
            if kind == "down_proj":
                put(f"{prefix}.experts.w_down", tensor, name, e)
            else:
                gate, up = split_up_gate(tensor)
                put(f"{prefix}.experts.w_gate", gate, name, e)
                put(f"{prefix}.experts.w_up", up, name, e)
            continue
        m = _FUSED.match(name)
        if m:
            gate, up = split_up_gate(tensor)
            put(f"{m.group(1)}.gate_proj.weight", gate, name)
            put(f"{m.group(1)}.up_proj.weight", up, name)
            continue
        put(name.replace(".mlp.gate.wg.", ".mlp.gate."), tensor, name)

    if tp is not None or ep is not None:
        object.__setattr__(model, "tp_bytes_read", read)  # this rank's shard and the replicated tensors
    missing = sorted(checkpoint_name(k) for k in needed - filled)
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {', '.join(missing[:12])}"
                        + (" ..." if len(missing) > 12 else ""))
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {', '.join(sorted(unexpected)[:12])}"
                        + (" ..." if len(unexpected) > 12 else ""))
    if problems:
        raise CheckpointError(PLUGIN, root, "the checkpoint does not match config.json: " + "; ".join(problems))


def checkpoint_name(internal: str) -> str:
    """The release name of an internal parameter (``#E`` marks a stacked expert slot)."""
    base, _, idx = internal.partition("#")
    if base.endswith(("experts.w_gate", "experts.w_up")):
        return base.rsplit(".", 1)[0] + f".{idx}.gate_and_up_proj.weight"
    if base.endswith("experts.w_down"):
        return base.rsplit(".", 1)[0] + f".{idx}.down_proj.weight"
    if base.endswith((".gate_proj.weight", ".up_proj.weight")):
        return base.rsplit(".", 2)[0] + ".gate_and_up_proj.weight"
    if re.match(r"^model\.layers\.\d+\.mlp\.gate\.weight$", base):
        return base.replace(".mlp.gate.", ".mlp.gate.wg.")
    return base


def export_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters under the release names and layouts (inverse of :func:`load_state`)."""
    cfg: Any = model.config  # the HunyuanImage3 model's config record
    out: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = dict(model.named_parameters())
    for name, t in state.items():
        t = t.detach().contiguous()
        if _QKV.match(name):
            out[name] = group_qkv(t, cfg.num_key_value_heads, cfg.groups, cfg.attention_head_dim)
        elif name.endswith("experts.w_down"):
            for e in range(t.shape[0]):
                out[checkpoint_name(f"{name}#{e}")] = t[e].clone()
        elif name.endswith("experts.w_gate"):
            up = state[name[: -len("w_gate")] + "w_up"]
            for e in range(t.shape[0]):
                out[checkpoint_name(f"{name}#{e}")] = torch.cat([up[e], t[e]]).contiguous()
        elif name.endswith("experts.w_up"):
            continue
        elif name.endswith(".gate_proj.weight"):
            up = state[name[: -len("gate_proj.weight")] + "up_proj.weight"]
            out[checkpoint_name(name)] = torch.cat([up, t]).contiguous()
        elif name.endswith(".up_proj.weight"):
            continue
        else:
            out[checkpoint_name(name)] = t
    return out


def save_checkpoint(model: nn.Module, root: Path, shards: int = 2) -> list[str]:
    """Write ``model`` as release-named safetensors shards plus the index; returns the shard file names."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    tensors = export_state(model)
    names = sorted(tensors)
    per = -(-len(names) // shards)
    files, weight_map = [], {}
    for i in range(shards):
        chunk = names[i * per:(i + 1) * per]
        if not chunk:
            continue
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in chunk}, str(root / fname), metadata={"format": "pt"})
        files.append(fname)
        weight_map.update({k: fname for k in chunk})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1,
                                         sort_keys=True) + "\n")
    return files


def read_safetensors_names(root: Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for path in shard_files(root):
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def describe(model: nn.Module) -> dict[str, Any]:
    """Parameter counts by top-level module (for logs)."""
    counts: dict[str, int] = {}
    for name, p in model.named_parameters():
        counts[name.split(".")[0]] = counts.get(name.split(".")[0], 0) + p.numel()
    return counts
