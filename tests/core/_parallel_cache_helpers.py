"""Rank function of the gloo test of ``omnicore.parallel.consensus`` (spawned children import it by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.consensus import agreed_relative_l1, rank0_flag
from omnicore.parallel.context import build_groups


def consensus_rank(rank: int, init_file: str, dims: str) -> None:
    config = ParallelConfig.parse(dims)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=config.world_size)
    try:
        ctx = build_groups(config, rank)
        torch.manual_seed(0)  # the same full tensors everywhere; one per CFG branch
        full = [(torch.randn(10, 4), torch.randn(10, 4)) for _ in range(2)]
        branch = ctx.cfg_rank if config.cfg > 1 else 0
        cur, prev = full[branch]
        if config.ulysses > 1:  # a Ulysses rank holds its rows only
            rows = 10 // config.ulysses
            cur, prev = (t[ctx.sp_rank * rows:(ctx.sp_rank + 1) * rows] for t in (cur, prev))
        expected = float((full[branch][0] - full[branch][1]).abs().mean() / full[branch][1].abs().mean())
        got = agreed_relative_l1(cur, prev, ctx)
        assert abs(got - expected) < 1e-6 * expected, (got, expected)
        local = agreed_relative_l1(cur, prev, None)
        if config.ulysses > 1:
            assert abs(local - expected) > 1e-4  # a shard's own value differs: the agreement is needed
        assert rank0_flag(rank == 0, ctx) is True and rank0_flag(rank != 0, ctx) is False
    finally:
        dist.destroy_process_group()
