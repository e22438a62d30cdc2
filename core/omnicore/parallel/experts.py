"""Expert parallelism (``--parallel ep=N``): token dispatch to the rank holding each routed expert and back.

Within an expert-parallel group every rank sees the same tokens (the group's members share every other grid
coordinate) and the router is replicated, so each rank computes the same top-k choice as the single-process model.
:class:`ExpertDispatch` then gives each rank a contiguous slice of the tokens (:meth:`~ExpertDispatch.token_slice`):
the rank sends each of its token copies (one per selected expert) to the rank that holds that expert with one
``all_to_all_single`` (row counts exchanged first), the owner runs its experts on what it received and a second
all-to-all sends every copy's output back in the order it came (:meth:`~ExpertDispatch.run`); the model weights
and sums the copies of its slice exactly as its single-process forward does, and :meth:`~ExpertDispatch.gather`
all-gathers the slices so every rank holds the whole layer output again.

Rows an owner receives keep the senders' order (sender 0's tokens first, each in token order), so after the stable
sort by expert each expert multiplies the same rows in the same order as the single-process model.

Bytes per MoE layer and rank (``T`` tokens, ``k`` experts per token, ``P`` ranks, ``H`` hidden, ``b`` bytes per
value, uniform routing): ``k·T/P · (P-1)/P · (2·H·b + 4)`` for dispatch and combine (each copy's rows out and
back, its int32 expert id out) plus ``(P-1) · T/P · H·b`` for the gather (the per-rank row counts exchanged first
are not counted), against ``2 (P-1)/P · T·H·b`` for the all-reduce of replicated partial sums
(:func:`expert_bytes_per_layer` gives both). With tokens replicated across the group the all-reduce moves fewer
bytes whenever ``k > 1``; dispatch wins when the tokens are not replicated (a data-parallel expert group), which
the rank grid does not build today. Models offer both (``dispatch="all_to_all"`` or ``"all_reduce"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from .context import CommStats

DISPATCH_MODES = ("all_to_all", "all_reduce")


def check_expert_degree(num_experts: int, degree: int) -> None:
    """Refuse an expert-parallel degree that does not divide the routed experts (a ConfigError naming both)."""
    if num_experts % degree:
        raise ConfigError("parallel", f"ep={degree} must divide the model's routed experts ({num_experts}); "
                                      f"choose a degree among the divisors of {num_experts}")


def check_dispatch(mode: str) -> str:
    if mode not in DISPATCH_MODES:
        raise ConfigError("ep_dispatch", f"must be one of {', '.join(DISPATCH_MODES)}, got {mode!r}")
    return mode


def expert_bytes_per_layer(tokens: int, top_k: int, degree: int, hidden: int, itemsize: int) -> dict[str, float]:
    """Analytic bytes one rank sends per MoE layer under uniform routing, per dispatch mode."""
    p = degree
    share = tokens / p
    return {
        "all_to_all": top_k * share * (p - 1) / p * (2 * hidden * itemsize + 4) + (p - 1) * share * hidden * itemsize,
        "all_reduce": 2 * (p - 1) / p * tokens * hidden * itemsize,
    }


def _all_to_all_rows(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: ProcessGroup | None,
                     stats: CommStats | None, rank: int) -> torch.Tensor:
    """Rows ``send`` (``send_counts[j]`` of them for group rank ``j``, in order) -> the rows each rank sent here."""
    import torch.distributed as dist

    send = send.contiguous()
    recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
    dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=send_counts, group=group)
    if stats is not None:
        row = send[0].numel() * send.element_size() if send.shape[0] else 0
        stats.record("all_to_all", row * (sum(send_counts) - send_counts[rank]))
    return recv


class ExpertDispatch:
    """One expert-parallel group's dispatch: ``rank`` of ``degree`` holds experts ``[rank·per, (rank+1)·per)``."""

    def __init__(self, *, rank: int, degree: int, per_rank: int, group: ProcessGroup | None,
                 stats: CommStats | None = None) -> None:
        self.rank, self.degree, self.per_rank = rank, degree, per_rank
        self.group, self.stats = group, stats

    def token_slice(self, tokens: int) -> slice:
        """The tokens whose copies this rank dispatches (``ceil(T / P)`` each, the last ranks fewer)."""
        per = -(-tokens // self.degree)
        return slice(min(tokens, self.rank * per), min(tokens, (self.rank + 1) * per))

    def run(self, rows: torch.Tensor, experts: torch.Tensor,
            compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``rows [N, H]`` (one per token copy) routed to global ``experts [N]`` -> each copy's expert output
        ``[N, H']``, in the same order. ``compute(rows, local_ids)`` runs this rank's experts (``local_ids`` in
        ``[0, per_rank)``) on what it received and returns one output row per input row."""
        import torch
        import torch.distributed as dist

        dest = torch.div(experts, self.per_rank, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        send_counts_t = torch.bincount(dest, minlength=self.degree)
        recv_counts_t = torch.empty_like(send_counts_t)
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=self.group)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()
        local = (experts - dest * self.per_rank)[order].to(torch.int32)
        got_rows = _all_to_all_rows(rows[order], send_counts, recv_counts, self.group, self.stats, self.rank)
        got_ids = _all_to_all_rows(local, send_counts, recv_counts, self.group, self.stats, self.rank)
        outputs = compute(got_rows, got_ids.long())
        back = _all_to_all_rows(outputs, recv_counts, send_counts, self.group, self.stats, self.rank)
        result = torch.empty_like(back)
        result[order] = back
        return result

    def gather(self, local: torch.Tensor, tokens: int) -> torch.Tensor:
        """Every rank's slice output (``[n, ...]`` for :meth:`token_slice`) concatenated to ``[tokens, ...]``."""
        from .collectives import all_gather_rows

        per = -(-tokens // self.degree)
        if local.shape[0] < per:
            local = torch_pad_rows(local, per)
        return all_gather_rows(local, self.group, self.stats)[:tokens]


def torch_pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows``."""
    import torch

    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))], dim=0)


__all__ = ["DISPATCH_MODES", "ExpertDispatch", "check_dispatch", "check_expert_degree", "expert_bytes_per_layer"]
