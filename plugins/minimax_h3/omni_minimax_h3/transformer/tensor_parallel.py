"""Tensor parallelism of the MiniMax-H3 DiT (``--parallel tp=N``): its sharding plan, for its modules and for the
checkpoint layouts it loads from.

Megatron's placement, one all-reduce per attention and one per MLP: the fused ``qkv_proj`` is column-parallel in
three parts (rank ``r`` holds ``[Q_r; K_r; V_r]``, whole heads), ``out_proj`` row-parallel; the SwiGLU's ``fc1`` is
column-parallel in two parts (``[gate_r | up_r]``), ``fc2`` row-parallel. The token refiner's blocks are sharded the
same way. Everything else is replicated: the per-head q/k norms (they act on one head's channels), the patch and
condition projections, the time embedder, the final layer, and the AdaLN projections (about 40 % of the released
DiT's parameters; sharding them too is not done yet).

The checkpoint plans name the *stored* tensors, so each rank reads only its rows
(:func:`omnicore.plugin.read_sharded_state_dict`): diffusers' separate ``to_q`` / ``to_k`` / ``to_v`` are split on
their own and concatenated locally as ``[Q_r; K_r; V_r]``; its ``ff.net.0.proj`` (``[up | gate]``) in two parts,
then the halves are swapped locally; the official head-grouped ``qkv_proj`` (``[heads, 3, D]`` rows) in one part
(whole heads) and regrouped with this rank's head count.
"""

from __future__ import annotations

from omnicore.plugin import ShardRule, TensorParallelPlan

from .config import MiniMaxH3TransformerConfig

_ATTN_MLP = (ShardRule("*.attn.out_proj", "row"), ShardRule("*.mlp.fc1", "column", chunks=2),
             ShardRule("*.mlp.fc2", "row"))


def _divisors(config: MiniMaxH3TransformerConfig) -> tuple[tuple[str, int], ...]:
    return (("attention heads", config.num_attention_heads), ("FFN width", config.ffn_dim))


def module_plan(config: MiniMaxH3TransformerConfig) -> TensorParallelPlan:
    """The plan over :class:`~.model.MiniMaxH3DiT`'s module names (also what sizes a meta-device model)."""
    return TensorParallelPlan((ShardRule("*.attn.qkv_proj", "column", chunks=3), *_ATTN_MLP), _divisors(config))


def checkpoint_plan(config: MiniMaxH3TransformerConfig, fmt: str, qkv_layout: str = "head_grouped") -> (
        TensorParallelPlan):
    """The plan over the stored tensor names of a ``fmt`` (``"diffusers"`` / ``"official"``) checkpoint."""
    if fmt == "diffusers":
        rules = (ShardRule("*.attn.to_q", "column"), ShardRule("*.attn.to_k", "column"),
                 ShardRule("*.attn.to_v", "column"), ShardRule("*.attn.to_out.0", "row"),
                 ShardRule("*.ff.net.0.proj", "column", chunks=2), ShardRule("*.ff.net.2", "row"))
        return TensorParallelPlan(rules, _divisors(config))
    chunks = 1 if qkv_layout == "head_grouped" else 3
    return TensorParallelPlan((ShardRule("*.attn.qkv_proj", "column", chunks=chunks), *_ATTN_MLP), _divisors(config))


__all__ = ["checkpoint_plan", "module_plan"]
