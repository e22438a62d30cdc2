"""Tensor parallelism of the MiniMax-H3 DiT (``--parallel tp=N``): its sharding plan, for its modules and for the
checkpoint layouts it loads from.

Megatron's placement, one all-reduce per attention and one per MLP: the fused ``qkv_proj`` is column-parallel in
three parts (rank ``r`` holds ``[Q_r; K_r; V_r]``, whole heads), ``out_proj`` row-parallel; the SwiGLU's ``fc1`` is
column-parallel in two parts (``[gate_r | up_r]``), ``fc2`` row-parallel. The token refiner's blocks are sharded the
same way. Everything else is replicated: the per-head q/k norms (they act on one head's channels), the patch and
condition projections, the time embedder and the final layer (its AdaLN projection is 2·H wide).

Each block's AdaLN projection (``[18·H, time_embed_dim]``, about 40 % of the released DiT's parameters) is split too,
column-parallel in one contiguous part: rank ``r`` holds output features ``[r·18H/N, (r+1)·18H/N)``, and
:meth:`~.adaln.H3AdaLNProjection.compute_flat` all-gathers the shares in rank order, which is the whole row again
(a few rows per step: one per distinct timestep and modality). Every output value is the same dot product as on one
rank, and the AdaLN schedule cache builds its tables through that same ``compute_flat``, so its table path stays
bit-identical to the direct one; the tables themselves are whole on every rank (no collective on the table path),
and its "tables ≥ weights → direct" rule compares them with this rank's shard. DTensor does not run these linears
(:func:`linear_plan` leaves them out): their weights stay plain tensors, which the cache's weight offload takes.

The checkpoint plans name the *stored* tensors, so each rank reads only its rows
(:func:`omnicore.plugin.read_sharded_state_dict`): diffusers' separate ``to_q`` / ``to_k`` / ``to_v`` are split on
their own and concatenated locally as ``[Q_r; K_r; V_r]``; its ``ff.net.0.proj`` (``[up | gate]``) in two parts,
then the halves are swapped locally; the official head-grouped ``qkv_proj`` (``[heads, 3, D]`` rows) in one part
(whole heads) and regrouped with this rank's head count.
"""

from __future__ import annotations

from omnicore.plugin import ShardRule, TensorParallelPlan

from .config import BLOCK_EXPAND, MODALITY_NUM, MiniMaxH3TransformerConfig

_ATTN_MLP = (ShardRule("*.attn.out_proj", "row"), ShardRule("*.mlp.fc1", "column", chunks=2),
             ShardRule("*.mlp.fc2", "row"))


#: the DiT blocks' AdaLN projections (ours and the official layout's names; not the final layer's, not the refiner)
ADALN = ShardRule("blocks.*.adaln_proj.linear", "column")


def _divisors(config: MiniMaxH3TransformerConfig) -> tuple[tuple[str, int], ...]:
    return (("attention heads", config.num_attention_heads), ("FFN width", config.ffn_dim),
            ("AdaLN width", MODALITY_NUM * BLOCK_EXPAND * config.hidden_size))


def module_plan(config: MiniMaxH3TransformerConfig) -> TensorParallelPlan:
    """The plan over :class:`~.model.MiniMaxH3DiT`'s module names (also what sizes a meta-device model)."""
    return TensorParallelPlan((ShardRule("*.attn.qkv_proj", "column", chunks=3), *_ATTN_MLP, ADALN),
                              _divisors(config))


def linear_plan(config: MiniMaxH3TransformerConfig) -> TensorParallelPlan:
    """The linears DTensor runs (``parallelize``): :func:`module_plan` less the AdaLN projections, which gather
    their own outputs."""
    plan = module_plan(config)
    return TensorParallelPlan(tuple(r for r in plan.rules if r != ADALN), plan.divisors)


def checkpoint_plan(config: MiniMaxH3TransformerConfig, fmt: str, qkv_layout: str = "head_grouped") -> (
        TensorParallelPlan):
    """The plan over the stored tensor names of a ``fmt`` (``"diffusers"`` / ``"official"``) checkpoint."""
    if fmt == "diffusers":
        rules = (ShardRule("*.attn.to_q", "column"), ShardRule("*.attn.to_k", "column"),
                 ShardRule("*.attn.to_v", "column"), ShardRule("*.attn.to_out.0", "row"),
                 ShardRule("*.ff.net.0.proj", "column", chunks=2), ShardRule("*.ff.net.2", "row"),
                 ShardRule("transformer_blocks.*.adaln_proj.linear", "column"))
        return TensorParallelPlan(rules, _divisors(config))
    chunks = 1 if qkv_layout == "head_grouped" else 3
    return TensorParallelPlan((ShardRule("*.attn.qkv_proj", "column", chunks=chunks), *_ATTN_MLP, ADALN),
                              _divisors(config))


__all__ = ["ADALN", "checkpoint_plan", "linear_plan", "module_plan"]
