"""Ulysses sequence parallelism: sequence shards in, head shards around attention, sequence shards out.

A model that declares ``"ulysses"`` keeps only its rank's rows of the packed sequence between attention calls
(:class:`SequenceShard`: the sequence is padded so every rank holds the same number of rows) and calls attention
through :class:`UlyssesAttention`. The wrapper swaps the row shards of ``q``, ``k``, ``v`` for head shards with one
all-to-all each, so every rank sees the *whole* sequence for ``H / P`` heads and runs the unchanged attention
backend on the unchanged packed metadata (the full sequence's ``cu_seqlens``: documents stay isolated, padding
rows stay a ``[real | pad]`` document); a last all-to-all brings the output back to row shards with all heads.

Per attention call each rank sends ``4 * (P - 1) / P * (T / P) * H * D`` elements (q, k, v and the output).
Unlike ring attention, every rank sees every key of its heads, so backends that rank keys over the whole sequence
(block-sparse plans such as RainFusion) keep working.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from ..errors import ConfigError
from .collectives import all_gather_rows, all_to_all_chunks

if TYPE_CHECKING:
    import torch

    from ..attention.metadata import AttentionMetadata
    from .context import ParallelContext


def check_heads(heads: int, degree: int, what: str = "attention heads", kv_heads: int | None = None) -> None:
    """Reject, at load, a head count that the Ulysses degree does not divide (ConfigError naming ``parallel``)."""
    for name, n in ((what, heads), ("key/value heads", kv_heads)):
        if n is not None and n % degree:
            raise ConfigError("parallel", f"ulysses={degree} must divide the model's {name} ({n}); "
                                          f"choose a degree among the divisors of {n}")


def padded_length(total: int, degree: int) -> int:
    """``total`` rounded up to a multiple of ``degree`` (every rank gets the same number of rows)."""
    return -(-total // degree) * degree


@attrs.frozen
class SequenceShard:
    """Rows ``[start, end)`` of a packed sequence of ``total`` rows (a multiple of ``world``) held by ``rank``."""

    total: int
    rank: int
    world: int

    def __attrs_post_init__(self) -> None:
        if self.total % self.world:
            raise ValueError(f"a sequence of {self.total} rows cannot be split evenly over {self.world} ranks; "
                             "pad it with padded_length() first")

    @property
    def rows(self) -> int:
        return self.total // self.world

    @property
    def start(self) -> int:
        return self.rank * self.rows

    @property
    def end(self) -> int:
        return self.start + self.rows

    def take(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's rows of a full-sequence tensor."""
        return x.narrow(dim, self.start, self.rows)

    def pieces(self, cu_seqlens: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """The documents this shard cuts: ``(document, local start, local end)`` for every document with rows
        in ``[start, end)`` — the per-shard ``cu_seqlens`` a model needs for per-document row operations."""
        out = []
        for i, (a, b) in enumerate(itertools.pairwise(cu_seqlens)):
            lo, hi = max(a, self.start), min(b, self.end)
            if lo < hi:
                out.append((i, lo - self.start, hi - self.start))
        return out

    def gather(self, local: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
        """The full sequence from every rank's rows (an all-gather over the Ulysses group)."""
        return all_gather_rows(local, ctx.sp_group, ctx.stats)


def seq_to_heads(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """``[T/P, H, D]`` rows of this rank -> ``[T, H/P, D]``: every row, this rank's heads."""
    p = ctx.ulysses
    rows, heads, dim = x.shape
    send = x.reshape(rows, p, heads // p, dim).transpose(0, 1)  # chunk j: my rows, rank j's heads
    return all_to_all_chunks(send, ctx.sp_group, ctx.stats).reshape(p * rows, heads // p, dim)


def heads_to_seq(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """``[T, H/P, D]`` -> ``[T/P, H, D]``: the inverse of :func:`seq_to_heads`."""
    p = ctx.ulysses
    total, heads, dim = x.shape
    send = x.reshape(p, total // p, heads, dim)  # chunk j: rank j's rows, my heads
    recv = all_to_all_chunks(send, ctx.sp_group, ctx.stats)  # [P (head owner), T/P, H/P, D]
    return recv.transpose(0, 1).reshape(total // p, p * heads, dim)


class UlyssesAttention:
    """An attention backend run over a Ulysses group; same call signature as the backend it wraps.

    Packed calls only: ``q [T/P, H, D]``, ``k, v [T/P, Hkv, D]`` (this rank's rows of a sequence padded to a
    multiple of ``P``) and the *full* sequence's :class:`~omnicore.attention.metadata.AttentionMetadata`.
    """

    def __init__(self, attention: Callable[..., torch.Tensor], ctx: ParallelContext) -> None:
        self.attention = attention
        self.ctx = ctx

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, metadata: AttentionMetadata | None = None,
                 **kwargs: Any) -> torch.Tensor:
        if metadata is None or q.dim() != 3:
            raise ValueError("UlyssesAttention takes packed [T/P, H, D] rows with the full sequence's metadata=")
        p = self.ctx.ulysses
        if q.shape[1] % p or k.shape[1] % p:
            raise ValueError(f"ulysses={p} does not divide the heads (q {q.shape[1]}, k/v {k.shape[1]})")
        if q.shape[0] * p < metadata.total_q:
            raise ValueError(f"{q.shape[0]} rows x {p} ranks do not hold the {metadata.total_q} rows the "
                             "metadata describes")
        out = self.attention(seq_to_heads(q, self.ctx), seq_to_heads(k, self.ctx), seq_to_heads(v, self.ctx),
                             metadata=metadata, **kwargs)
        return heads_to_seq(out, self.ctx)

    def __repr__(self) -> str:
        return f"UlyssesAttention({self.attention!r}, ulysses={self.ctx.ulysses})"


__all__ = ["SequenceShard", "UlyssesAttention", "check_heads", "heads_to_seq", "padded_length", "seq_to_heads"]
