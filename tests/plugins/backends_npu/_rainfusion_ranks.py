"""Rank function of the 2-process gloo RainFusion + Ulysses test (spawned children import this by name)."""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
from _npu_helpers import OPS, npu_rainfusion_on_cpu
from omni_backends_npu.rainfusion import build_plan, ulysses_plan
from omnicore.attention.metadata import AttentionMetadata
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.context import build_groups
from omnicore.parallel.ulysses import SequenceShard, UlyssesAttention


def ulysses_rank(rank: int, init_file: str) -> None:
    config = ParallelConfig.parse("ulysses=2")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ctx = build_groups(config, rank)
        torch.manual_seed(0)  # every rank draws the same full tensors
        grid, prefix, heads = (2, 16, 16), 30, 4
        used = prefix + 512
        total = used + 2  # [real | pad], padded to a multiple of the degree
        q, k, v = (torch.randn(total, heads, 16) for _ in range(3))
        meta = AttentionMetadata(cu_seqlens_q=(0, used, total), valid_kv_length=used, latent_grid=grid)
        plan = ulysses_plan(build_plan(prefix, grid, sparsity=0.5), ulysses=2)
        planned = attrs.evolve(meta, sparse_plan=plan)
        expected = npu_rainfusion_on_cpu(q, k, v, metadata=planned, scale=0.25)
        OPS.calls.clear()
        shard = SequenceShard(total, ctx.sp_rank, 2)
        local = UlyssesAttention(npu_rainfusion_on_cpu, ctx)(shard.take(q), shard.take(k), shard.take(v),
                                                            metadata=planned, scale=0.25)
        [call] = [c for c in OPS.calls if c.op == "sparse_attention"]
        assert call.kwargs["plan"] is plan and tuple(call.query.shape) == (1, used, heads // 2, 16)
        torch.testing.assert_close(shard.gather(local, ctx), expected, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()
