"""LoRA adapters for HunyuanImage-3 in the released checkpoint's layout, converted to this model's modules.

An adapter trained on the release (its modelling code, e.g. with PEFT) names the release's modules and lays its
``lora_B`` rows out as the release lays the weights out. The core hands :func:`checkpoint_to_ours` every module's
``(A [r, in], B [out, r])`` (float32, ``alpha / r`` folded into ``B``, PEFT's ``base_model.model.`` stripped), and
this maps them exactly as :mod:`omni_hunyuan.loader` maps the base weights:

* ``self_attn.qkv_proj``: the release groups the fused rows per key/value head (``[q * groups, k, v]`` each);
  ``B``'s rows are ungrouped to our ``[Q; K; V]`` (``A`` is unchanged: the input side is not fused);
* ``gate_and_up_proj`` (the shared and dense MLPs): one linear with rows ``[up | gate]`` there, two linears here;
  its adapter becomes one adapter per half — the same ``A``, ``B``'s first half on ``up_proj``, its second half on
  ``gate_proj`` — which is exactly the fused delta split by rows;
* ``mlp.gate.wg`` (the router) is ours ``mlp.gate``, so an adapter on it is refused as not adaptable by name.

Routed experts (``mlp.experts.N.…``) keep their names and are refused (they are stacked weights here, and the
router picks them per token). A kohya / A1111 file is read like a PEFT file of the same names, flattened
(``lora_unet_model_layers_0_mlp_gate_and_up_proj``: the release's layout); :func:`kohya_names` lists the release's
fused MLP names the core reads such keys back to (its other names are ours).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .loader import split_up_gate, ungroup_qkv

Pair = tuple[torch.Tensor, torch.Tensor]

_FUSED_MLP = ".gate_and_up_proj"
_ROUTER = ".mlp.gate.wg"


def checkpoint_to_ours(modules: Mapping[str, Pair], config: Any) -> dict[str, Pair]:
    """``{module: (A, B)}`` in the release's names and layouts -> this model's modules (see the module docs).

    ``config`` is the model's config (key/value heads, query groups, head size); ``None`` is enough for adapters
    without a fused ``qkv_proj``. A ValueError names a module given twice or a fused ``B`` of odd size."""
    out: dict[str, Pair] = {}

    def put(name: str, pair: Pair) -> None:
        if name in out:
            raise ValueError(f"two adapters for module {name!r} (the fused and the split names mixed?)")
        out[name] = pair

    for name, (a, b) in modules.items():
        if name.endswith(".self_attn.qkv_proj") and ".experts." not in name:
            if config is None:
                raise ValueError(f"{name}: converting a fused qkv_proj adapter needs the model's config")
            b = ungroup_qkv(b, config.num_key_value_heads, config.groups, config.attention_head_dim)
            put(name, (a, b))
        elif name.endswith(_FUSED_MLP) and ".experts." not in name:
            if b.shape[0] % 2:
                raise ValueError(f"{name}: lora_B has {b.shape[0]} rows, not [up | gate] halves")
            gate, up = split_up_gate(b)
            base = name[: -len(_FUSED_MLP)]
            put(base + ".up_proj", (a, up.contiguous()))
            put(base + ".gate_proj", (a, gate.contiguous()))
        elif name.endswith(_ROUTER):
            put(name[: -len(".wg")], (a, b))
        else:
            put(name, (a, b))
    return out


def kohya_names(names: Iterable[str], config: Any) -> list[str]:
    """The release's fused ``gate_and_up_proj`` of every shared / dense MLP among our adaptable ``names``: the
    dotted names a kohya file trained on the release flattens beyond ours."""
    return sorted({name.rsplit(".", 1)[0] + _FUSED_MLP for name in names if name.endswith((".gate_proj", ".up_proj"))})


__all__ = ["checkpoint_to_ours", "kohya_names"]
