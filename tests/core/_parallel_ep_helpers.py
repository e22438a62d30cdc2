"""Rank function of the 2-process gloo test of ``omnicore.parallel.experts`` (spawned children import it by name):
a stacked-expert layer run through :class:`ExpertDispatch` equals the single-process layer."""

from __future__ import annotations

import torch
import torch.distributed as dist
from omnicore.parallel.config import ParallelConfig
from omnicore.parallel.context import build_groups
from omnicore.parallel.experts import ExpertDispatch, expert_bytes_per_layer

EXPERTS, HIDDEN, TOP_K = 4, 8, 2


def reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Single process: every copy through its expert, weighted and summed per token."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            out[t] += weights[t, j] * (x[t] @ w[ids[t, j]].t())
    return out


def dispatch_rank(rank: int, init_file: str, token_counts: tuple[int, ...]) -> None:
    config = ParallelConfig.parse("ep=2")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ctx = build_groups(config, rank)
        for tokens in token_counts:
            _check(ctx, tokens)
    finally:
        dist.destroy_process_group()


def _check(ctx, tokens: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)  # every rank draws the same tokens, routing and experts
    x = torch.randn(tokens, HIDDEN)
    ids = torch.stack([torch.randperm(EXPERTS)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K)
    w = torch.randn(EXPERTS, HIDDEN, HIDDEN)
    per = EXPERTS // 2
    mine = w[ctx.ep_rank * per:(ctx.ep_rank + 1) * per]
    seen: list[int] = []

    def compute(rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        assert bool(((local >= 0) & (local < per)).all())
        seen.append(rows.shape[0])
        return torch.bmm(mine[local], rows[:, :, None])[:, :, 0]

    dispatch = ExpertDispatch(rank=ctx.ep_rank, degree=2, per_rank=per, group=ctx.ep_group, stats=ctx.stats)
    part = dispatch.token_slice(tokens)
    flat = ids[part].reshape(-1)
    tok = torch.arange(part.stop - part.start).repeat_interleave(TOP_K)
    ctx.stats.reset()
    y = dispatch.run(x[part][tok], flat, compute)
    local_out = (y.reshape(-1, TOP_K, HIDDEN) * weights[part][..., None]).sum(1)
    out = dispatch.gather(local_out, tokens)
    torch.testing.assert_close(out, reference(x, ids, w, weights), rtol=1e-5, atol=1e-5)
    # the owner ran exactly the copies routed to its experts, from both ranks' slices
    assert seen == [int(((ids // per) == ctx.ep_rank).sum())]
    sent = ctx.stats.snapshot()["sent_bytes"]["all_to_all"]
    remote = int(((flat // per) != ctx.ep_rank).sum())
    got_back = seen[0] - int(((ids[part] // per) == ctx.ep_rank).sum())  # copies other ranks sent here
    assert sent == remote * (HIDDEN * 4 + 4) + got_back * HIDDEN * 4, sent
    bound = expert_bytes_per_layer(tokens, TOP_K, 2, HIDDEN, 4)
    assert bound["all_reduce"] == tokens * HIDDEN * 4  # 2 (P-1)/P of the [T, H] partial sums
