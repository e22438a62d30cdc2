"""Cache decisions every rank of a worker group takes alike (``--cache`` with ``--parallel``).

A step or block cache that decided on each rank's own data would let the ranks diverge: under Ulysses a rank
sees only its rows, and one rank skipping blocks while its peers run them deadlocks the collectives inside the
blocks. Two rules, both over the whole group (the default process group, so no extra groups are built):

* :func:`agreed_relative_l1` — the relative-L1 change ``Σ|a - b| / Σ|b|`` summed over every rank computing the
  same guidance branch (``a``/``b`` a rank's shard, or its replica under TP/EP: a replica adds the same share to
  both sums, so the ratio is unchanged) with one all-reduce of a ``[cfg, 2]`` float64 tensor; each rank writes
  its sums in the row of its CFG branch, so CFG ranks decide their own branch as the single process does. The
  sum over the shards is the single process's criterion (Ulysses pads the sequence to a multiple of the degree;
  padding rows count too).
* :func:`rank0_flag` — rank 0's boolean, broadcast (for decisions taken on replicated state, e.g. TeaCache's
  accumulated change of the modulated input: rank 0's value is the single process's).

Both are no-ops (the local value) without a worker group. Every rank must call them the same number of times in
the same order, which holds because each rank calls its model the same number of times per step. Their tensors live
on the default group's device (:func:`~.collectives.group_device`: the rank's accelerator under NCCL / HCCL, which
reduce device tensors only; the CPU under gloo). Tested on gloo; the NCCL / HCCL path is unverified here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .context import ParallelContext


def group_of(pipeline: object) -> ParallelContext | None:
    """The pipeline's :class:`~.context.ParallelContext` when it runs over more than one rank, else ``None``."""
    ctx = getattr(pipeline, "parallel", None)
    return ctx if ctx is not None and getattr(ctx, "world_size", 1) > 1 else None


def agreed_relative_l1(current: torch.Tensor, previous: torch.Tensor, ctx: ParallelContext | None) -> float:
    """``mean|current - previous| / mean|previous|`` over this branch's ranks (infinite for an all-zero
    ``previous``); with ``ctx`` ``None`` the local value."""
    import torch

    current, previous = current.detach(), previous.detach()
    num = (current - previous).abs().sum(dtype=torch.float64)
    den = previous.abs().sum(dtype=torch.float64)
    if ctx is not None:
        import torch.distributed as dist

        from .collectives import group_device

        device = group_device()  # NCCL / HCCL reduce device tensors only, gloo CPU ones
        sums = torch.zeros(max(1, ctx.cfg), 2, dtype=torch.float64, device=device)
        sums[ctx.cfg_rank if ctx.cfg > 1 else 0] = torch.stack([num.to(device), den.to(device)])
        dist.all_reduce(sums)
        ctx.stats.record("cache_all_reduce", sums.numel() * sums.element_size())
        num, den = sums[ctx.cfg_rank if ctx.cfg > 1 else 0]
    return float(num) / float(den) if float(den) > 0 else math.inf


def rank0_flag(flag: bool, ctx: ParallelContext | None) -> bool:
    """Rank 0's ``flag`` on every rank (``ctx`` ``None``: ``flag``)."""
    if ctx is None:
        return flag
    import torch
    import torch.distributed as dist

    from .collectives import group_device

    box = torch.tensor([1 if flag else 0], dtype=torch.int64, device=group_device())
    dist.broadcast(box, src=0)
    ctx.stats.record("cache_broadcast", box.numel() * box.element_size())
    return bool(box.item())


__all__ = ["agreed_relative_l1", "group_of", "rank0_flag"]
