"""CFG-parallel: the conditional and unconditional branches of a guided step on different ranks.

With ``cfg=2`` and guidance on, CFG rank ``c`` evaluates branch ``c`` only and the two predictions are exchanged
(one all-gather of the prediction per step), so both ranks combine them identically and their latents stay equal.
With guidance off there is one branch: :func:`data_parallel` splits the batch over the CFG ranks instead (each
rank takes a contiguous slice, the slices are gathered back; with fewer samples than ranks every rank computes
the whole batch and nothing is exchanged).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .collectives import all_gather_rows

if TYPE_CHECKING:
    import torch

    from .context import ParallelContext


def cfg_branches(ctx: ParallelContext, branches: Sequence[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
    """Run ``branches[ctx.cfg_rank]`` here and return every branch's result (all ranks get the same list)."""
    if len(branches) != ctx.cfg:
        raise ValueError(f"cfg={ctx.cfg} needs {ctx.cfg} branches, got {len(branches)}")
    mine = branches[ctx.cfg_rank]()
    return list(all_gather_rows(mine[None], ctx.cfg_group, ctx.stats).unbind(0))


def batch_slice(n: int, ctx: ParallelContext) -> slice | None:
    """This CFG rank's rows of a batch of ``n`` (``None``: too few rows to split, compute them all)."""
    if ctx.cfg == 1 or n < ctx.cfg:
        return None
    per = -(-n // ctx.cfg)
    start = min(ctx.cfg_rank * per, n)
    return slice(start, min(start + per, n))


def data_parallel(ctx: ParallelContext, n: int, run: Callable[[slice], torch.Tensor]) -> torch.Tensor | None:
    """``run(rows)`` on this rank's slice of a batch of ``n`` and the gathered ``[n, ...]`` result, or ``None``
    when the batch is not split (the caller then runs the whole batch itself)."""
    import torch

    rows = batch_slice(n, ctx)
    if rows is None:
        return None
    per = -(-n // ctx.cfg)
    local = run(rows)
    if local.shape[0] < per:  # the last rank's slice may be short: pad to equal shapes for the gather
        pad = local.new_zeros(per - local.shape[0], *local.shape[1:])
        local = torch.cat([local, pad])
    return all_gather_rows(local, ctx.cfg_group, ctx.stats)[:n]


__all__ = ["batch_slice", "cfg_branches", "data_parallel"]
