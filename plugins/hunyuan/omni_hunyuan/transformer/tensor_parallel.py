"""Tensor parallelism of the HunyuanImage-3 language model (``--parallel tp=N``): its sharding plan.

Megatron's placement: the grouped-query ``qkv_proj`` (``[Q; K; V]`` rows of ``heads``, ``kv_heads``, ``kv_heads``
heads) is column-parallel per part, so rank ``r`` holds key/value heads ``[r·kv/N, (r+1)·kv/N)`` and exactly the
query heads that attend to them (query head ``i`` reads key/value head ``i // groups``; the checkpoint's grouped
layout orders them that way); ``o_proj`` is row-parallel. The dense MLP and each MoE layer's shared MLP are
column-parallel in ``gate_proj`` / ``up_proj`` and row-parallel in ``down_proj``. The routed experts are split the
same way inside every expert (``w_gate`` / ``w_up`` rows, ``w_down`` columns; ``ShardRule.params``) and their
partial sum is all-reduced by the model; the router (``mlp.gate``) is replicated, so every rank picks the same
top-k experts as the single-process model. Embeddings, norms, ``lm_head``, the timestep embedders, the patch
UNets, the VAE and the vision tower stay replicated. Each rank's prefix K/V cache holds its own heads only.
"""

from __future__ import annotations

from omnicore.plugin import ShardRule, TensorParallelPlan

from .config import HunyuanConfig


def module_plan(config: HunyuanConfig) -> TensorParallelPlan:
    """The plan over :class:`~.model.HunyuanImage3`'s module names (also what sizes a meta-device model)."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    rules = (
        ShardRule("model.layers.*.self_attn.qkv_proj", "column", parts=(heads, kv, kv)),
        ShardRule("model.layers.*.self_attn.o_proj", "row"),
        ShardRule("model.layers.*.gate_proj", "column"),  # the dense MLP and the MoE layers' shared MLP
        ShardRule("model.layers.*.up_proj", "column"),
        ShardRule("model.layers.*.down_proj", "row"),
        ShardRule("model.layers.*.mlp.experts", "row", params=(("w_gate", 1), ("w_up", 1), ("w_down", 2))),
    )
    divisors = [("attention heads", heads), ("key/value heads", kv), ("MLP width", config.intermediate_size)]
    if config.num_experts:
        divisors.append(("expert MLP width", config.moe_intermediate_size))
    return TensorParallelPlan(rules, tuple(divisors))


def checkpoint_plan() -> TensorParallelPlan:
    """The same split over the release checkpoint's stored names: the grouped ``qkv_proj`` rows
    (``[kv_heads, groups + 2, D]``: one part, so a rank reads whole key/value heads with their query heads), the
    fused ``gate_and_up_proj`` (``[up | gate]``, two parts) of the dense MLP, the shared MLP and every expert, and
    their ``down_proj`` / ``o_proj`` columns."""
    return TensorParallelPlan((
        ShardRule("model.layers.*.self_attn.qkv_proj", "column"),
        ShardRule("model.layers.*.self_attn.o_proj", "row"),
        ShardRule("model.layers.*.gate_and_up_proj", "column", chunks=2),
        ShardRule("model.layers.*.down_proj", "row"),
    ))


__all__ = ["checkpoint_plan", "module_plan"]
