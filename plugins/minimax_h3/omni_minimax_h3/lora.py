"""LoRA adapters for MiniMax-H3 in the two layouts its weights are released in, converted to the fused DiT.

The core hands :func:`checkpoint_to_ours` every module's ``(A [r, in], B [out, r])`` (float32, ``alpha / r`` folded
into ``B``, PEFT/diffusers prefixes such as ``transformer.`` already stripped) and expects them under this DiT's
module names. Names are read as the checkpoint that uses them lays its weights out, exactly as
:mod:`omni_minimax_h3.loader` converts the base weights:

* **diffusers** (``MiniMaxH3Transformer3DModel``: ``transformer_blocks.N.attn.to_q/to_k/to_v``, ``attn.to_out.0``,
  ``ff.net.0.proj`` with rows ``[up | gate]``, ``ff.net.2``; ``token_refiner.refiner_blocks.N.…``): separate q/k/v
  adapters become one ``attn.qkv_proj`` adapter — their ``A`` stacked (ranks concatenated) and ``B`` block-diagonal
  over ``[Q; K; V]``, a projection the adapter leaves alone getting zero rows — which is exactly the sum of the
  three deltas; ``ff.net.0.proj``'s ``B`` rows are swapped to our ``[gate | up]``; the rest is a rename.
* **official** (the release's own names, which are ours: ``blocks.N.attn.qkv_proj``, ``mlp.fc1``, ...): the fused
  ``qkv_proj`` rows are grouped per head (``[heads, 3, D]``) there, so ``B``'s rows are regrouped to ``[Q; K; V]``;
  everything else is already ours.

A kohya / A1111 file is read like a PEFT file of the same names, flattened (``lora_unet_blocks_0_attn_qkv_proj``:
the release's layout; ``lora_transformer_transformer_blocks_0_attn_to_q``: diffusers'); :func:`kohya_names` lists
the diffusers names the core reads such keys back to.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .loader import _BLOCK_RENAMES, _DIFF_BLOCK, _OUR_BLOCK, _TOP_RENAMES, _regroup, _swap_halves

Pair = tuple[torch.Tensor, torch.Tensor]

_QKV = ("to_q", "to_k", "to_v")


def _rename(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A parameter-prefix rename table (``"attn.to_out.0." -> "attn.out_proj."``) applied to a module name."""
    dotted = name + "."
    for old, new in renames:
        if dotted.startswith(old):
            return (new + dotted[len(old):])[:-1]
    return name


def _fuse_qkv(parts: Mapping[str, Pair], out_features: int) -> Pair:
    """``to_q/to_k/to_v`` adapters (any subset) as one adapter of the fused ``[Q; K; V]`` projection."""
    some_a = next(iter(parts.values()))[0]
    inner = out_features // 3
    a_rows, col = [], 0
    b = some_a.new_zeros((out_features, sum(p[0].shape[0] for p in parts.values())))
    for i, key in enumerate(_QKV):
        if key not in parts:
            continue
        a_k, b_k = parts[key]
        if b_k.shape[0] != inner:
            raise ValueError(f"attn.{key} lora_B has {b_k.shape[0]} rows, the fused projection {inner} per part")
        rank = a_k.shape[0]
        a_rows.append(a_k)
        b[i * inner:(i + 1) * inner, col:col + rank] = b_k
        col += rank
    return torch.cat(a_rows, 0), b


def checkpoint_to_ours(modules: Mapping[str, Pair], config: Any) -> dict[str, Pair]:
    """``{module: (A, B)}`` in diffusers' or the release's names -> this DiT's modules (see the module docs).

    ``config`` is the DiT's :class:`~omni_minimax_h3.transformer.config.MiniMaxH3TransformerConfig` (head count
    and size of the fused projection). A ValueError names a module given twice or a part of the wrong size."""
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    out: dict[str, Pair] = {}
    qkv: dict[str, dict[str, Pair]] = {}

    def put(name: str, pair: Pair) -> None:
        if name in out:
            raise ValueError(f"two adapters for module {name!r} (diffusers and official names mixed?)")
        out[name] = pair

    for name, (a, b) in modules.items():
        m = _DIFF_BLOCK.match(name)
        if m is None:
            if name.endswith("attn.qkv_proj"):  # the release's head-grouped rows -> [Q; K; V]
                b = _regroup(b, heads, head_dim, to_grouped=False)
            put(_rename(name, _TOP_RENAMES), (a, b))
            continue
        group, idx, rest = m.groups()
        prefix = f"{'blocks' if group == 'transformer_blocks' else 'token_refiner.blocks'}.{idx}."
        if rest.startswith("attn.") and rest[5:] in _QKV:
            qkv.setdefault(prefix, {})[rest[5:]] = (a, b)
        elif rest == "ff.net.0.proj":  # diffusers' [up | gate] -> our [gate | up]
            put(prefix + "mlp.fc1", (a, _swap_halves(b)))
        else:
            put(prefix + _rename(rest, _BLOCK_RENAMES), (a, b))
    for prefix, parts in qkv.items():
        put(prefix + "attn.qkv_proj", _fuse_qkv(parts, 3 * heads * head_dim))
    return out


#: inside a block, our adaptable linear -> the diffusers module(s) it is made of
_DIFFUSERS_PARTS = {"attn.qkv_proj": ("attn.to_q", "attn.to_k", "attn.to_v"), "attn.out_proj": ("attn.to_out.0",),
                    "mlp.fc1": ("ff.net.0.proj",), "mlp.fc2": ("ff.net.2",)}


def kohya_names(names: Iterable[str], config: Any) -> list[str]:
    """The diffusers module names of our adaptable linears ``names`` (``transformer_blocks.N.attn.to_q``, ...): the
    dotted names a kohya file trained on diffusers' ``MiniMaxH3Transformer3DModel`` flattens (the release's names
    are ours, which the core knows already)."""
    out: list[str] = []
    for name in names:
        m = _OUR_BLOCK.match(name)
        if m is None:
            continue
        group, idx, rest = m.groups()
        prefix = f"{'transformer_blocks' if group == 'blocks' else 'token_refiner.refiner_blocks'}.{idx}."
        out.extend(prefix + part for part in _DIFFUSERS_PARTS.get(rest, ()))
    return out


__all__ = ["checkpoint_to_ours", "kohya_names"]
