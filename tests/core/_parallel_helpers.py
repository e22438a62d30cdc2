"""Rank functions for the 2-process gloo tests of ``omnicore.parallel`` (spawned children import this by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from omnicore.attention.metadata import AttentionMetadata
from omnicore.attention.packed import PackedSequence
from omnicore.attention.reference import sdpa_attention
from omnicore.parallel.cfg import cfg_branches, data_parallel
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.context import build_groups
from omnicore.parallel.ulysses import SequenceShard, UlyssesAttention, padded_length


def collectives_rank(rank: int, init_file: str, dims: str) -> None:
    """Check Ulysses attention, CFG branches and the data-parallel split against single-process results."""
    config = ParallelConfig.parse(dims)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=config.world_size)
    try:
        ctx = build_groups(config, rank)
        if config.ulysses > 1:
            _check_ulysses(ctx)
        if config.cfg > 1:
            _check_cfg(ctx)
    finally:
        dist.destroy_process_group()


def _check_ulysses(ctx) -> None:  # type: ignore[no-untyped-def]
    p = ctx.ulysses
    for heads, kv_heads in ((4, 4), (4, 2)):
        torch.manual_seed(0)  # every rank draws the same full tensors
        lengths = [5, 1, 7]  # 13 rows: uneven documents, one cut by the shard boundary, padded to a multiple of P
        packed = PackedSequence.from_lengths(lengths, pad_to_multiple=p)
        assert packed.padded_length == padded_length(13, p)
        meta = AttentionMetadata.from_packed(packed)
        t = packed.padded_length
        q, k, v = torch.randn(t, heads, 8), torch.randn(t, kv_heads, 8), torch.randn(t, kv_heads, 8)
        expected = sdpa_attention(q, k, v, metadata=meta, scale=0.3)
        shard = SequenceShard(t, ctx.sp_rank, p)
        wrapped = UlyssesAttention(sdpa_attention, ctx)
        ctx.stats.reset()
        local = wrapped(shard.take(q), shard.take(k), shard.take(v), metadata=meta, scale=0.3)
        torch.testing.assert_close(local, shard.take(expected), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(shard.gather(local, ctx), expected, rtol=1e-5, atol=1e-6)
        sent = ctx.stats.snapshot()["sent_bytes"]["all_to_all"]
        rows = t // p
        # q and the output carry H heads, k and v Hkv; fp32 (4 bytes); a rank keeps 1/P of what it exchanges
        analytic = (2 * heads + 2 * kv_heads) * rows * 8 * 4 * (p - 1) // p
        assert sent == analytic, (sent, analytic)


def _check_cfg(ctx) -> None:  # type: ignore[no-untyped-def]
    cond, uncond = torch.full((2, 3), 1.0), torch.full((2, 3), -2.0)
    ran = []

    def branch(value: torch.Tensor, name: str):  # type: ignore[no-untyped-def]
        def run() -> torch.Tensor:
            ran.append(name)
            return value
        return run

    got = cfg_branches(ctx, [branch(cond, "cond"), branch(uncond, "uncond")])
    assert ran == [["cond", "uncond"][ctx.cfg_rank]]  # each rank computed one branch only
    torch.testing.assert_close(got[0], cond)
    torch.testing.assert_close(got[1], uncond)
    batch = torch.arange(15.0).reshape(5, 3)
    seen = []

    def rows_fn(rows: slice) -> torch.Tensor:
        seen.append((rows.start, rows.stop))
        return batch[rows] * 2
    torch.testing.assert_close(data_parallel(ctx, 5, rows_fn), batch * 2)  # uneven: 3 + 2 rows
    assert seen == [[(0, 3)], [(3, 5)]][ctx.cfg_rank]
    assert data_parallel(ctx, 1, rows_fn) is None  # one sample: not split
